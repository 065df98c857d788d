"""Word starts of Chinese text for whole-word masking (Cui et al. 2021, BERT-wwm).

BERT's tokenizer makes every CJK ideograph a word of its own, so whole-word masking of Chinese
would mask single characters. BERT-wwm masks whole words instead, as a word segmenter (jieba)
finds them: `chinese_word_starts` marks where those words start among a sentence's WordPiece
tokens, and the corpus cache stores the marks with the token ids.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from types import ModuleType

import numpy as np

from attnlab.errors import AttnlabError


class JiebaSegmenter:
    """jieba's segmenter, imported at the first text with an ideograph (English needs none)."""

    def __init__(self) -> None:
        self.module: ModuleType | None = None

    def tokenize(self, text: str) -> Iterator[tuple[str, int, int]]:
        """jieba.tokenize(text): (word, start, end) of each word."""
        if self.module is None:
            try:
                import jieba
            except ImportError as error:
                raise AttnlabError(
                    "whole-word masking of Chinese text needs the jieba package for word "
                    "segmentation: pip install jieba"
                ) from error
            import logging

            jieba.setLogLevel(logging.WARNING)  # silence its "Building prefix dict" chatter
            self.module = jieba
        return self.module.tokenize(text)


# The ranges of _is_cjk, for a fast test of a whole sentence.
_IDEOGRAPH = re.compile(
    "[\u4e00-\u9fff\u3400-\u4dbf\U00020000-\U0002a6df\U0002a700-\U0002b73f"
    "\U0002b740-\U0002b81f\U0002b820-\U0002ceaf\uf900-\ufaff\U0002f800-\U0002fa1f]"
)


def _is_cjk(char: str) -> bool:
    """Whether `char` is a CJK ideograph (the ranges BERT's tokenizer splits one per token)."""
    code = ord(char)
    return (
        0x4E00 <= code <= 0x9FFF
        or 0x3400 <= code <= 0x4DBF
        or 0x20000 <= code <= 0x2A6DF
        or 0x2A700 <= code <= 0x2B73F
        or 0x2B740 <= code <= 0x2B81F
        or 0x2B820 <= code <= 0x2CEAF
        or 0xF900 <= code <= 0xFAFF
        or 0x2F800 <= code <= 0x2FA1F
    )


def chinese_word_starts(
    segmenter: JiebaSegmenter, text: str, offsets: list[tuple[int, int]], starts: np.ndarray
) -> np.ndarray:
    """Word starts where each Chinese character starts a word only at a jieba word's start."""
    # WordPiece makes every ideograph a word of its own; jieba's segmentation joins them
    # back into words (BERT-wwm), while other tokens keep the '##' rule. jieba only joins:
    # a '##' piece (an ideograph inside a WordPiece word, as with tokenize_chinese_chars
    # off) stays inside its word even where jieba starts one.
    if not _IDEOGRAPH.search(text):  # nothing for jieba to join (and no jieba needed)
        return starts
    jieba_starts = {start for _, start, _ in segmenter.tokenize(text)}
    starts = starts.copy()
    for k, (begin, _) in enumerate(offsets):
        if starts[k] and begin < len(text) and _is_cjk(text[begin]):
            starts[k] = begin in jieba_starts
    return starts
