"""Sentences and documents of a plain-text corpus, as BERT's pretraining data reads them.

google-research/bert's `create_pretraining_data.py` reads a corpus as documents of sentences:
one sentence a line, a blank line between documents. Corpora laid out otherwise (a paragraph a
line, as wikitext; a document a line) are split here into sentences at their final punctuation,
Chinese or English. A file is read in bounded pieces, and a run of text with no sentence end is
cut into pieces of at most `_MAX_SENTENCE_CHARS`, so that a line of any size costs bounded
memory here and in the tokenizer after.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from attnlab.errors import AttnlabError
from attnlab.io import text_pieces

_PIECE_BYTES = 1 << 20  # a corpus line is read this many bytes at a time at most
# A "sentence" longer than this (text with no sentence end: a line of unpunctuated Chinese,
# a dump) is cut into pieces, at a space where there is one: held whole, such a line costs
# the tokenizer many times its size in memory, and time to match. A real sentence is far
# shorter, and an NSP/SOP segment keeps at most max_seq_len tokens of it anyway, so each piece
# serves as a sentence of its own. The corpus cache's format number records this bound.
_MAX_SENTENCE_CHARS = 4096

# A run of sentence-final punctuation and the closing quotes or brackets that follow it.
_SENTENCE_END = re.compile(r"[.!?。！？；…]+[\"'”’»)）\]】」』》〉]*")
_CJK_FINAL = frozenset("。！？；…")
_EXCLAIMS = frozenset("!?")
_CJK_OR_FULL_WIDTH = re.compile(r"[\u3400-\u9fff\uf900-\ufaff\u3000-\u303f\uff00-\uffef]")


def split_sentences(text: str) -> list[str]:
    """Split plain Chinese or English text into sentences, never returning empty strings."""
    return _LineSplitter().feed(text, ends_line=True)


class _LineSplitter:
    """split_sentences for a line that arrives in pieces, holding only its unfinished sentence."""

    def __init__(self) -> None:
        self.text = ""  # the line from the last sentence end on
        self.scan = 0  # where in text the next sentence-end search starts

    def feed(self, piece: str, ends_line: bool) -> list[str]:
        """The sentences that piece completes; at the line's end, the rest of the line too.

        A sentence longer than _MAX_SENTENCE_CHARS comes out in pieces no longer than that,
        so the text held between calls stays bounded too.
        """
        text = self.text + piece if self.text else piece
        scan, length = self.scan, len(text)
        sentences: list[str] = []
        start = 0
        # A search resumed where the last one stopped finds the same runs as one over the
        # whole line: the pattern looks at no text before a run.
        for match in _SENTENCE_END.finditer(text, scan):
            end = match.end()
            if end == length and not ends_line:  # the run may go on in the next piece
                scan = match.start()
                break
            scan = end
            following = text[end : end + 1]
            # Chinese full stops end a sentence wherever they stand; an English '.', '!' or
            # '?' only before a space or the end, so that 3.14 and U.S.A stay whole (and '!'
            # or '?' before a Chinese character too, as in 真的吗?是的).
            run = match.group()
            if (
                not following
                or following.isspace()
                or not _CJK_FINAL.isdisjoint(run)
                or (_CJK_OR_FULL_WIDTH.match(following) and not _EXCLAIMS.isdisjoint(run))
            ):
                _add_sentence(sentences, text, start, end)
                start = end
        else:
            scan = length
        if ends_line:
            _add_sentence(sentences, text, start, length)
            self.text, self.scan = "", 0
        else:
            # Up to scan no sentence ends: what exceeds the bound there can go now.
            held = _add_pieces(sentences, text, start, _cuts(text, start, scan))
            self.text, self.scan = text[held:], scan - held
        return sentences


def _cuts(text: str, start: int, end: int) -> list[int]:
    """Where to cut text[start:end] into pieces of at most _MAX_SENTENCE_CHARS (none if shorter).

    Each cut follows the last white space within the bound, so that words stay whole; text
    with no space there (Chinese) is cut at the bound. The last piece ends at ``end``.
    """
    ends = []
    while end - start > _MAX_SENTENCE_CHARS:
        space = max(text.rfind(c, start + 1, start + _MAX_SENTENCE_CHARS) for c in " \t\u3000")
        start = space + 1 if space > start else start + _MAX_SENTENCE_CHARS
        ends.append(start)
    return ends


def _add_sentence(sentences: list[str], text: str, start: int, end: int) -> None:
    """Append text[start:end], stripped, in pieces of at most _MAX_SENTENCE_CHARS (if not blank)."""
    _add_pieces(sentences, text, start, [*_cuts(text, start, end), end])


def _add_pieces(sentences: list[str], text: str, start: int, ends: list[int]) -> int:
    """Append the pieces text[start:ends[0]], text[ends[0]:ends[1]], ... that are not blank.

    Each stripped; returns the last end (start if ends is empty).
    """
    for end in ends:
        piece = text[start:end].strip()
        if piece:
            sentences.append(piece)
        start = end
    return start


def read_sentences(path: str | Path) -> Iterator[tuple[str, bool]]:
    """Yield the sentences of a UTF-8 text file (.gz too), each with whether it ends its document.

    The documents of `read_documents`, one sentence at a time: a document or line of any
    size costs only its sentence at hand (the file is read in pieces of _PIECE_BYTES).
    """
    path = Path(path)
    if not path.is_file():
        raise AttnlabError(f"corpus file {path} not found")
    blank_separated = _has_blank_separator(path)
    splitter = _LineSplitter()
    pending: str | None = None  # yielded once the next sentence or document end is known
    blank = True  # the line read so far holds only white space
    for piece, ends_line in _read_pieces(path):
        for sentence in splitter.feed(piece, ends_line):
            if pending is not None:
                yield pending, False
            pending = sentence
        blank = blank and (not piece or piece.isspace())
        if ends_line:
            # A blank line ends a document; without blank lines, so does every line.
            if pending is not None and (blank or not blank_separated):
                yield pending, True
                pending = None
            blank = True
    if pending is not None:
        yield pending, True


def read_documents(path: str | Path) -> Iterator[list[str]]:
    """Yield the documents of a UTF-8 text file (.gz too), each a list of sentences.

    With blank lines between documents (google-research/bert's layout) each line holds
    sentences of the current document; without them each non-empty line is one document.
    Lines pass through `split_sentences` in both layouts, which leaves a line holding one
    sentence as it is and splits paragraph lines (wikitext) into sentences.
    """
    document: list[str] = []
    for sentence, ends_document in read_sentences(path):
        document.append(sentence)
        if ends_document:
            yield document
            document = []


def _has_blank_separator(path: Path) -> bool:
    """Whether a blank line stands between two non-blank lines (a document separator)."""
    # Blank as read_documents (and google's line.strip()) sees it: a line of full-width
    # spaces (U+3000) or only a byte-order mark is blank too, which bytes.strip() missed.
    seen_text = seen_blank = False
    blank = True
    for piece, ends_line in _read_pieces(path):
        blank = blank and (not piece or piece.isspace())
        if not ends_line:
            continue
        if not blank:
            if seen_blank:
                return True
            seen_text = True
        elif seen_text:
            seen_blank = True
        blank = True
    return False


def _read_pieces(path: Path) -> Iterator[tuple[str, bool]]:
    """Yield the lines of a corpus file as text in bounded pieces (io.text_pieces)."""
    return text_pieces(path, "corpus file ", _PIECE_BYTES)
