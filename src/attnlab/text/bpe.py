"""Joint source/target BPE for translation (Sennrich et al. 2016; Vaswani et al. 2017, §5.1).

Every step runs in HF `tokenizers`: NFC normalisation (canonical composition only), a
Metaspace pre-tokenizer that turns each space into "▁" glued to the next word, and BPE merges
learnt on both languages at once. Metaspace splits only at spaces, so unspaced Chinese stays
one long "word" that the merges cut into subwords: no word segmenter is needed. Decoding turns
"▁" back into spaces, so ``decode(encode(text))`` gives the text back exactly, spaces and
Chinese full-width punctuation included: the detokenized output is what sacreBLEU compares
with the references. (NFKC, used by earlier versions, folded ，！？ into ,!? and … into ...,
which no reference does, so every such token of a Chinese output counted as a miss. A
tokenizer saved with NFKC keeps it, as its vocabulary was learnt on it.)
The round trip holds for text whose characters the vocabulary has seen (others become
``<unk>``, which decoding drops: there is no byte fallback), without leading whitespace (a
first "▁" is dropped) and without tabs or a literal "▁" (both read as spaces).

Special tokens take the first ids: ``<pad>`` = 0, ``<sos>`` = 1, ``<eos>`` = 2, ``<unk>`` = 3.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, trainers

from attnlab.errors import AttnlabError
from attnlab.io import check_input_file, write_text_atomic
from attnlab.text.tokenizer import MAX_TRAINED_VOCAB, _corpus_batches

PAD, SOS, EOS, UNK = "<pad>", "<sos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, SOS, EOS, UNK)  # the order fixes their ids 0..3
TOKENIZER_CLASS = "attnlab-bpe"  # tokenizer_config.json marker


class BpeTokenizer:
    """Joint BPE tokenizer of a translation model (HF `tokenizers` underneath)."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        """Wrap a BPE `backend`, installing the NFC (unless it has its own) + Metaspace pipeline."""
        if not isinstance(backend.model, models.BPE):
            raise AttnlabError(f"expected a BPE tokenizer, got {type(backend.model).__name__}")
        ids = {token: backend.token_to_id(token) for token in SPECIAL_TOKENS}
        missing = [token for token, i in ids.items() if i is None]
        if missing:
            raise AttnlabError(f"BPE vocabulary lacks the special tokens {', '.join(missing)}")
        # Special added tokens: "<eos>" typed in a sentence stays one token, and decode drops them.
        backend.add_special_tokens(
            [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS]
        )
        if backend.normalizer is None:  # a saved tokenizer keeps the one its merges were learnt on
            backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = _pre_tokenizer()
        backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
        backend.post_processor = None  # <sos>/<eos> are placed by the data code, not here
        backend.no_padding()
        backend.no_truncation()
        self._backend = backend
        self.pad_id, self.sos_id, self.eos_id, self.unk_id = (ids[t] for t in SPECIAL_TOKENS)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, path: str | Path) -> BpeTokenizer:
        """Load the tokenizer.json of a translation model (or tokenizer) directory."""
        root = Path(path)
        file = root / "tokenizer.json"
        if not file.is_file():
            raise AttnlabError(f"no tokenizer.json in {root}: is this a BPE tokenizer directory?")
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as error:  # tokenizers raises plain Exception on bad JSON
            raise AttnlabError(f"cannot read {file}: {error}") from error
        if not isinstance(backend.model, models.BPE):
            raise AttnlabError(
                f"{file} holds a {type(backend.model).__name__} vocabulary, not BPE: "
                "is this a BERT checkpoint?"
            )
        return cls(backend)

    def save(self, out_dir: str | Path) -> None:
        """Write tokenizer.json (loadable by `tokenizers`) and tokenizer_config.json."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        config = {
            "tokenizer_class": TOKENIZER_CLASS,
            "pad_token": PAD,
            "bos_token": SOS,
            "eos_token": EOS,
            "unk_token": UNK,
        }
        write_text_atomic(out / "tokenizer.json", self._backend.to_str(pretty=True))
        write_text_atomic(out / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")

    def encode(self, text: str) -> list[int]:
        """Subword ids of text, without <sos>/<eos>."""
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """encode() of many texts, in parallel threads."""
        return [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=False)]

    def tokenize(self, text: str) -> list[str]:
        """Subword strings of text ("▁" marks a preceding space)."""
        return self._backend.encode(text, add_special_tokens=False).tokens

    def decode(self, ids: Iterable[int]) -> str:
        """Detokenized text of ids; special tokens are dropped."""
        return self._backend.decode(self._checked(ids), skip_special_tokens=True)

    def decode_batch(self, batch: Iterable[Iterable[int]]) -> list[str]:
        """decode() of many id lists."""
        lists = [self._checked(ids) for ids in batch]
        return self._backend.decode_batch(lists, skip_special_tokens=True)

    def normalize(self, text: str) -> str:
        """The text as the tokenizer sees it (NFC): what a round trip gives back."""
        return self._backend.normalizer.normalize_str(text)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The `tokenizers.Tokenizer` (do not reconfigure it)."""
        return self._backend

    def _checked(self, ids: Iterable[int]) -> list[int]:
        # tokenizers silently drops out-of-range ids; a model/vocabulary mismatch must be loud.
        ids = list(ids)
        for token_id in ids:
            if not 0 <= token_id < self.vocab_size:
                raise AttnlabError(
                    f"token id {token_id} is outside the vocabulary (size {self.vocab_size})"
                )
        return ids

    def __repr__(self) -> str:
        return f"BpeTokenizer(vocab_size={self.vocab_size})"


def train_bpe(files: list[str | Path], vocab_size: int, min_frequency: int = 2) -> BpeTokenizer:
    """Learn a joint BPE vocabulary of at most vocab_size tokens on text files (.gz allowed).

    Lines may be plain sentences or ``src<TAB>tgt`` pairs (the TAB is treated as a space).
    """
    paths = [Path(f) for f in files]
    if not paths:
        raise AttnlabError("train_bpe needs at least one text file")
    for path in paths:
        check_input_file(path, "corpus file")
    seen_text = False

    def batches() -> Iterator[list[str]]:
        nonlocal seen_text
        for batch in _corpus_batches(paths):
            # A TSV's TAB would otherwise glue the last source word to the first target word;
            # each side is stripped, line ending included, as translation reads its pairs (a
            # "\n" left in would be learnt onto each line's last word, in tokens never used).
            lines = [" ".join(side.strip() for side in line.split("\t")) for line in batch]
            seen_text = seen_text or any(line.strip() for line in lines)
            yield lines

    tokenizer = _train(batches(), vocab_size, min_frequency)
    if not seen_text or tokenizer.vocab_size <= len(SPECIAL_TOKENS):
        names = ", ".join(str(path) for path in paths)
        raise AttnlabError(f"corpus {names} holds no text to learn a vocabulary from")
    return tokenizer


def train_bpe_from_texts(
    texts: Iterable[str], vocab_size: int, min_frequency: int = 2
) -> BpeTokenizer:
    """train_bpe on in-memory sentences (both sides of a parallel corpus)."""
    texts = [text for text in texts if text]
    if not texts:
        raise AttnlabError("no text to learn a BPE vocabulary from")
    return _train([texts], vocab_size, min_frequency)


def _train(batches: Iterable[list[str]], vocab_size: int, min_frequency: int) -> BpeTokenizer:
    """BPE merges learnt on batches of lines; every character seen stays in the alphabet."""
    if vocab_size < len(SPECIAL_TOKENS) + 2:
        raise AttnlabError(
            f"vocab_size must be at least {len(SPECIAL_TOKENS) + 2}, got {vocab_size}"
        )
    if vocab_size > MAX_TRAINED_VOCAB:  # tokenizers allocates for it (and aborts when it cannot)
        raise AttnlabError(
            f"vocab_size must be at most {MAX_TRAINED_VOCAB:,}, got {vocab_size}",
            options=("vocab_size",),
        )
    backend = tokenizers.Tokenizer(models.BPE(unk_token=UNK))
    # The same normalizer and pre-tokenizer as BpeTokenizer installs: merges are learnt on
    # exactly the pieces they will later be applied to.
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = _pre_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
    )
    backend.train_from_iterator(batches, trainer=trainer)
    return BpeTokenizer(backend)


def _pre_tokenizer() -> pre_tokenizers.Metaspace:
    # prepend_scheme="always": a sentence's first word gets "▁" like every other word, so a
    # word has one spelling wherever it stands.
    return pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
