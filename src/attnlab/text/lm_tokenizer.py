"""Tokenizers of a decoder-only language model: characters, or GPT-2's byte-level BPE.

Both run in HF `tokenizers`. The character tokenizer (nanoGPT's `shakespeare_char`) gives each
distinct character of the corpus an id, in code-point order, with no normalisation and no
special token: encode then decode gives any text of those characters back exactly, and a
character outside the vocabulary is an error that names it. The byte-level BPE (Radford et al.
2019, section 2.2) maps every byte to one of 256 printable symbols before the merges, so any
text encodes, without an unknown token; it is saved in GPT-2's files (``vocab.json`` +
``merges.txt``) and as ``tokenizer.json``, and ``<|endoftext|>`` separates documents.
``LMTokenizer.from_dir`` reads either from a model folder, an HF ``GPT2TokenizerFast`` folder
included.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors, trainers

from attnlab.errors import AttnlabError
from attnlab.io import check_input_file, text_pieces, write_text_atomic

CHAR, BYTE_BPE = "char", "byte-bpe"
KINDS = (CHAR, BYTE_BPE)
END_OF_TEXT = "<|endoftext|>"  # GPT-2's one special token: end of a document
BYTE_ALPHABET = 256  # a byte-level vocabulary holds every byte's symbol
MAX_BYTE_BPE_VOCAB = 1_000_000
KIND_KEY = "attnlab_tokenizer"  # tokenizer_config.json: which of KINDS a folder holds
TOKENIZER_FILE, CONFIG_FILE = "tokenizer.json", "tokenizer_config.json"
VOCAB_FILE, MERGES_FILE = "vocab.json", "merges.txt"


class LMTokenizer:
    """A language model's tokenizer: ``kind`` "char" or "byte-bpe" (HF `tokenizers` underneath)."""

    def __init__(self, backend: tokenizers.Tokenizer, kind: str) -> None:
        """Wrap a backend of one of KINDS (from_dir and the trainers build them)."""
        if kind not in KINDS:
            raise AttnlabError(f"tokenizer kind must be one of {', '.join(KINDS)}, got {kind!r}")
        backend.no_padding()
        backend.no_truncation()
        self.backend, self.kind = backend, kind
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.eos_id: int | None = backend.token_to_id(END_OF_TEXT) if kind == BYTE_BPE else None
        self._vocab = backend.get_vocab(with_added_tokens=True)

    @property
    def pad_id(self) -> int:
        """The id a left-padded batch fills with (masked out: any id would do)."""
        return self.eos_id if self.eos_id is not None else 0

    # ---- text <-> ids ---------------------------------------------------------------------

    def unknown_characters(self, text: str) -> list[str]:
        """The characters of text a character vocabulary lacks, in order of first use."""
        if self.kind != CHAR:
            return []  # every byte has a symbol
        return [c for c in dict.fromkeys(text) if c not in self._vocab]

    def check_known(self, text: str, what: str = "the text") -> None:
        """Raise AttnlabError naming the characters of text outside a character vocabulary."""
        unknown = self.unknown_characters(text)
        if unknown:
            shown = ", ".join(repr(c) for c in unknown[:10])
            more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
            raise AttnlabError(
                f"{what} holds {len(unknown)} character(s) outside the model's character "
                f"vocabulary of {self.vocab_size}: {shown}{more}"
            )

    def encode(self, text: str, what: str = "the text") -> list[int]:
        """Token ids of text (no special tokens added)."""
        self.check_known(text, what)
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str], what: str = "the text") -> list[list[int]]:
        """encode() of many texts, in parallel threads."""
        for text in texts:
            self.check_known(text, what)
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=False)
        return [e.ids for e in encodings]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text of ids (``<|endoftext|>`` dropped unless skip_special_tokens is False)."""
        ids = list(ids)
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:  # tokenizers drops an unknown id in silence
            raise AttnlabError(f"token id {bad} is outside the vocabulary (size {self.vocab_size})")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def stream(self) -> Iterator[str]:
        """A generator that takes ids by ``send`` and yields the text each completes ("" if none).

        A character split over byte-level tokens comes out once its last byte arrives.
        """
        decoder = decoders.DecodeStream(skip_special_tokens=True)
        text = ""
        while True:
            token_id = yield text
            text = decoder.step(self.backend, token_id) or ""

    # ---- files ----------------------------------------------------------------------------

    def save(self, out_dir: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (and GPT-2's vocab.json + merges.txt)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out / TOKENIZER_FILE, self.backend.to_str(pretty=True))
        config: dict[str, object] = {KIND_KEY: self.kind}
        if self.kind == BYTE_BPE:
            merges = json.loads(self.backend.to_str())["model"]["merges"]
            lines = [" ".join(pair) if isinstance(pair, list) else pair for pair in merges]
            ordered = dict(sorted(self._vocab.items(), key=lambda item: item[1]))
            write_text_atomic(out / VOCAB_FILE, json.dumps(ordered, ensure_ascii=False))
            write_text_atomic(
                out / MERGES_FILE, "#version: 0.2\n" + "".join(f"{m}\n" for m in lines)
            )
            config |= {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False}
            config |= {name: END_OF_TEXT for name in ("bos_token", "eos_token", "unk_token")}
        else:
            config |= {"tokenizer_class": "PreTrainedTokenizerFast"}
        write_text_atomic(out / CONFIG_FILE, json.dumps(config, indent=2) + "\n")

    @classmethod
    def from_dir(cls, path: str | Path) -> LMTokenizer:
        """The tokenizer of a model or tokenizer folder: tokenizer.json, else vocab.json + merges.txt."""
        root = Path(path)
        if not root.is_dir():
            raise AttnlabError(f"tokenizer folder {root} not found")
        file = root / TOKENIZER_FILE
        if file.is_file():
            try:
                backend = tokenizers.Tokenizer.from_file(str(file))
            except Exception as error:  # tokenizers raises plain Exception on bad JSON
                raise AttnlabError(f"cannot read {file}: {error}") from None
            return cls(backend, _kind_of(backend, file))
        if (root / VOCAB_FILE).is_file() and (root / MERGES_FILE).is_file():
            try:
                model = models.BPE.from_file(str(root / VOCAB_FILE), str(root / MERGES_FILE))
            except Exception as error:
                raise AttnlabError(
                    f"cannot read {root}'s {VOCAB_FILE} + {MERGES_FILE}: {error}"
                ) from None
            return cls(_byte_level(tokenizers.Tokenizer(model)), BYTE_BPE)
        if (root / "vocab.txt").is_file():
            raise AttnlabError(
                f"{root} holds a WordPiece vocab.txt (a BERT tokenizer): a language model needs "
                f"characters or byte-level BPE ({TOKENIZER_FILE}, or {VOCAB_FILE} + {MERGES_FILE})"
            )
        raise AttnlabError(
            f"no {TOKENIZER_FILE} (nor {VOCAB_FILE} + {MERGES_FILE}) in {root}: is this a "
            "language model or tokenizer folder?"
        )

    def __repr__(self) -> str:
        return f"LMTokenizer(kind={self.kind!r}, vocab_size={self.vocab_size})"


def _kind_of(backend: tokenizers.Tokenizer, file: Path) -> str:
    """Which of KINDS a tokenizer.json holds, or an error naming what it holds instead."""
    model = backend.model
    if isinstance(model, models.WordLevel) and isinstance(
        backend.pre_tokenizer, pre_tokenizers.Split
    ):
        return CHAR
    if isinstance(model, models.BPE) and isinstance(backend.decoder, decoders.ByteLevel):
        return BYTE_BPE
    raise AttnlabError(
        f"{file} holds a {type(model).__name__} tokenizer, not characters or byte-level BPE: "
        "is this a BERT or translation model?"
    )


def _byte_level(backend: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    """GPT-2's pipeline on a BPE model: bytes as symbols, its split regex, no prefix space."""
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    if backend.token_to_id(END_OF_TEXT) is not None:  # typed in a text it stays one token
        backend.add_special_tokens([AddedToken(END_OF_TEXT, special=True, normalized=False)])
    return backend


# ---- training ------------------------------------------------------------------------------


def _corpus_texts(files: Iterable[str | Path]) -> Iterator[str]:
    """The text of each corpus file in pieces (a line or part of a long one), endings kept."""
    paths = [Path(f) for f in files]
    if not paths:
        raise AttnlabError("a tokenizer needs at least one corpus file")
    for path in paths:
        check_input_file(path, "corpus file")
    for path in paths:
        for piece, _ in text_pieces(path, "corpus file "):
            yield piece


def char_tokenizer(characters: Iterable[str]) -> LMTokenizer:
    """A character tokenizer of these characters, ids in code-point order (as nanoGPT's)."""
    alphabet = sorted(set(characters))
    if not alphabet:
        raise AttnlabError("no characters to build a vocabulary from: the corpus is empty")
    backend = tokenizers.Tokenizer(models.WordLevel({c: i for i, c in enumerate(alphabet)}))
    # One piece per character, whitespace and line breaks included; Fuse joins them back.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return LMTokenizer(backend, CHAR)


def train_char(files: Iterable[str | Path]) -> LMTokenizer:
    """A character vocabulary: every distinct character of the corpus files."""
    seen: set[str] = set()
    for text in _corpus_texts(files):
        seen.update(text)
    if not seen:
        raise AttnlabError(f"corpus {', '.join(str(f) for f in files)} has no text")
    return char_tokenizer(seen)


def train_byte_bpe(
    files: Iterable[str | Path], vocab_size: int, min_frequency: int = 2
) -> LMTokenizer:
    """GPT-2's byte-level BPE learnt on the corpus files: 256 byte symbols, merges, <|endoftext|>."""
    files = list(files)
    if not BYTE_ALPHABET + 1 <= vocab_size <= MAX_BYTE_BPE_VOCAB:
        raise AttnlabError(
            f"vocab_size of a byte-level BPE must be from {BYTE_ALPHABET + 1} (every byte and "
            f"{END_OF_TEXT}) to {MAX_BYTE_BPE_VOCAB:,}, got {vocab_size}",
            options=("vocab_size",),
        )
    seen_text = False

    def batches() -> Iterator[list[str]]:
        nonlocal seen_text
        batch: list[str] = []
        for text in _corpus_texts(files):
            seen_text = seen_text or bool(text)
            batch.append(text)
            if len(batch) == 1000:
                yield batch
                batch = []
        if batch:
            yield batch

    backend = _byte_level(tokenizers.Tokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(batches(), trainer=trainer)
    if not seen_text:
        raise AttnlabError(f"corpus {', '.join(str(f) for f in files)} has no text")
    return LMTokenizer(_byte_level(backend), BYTE_BPE)
