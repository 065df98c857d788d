"""BERT's WordPiece tokenizer (Devlin et al. 2019, §3 "Input/Output Representations").

Every step runs in HF `tokenizers`: `BertNormalizer` (clean text, spaces around CJK
characters, lowercase, strip accents), `BertPreTokenizer` (split on whitespace and
punctuation), greedy longest-match-first `WordPiece` with the `##` continuation prefix,
and a template that builds `[CLS] A [SEP]` or `[CLS] A [SEP] B [SEP]` with segment
(token type) ids 0 for A and 1 for B. Ids match `transformers.BertTokenizerFast`
token for token, truncation included (its `longest_first` strategy), which the tests check.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import tokenizers
from tokenizers import (
    AddedToken,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from attnlab.errors import AttnlabError
from attnlab.io import (
    check_input_file,
    check_no_lone_surrogates,
    text_lines,
    text_pieces,
    write_text_atomic,
)

PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
# The order also fixes the ids of a newly trained vocabulary: [PAD]=0 ... [MASK]=4.
SPECIAL_TOKENS = (PAD, UNK, CLS, SEP, MASK)
# tokenizer_config.json's names for them, as transformers reads them
SPECIAL_TOKEN_KEYS = {
    "pad_token": PAD,
    "unk_token": UNK,
    "cls_token": CLS,
    "sep_token": SEP,
    "mask_token": MASK,
}
# tokenizer_class values that mean BERT's WordPiece tokenizer (absent: the model type's)
BERT_TOKENIZER_CLASSES = (None, "BertTokenizer", "BertTokenizerFast")
_ADDED_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")

# Google's BERT gives up on longer words and emits [UNK]; HF does the same.
MAX_INPUT_CHARS_PER_WORD = 100
# transformers stores int(1e30) as model_max_length when a checkpoint sets no limit.
_NO_LIMIT = 10**12
# Each distinct max_length gets its own truncating copy of the backend; a few suffice.
_MAX_TRUNCATING_BACKENDS = 8


@dataclass
class Encoding:
    """Model input for one text or text pair."""

    ids: list[int]
    type_ids: list[int]
    truncated: bool  # True when truncation removed tokens


class BertTokenizer:
    """BERT WordPiece tokenizer (HF `tokenizers` underneath)."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        lowercase: bool,
        strip_accents: bool | None,
        tokenize_chinese_chars: bool,
        max_length: int = 512,
    ) -> None:
        """Wrap a WordPiece `backend`, installing BERT's normalizer, template and decoder on it.

        The tokenizer takes ownership of `backend` and reconfigures it in place: the flags
        given here decide normalisation (as `tokenizer_config.json` does in transformers),
        and any padding or truncation stored in it is cleared.
        """
        _check_wordpiece(backend)
        _check_max_length(max_length, "max_length")

        self._lowercase = lowercase
        self._strip_accents = strip_accents
        self._tokenize_chinese_chars = tokenize_chinese_chars
        self.max_length = max_length
        # tokenizer_config.json's clean_up_tokenization_spaces (transformers 5's default False):
        # when true, transformers' decode joins " ," " 's" " n't" and the like (from_dir sets it).
        self._clean_up_spaces = False

        ids = _install_bert_pipeline(backend, lowercase, strip_accents, tokenize_chinese_chars)
        self._backend = backend

        self._pad_id, self._unk_id = ids[PAD], ids[UNK]
        self._cls_id, self._sep_id, self._mask_id = ids[CLS], ids[SEP], ids[MASK]
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)
        # Truncation is a setting of a `tokenizers.Tokenizer`, not an argument of encode:
        # rather than flip it on the shared backend (a race between threads), each
        # max_length gets a truncating copy that is never changed after it is built.
        self._truncating: dict[int, tokenizers.Tokenizer] = {}
        self._truncating_lock = threading.Lock()

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_vocab(
        cls,
        vocab: str | Path | dict[str, int],
        lowercase: bool = True,
        strip_accents: bool | None = None,
        tokenize_chinese_chars: bool = True,
        max_length: int = 512,
    ) -> BertTokenizer:
        """Build a tokenizer from a vocab.txt path or a token -> id mapping."""
        if not isinstance(vocab, dict):
            vocab = _read_vocab_txt(Path(vocab))
        model = models.WordPiece(
            dict(vocab), unk_token=UNK, max_input_chars_per_word=MAX_INPUT_CHARS_PER_WORD
        )
        return cls(
            tokenizers.Tokenizer(model),
            lowercase,
            strip_accents,
            tokenize_chinese_chars,
            max_length,
        )

    @classmethod
    def from_dir(cls, path: str | Path, max_length: int | None = None) -> BertTokenizer:
        """Load the tokenizer of a BERT checkpoint directory (HF layout)."""
        root = Path(path)
        if not root.is_dir():
            raise AttnlabError(f"{root} is not a directory: expected a BERT checkpoint directory")
        config_path = root / "tokenizer_config.json"
        config = _read_json(config_path) if config_path.is_file() else {}
        if not isinstance(config, dict):
            raise AttnlabError(f"{config_path} does not hold a JSON object")
        _check_tokenizer_class(root, config)
        _check_special_tokens(root, config)

        backend, added = _load_wordpiece(root, config)

        # Defaults of transformers' BertTokenizer; tokenizer_config.json overrides them and
        # wins over the normalizer stored in tokenizer.json, exactly as in transformers.
        # null is "as the language says" for strip_accents only; the tokenizers library (and
        # so transformers) fails on a null do_lower_case or tokenize_chinese_chars.
        lowercase = _config_value(config, "do_lower_case", True, config_path, nullable=False)
        strip_accents = _config_value(config, "strip_accents", None, config_path)
        chinese = _config_value(config, "tokenize_chinese_chars", True, config_path, nullable=False)
        if max_length is None:
            max_length = _stored_max_length(config)
        tokenizer = cls(backend, lowercase, strip_accents, chinese, max_length)
        tokenizer._clean_up_spaces = bool(
            _config_value(config, "clean_up_tokenization_spaces", False, config_path)
        )
        tokenizer._add_recorded_tokens(added, root)
        return tokenizer

    # ---- encoding -----------------------------------------------------------------------

    def encode(self, text: str, pair: str | None = None, max_length: int | None = None) -> Encoding:
        """Encode `text` (and `pair`) as [CLS] A [SEP] (B [SEP]), truncated to max_length.

        An empty `pair` still gives its [SEP], as HF's tokenizer does for a batch of pairs (the
        way its training scripts call it; one call with an empty pair drops it).
        """
        max_length = self.max_length if max_length is None else max_length
        backend = self._truncating_backend(max_length, pair is not None)
        return _to_encoding(backend.encode(text, pair), max_length)

    def encode_batch(
        self, texts: list[str], pairs: list[str] | None = None, max_length: int | None = None
    ) -> list[Encoding]:
        """Encode many texts (or text pairs) in parallel; same result as encode on each."""
        if pairs is None:
            inputs: list = list(texts)
        else:
            if len(pairs) != len(texts):
                raise AttnlabError(f"got {len(texts)} texts but {len(pairs)} pairs")
            inputs = list(zip(texts, pairs, strict=True))
        max_length = self.max_length if max_length is None else max_length
        backend = self._truncating_backend(max_length, pairs is not None)
        return [_to_encoding(encoding, max_length) for encoding in backend.encode_batch(inputs)]

    def tokenize(self, text: str) -> list[str]:
        """Split `text` into WordPiece tokens, without special tokens or truncation."""
        return self._backend.encode(text, add_special_tokens=False).tokens

    def convert_tokens_to_ids(self, tokens: list[str]) -> list[int]:
        """Map tokens to ids; unknown tokens map to the [UNK] id."""
        ids = []
        for token in tokens:
            token_id = self._backend.token_to_id(token)
            ids.append(self._unk_id if token_id is None else token_id)
        return ids

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        """Map ids to tokens."""
        self._check_ids(ids)
        return [self._backend.id_to_token(token_id) for token_id in ids]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Turn ids back into text, joining ## continuations (lowercasing is not undone)."""
        self._check_ids(ids)
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up_spaces else text

    # ---- saving -------------------------------------------------------------------------

    def save(self, out_dir: str | Path) -> None:
        """Write vocab.txt, tokenizer.json and tokenizer_config.json loadable by transformers."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        vocab = self._backend.get_vocab(with_added_tokens=False)
        tokens = sorted(vocab, key=vocab.__getitem__)
        if [vocab[token] for token in tokens] != list(range(len(tokens))):
            raise AttnlabError("cannot write vocab.txt: the vocabulary ids are not 0..N-1")
        bad = [token for token in tokens if "\n" in token or "\r" in token]
        if bad:
            raise AttnlabError(f"cannot write vocab.txt: token {bad[0]!r} holds a line break")
        config = {
            "tokenizer_class": "BertTokenizer",
            "do_lower_case": self._lowercase,
            "strip_accents": self._strip_accents,
            "tokenize_chinese_chars": self._tokenize_chinese_chars,
            "model_max_length": self.max_length,
            "clean_up_tokenization_spaces": self._clean_up_spaces,
            "pad_token": PAD,
            "unk_token": UNK,
            "cls_token": CLS,
            "sep_token": SEP,
            "mask_token": MASK,
            # Added tokens beside vocab.txt, as transformers records them: a reader of
            # vocab.txt alone (transformers' pure-Python tokenizer) would not know them.
            "added_tokens_decoder": {
                str(token_id): {"content": token.content}
                | {f: getattr(token, f) for f in _ADDED_TOKEN_FLAGS}
                for token_id, token in sorted(self._backend.get_added_tokens_decoder().items())
            },
        }
        write_text_atomic(out / "vocab.txt", "".join(token + "\n" for token in tokens))
        write_text_atomic(out / "tokenizer.json", self._backend.to_str(pretty=True))
        write_text_atomic(out / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")

    # ---- vocabulary -----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the embedding table's row count)."""
        return self._vocab_size

    @property
    def vocab(self) -> dict[str, int]:
        """Token -> id mapping (a copy)."""
        return self._backend.get_vocab(with_added_tokens=True)

    @property
    def pad_id(self) -> int:
        """Id of [PAD]."""
        return self._pad_id

    @property
    def cls_id(self) -> int:
        """Id of [CLS]."""
        return self._cls_id

    @property
    def sep_id(self) -> int:
        """Id of [SEP]."""
        return self._sep_id

    @property
    def mask_id(self) -> int:
        """Id of [MASK]."""
        return self._mask_id

    @property
    def unk_id(self) -> int:
        """Id of [UNK]."""
        return self._unk_id

    @property
    def special_ids(self) -> set[int]:
        """Ids of [PAD], [UNK], [CLS], [SEP], [MASK] and of every added token marked special."""
        added = self._backend.get_added_tokens_decoder()
        return {token_id for token_id, token in added.items() if token.special} | {
            self._pad_id,
            self._unk_id,
            self._cls_id,
            self._sep_id,
            self._mask_id,
        }

    @property
    def lowercase(self) -> bool:
        """Whether text is lowercased before WordPiece."""
        return self._lowercase

    @property
    def strip_accents(self) -> bool | None:
        """Whether accents are stripped; None follows `lowercase`, as in BERT."""
        return self._strip_accents

    @property
    def tokenize_chinese_chars(self) -> bool:
        """Whether each CJK ideograph becomes a word of its own."""
        return self._tokenize_chinese_chars

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The untruncated `tokenizers.Tokenizer` (for offsets, word ids); do not reconfigure it."""
        return self._backend

    def __getstate__(self) -> dict:
        # Pickled for DataLoader workers under spawn: a lock cannot be pickled, and the
        # truncating copies are rebuilt on first use rather than shipped.
        state = self.__dict__.copy()
        state["_truncating"] = {}
        del state["_truncating_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._truncating_lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"BertTokenizer(vocab_size={self._vocab_size}, lowercase={self._lowercase}, "
            f"strip_accents={self._strip_accents}, "
            f"tokenize_chinese_chars={self._tokenize_chinese_chars}, max_length={self.max_length})"
        )

    # ---- internals ----------------------------------------------------------------------

    def _add_recorded_tokens(self, added: list[tuple[int, AddedToken]], root: Path) -> None:
        """Add the tokens a vocab.txt checkpoint records beside it, refusing ids that differ.

        transformers gives them the ids after the vocabulary in the order of their recorded
        ids, whatever those are: a recorded id that differs would pair a token with another
        token's embedding row.
        """
        for token_id, token in sorted(added, key=lambda item: item[0]):
            add = self._backend.add_special_tokens if token.special else self._backend.add_tokens
            add([token])
            given = self._backend.token_to_id(token.content)
            if given != token_id:
                raise AttnlabError(
                    f"{root}: added token {token.content!r} is recorded with id {token_id} but "
                    f"takes id {given} (added tokens follow the vocabulary, in order): the "
                    "model's embedding rows would not match its tokens"
                )
        self._vocab_size = self._backend.get_vocab_size(with_added_tokens=True)

    def _truncating_backend(self, max_length: int, is_pair: bool) -> tokenizers.Tokenizer:
        """A copy of the backend that truncates to max_length."""
        # Below the count of special tokens, tokenizers silently skips truncation.
        _check_max_length(max_length, "max_length", minimum=3 if is_pair else 2)
        backend = self._truncating.get(max_length)
        if backend is not None:
            return backend
        with self._truncating_lock:
            backend = self._truncating.get(max_length)
            if backend is None:
                backend = tokenizers.Tokenizer.from_str(self._backend.to_str())
                backend.enable_truncation(max_length, stride=0, strategy="longest_first")
                if len(self._truncating) >= _MAX_TRUNCATING_BACKENDS:
                    self._truncating.pop(next(iter(self._truncating)))
                self._truncating[max_length] = backend
        return backend

    def _check_ids(self, ids: Sequence[int]) -> None:
        """Raise for ids outside the vocabulary (tokenizers would drop them silently)."""
        for token_id in ids:
            if not 0 <= token_id < self._vocab_size:
                raise AttnlabError(
                    f"token id {token_id} is outside the vocabulary (size {self._vocab_size})"
                )


def _to_encoding(encoding: tokenizers.Encoding, max_length: int) -> Encoding:
    """Our Encoding from a truncating backend's; overflow is what truncation cut off."""
    ids = encoding.ids
    # Truncation always fills max_length exactly, so shorter results need no look at
    # `overflowing`, which Python receives as a copy of every overflow window.
    truncated = len(ids) == max_length and len(encoding.overflowing) > 0
    return Encoding(ids, encoding.type_ids, truncated)


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization: no space before punctuation and English clitics."""
    for spaced, joined in (
        (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
        (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
    ):  # fmt: skip
        text = text.replace(spaced, joined)
    return text


def _check_max_length(value: object, name: str, minimum: int = 2) -> None:
    """Raise unless `value` is an int >= minimum (room for [CLS] and [SEP])."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise AttnlabError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_wordpiece(backend: tokenizers.Tokenizer) -> None:
    """Raise AttnlabError unless backend is a WordPiece model with BERT's special tokens."""
    if not isinstance(backend.model, models.WordPiece):
        raise AttnlabError(
            f"BertTokenizer needs a WordPiece model, got {type(backend.model).__name__}"
        )
    missing = [token for token in SPECIAL_TOKENS if backend.token_to_id(token) is None]
    if missing:
        raise AttnlabError(f"vocabulary lacks BERT's special tokens {', '.join(missing)}")
    if backend.model.unk_token != UNK:
        raise AttnlabError(f"WordPiece unk_token is {backend.model.unk_token!r}, expected {UNK}")


def _install_bert_pipeline(
    backend: tokenizers.Tokenizer,
    lowercase: bool,
    strip_accents: bool | None,
    tokenize_chinese_chars: bool,
) -> dict[str, int]:
    """Set BERT's normalizer, pre-tokenizer, template and decoder on backend; the special ids."""
    # Registered as special added tokens so that "[MASK]" typed in text stays one token
    # and decode(skip_special_tokens=True) drops them, as in transformers.
    backend.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS]
    )
    ids = {token: backend.token_to_id(token) for token in SPECIAL_TOKENS}
    backend.normalizer = normalizers.BertNormalizer(
        clean_text=True,
        handle_chinese_chars=tokenize_chinese_chars,
        strip_accents=strip_accents,
        lowercase=lowercase,
    )
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{CLS}:0 $A:0 {SEP}:0",
        pair=f"{CLS}:0 $A:0 {SEP}:0 $B:1 {SEP}:1",
        special_tokens=[(CLS, ids[CLS]), (SEP, ids[SEP])],
    )
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    backend.no_padding()
    backend.no_truncation()
    return ids


def _read_vocab_txt(path: Path) -> dict[str, int]:
    """Read vocab.txt (one token a line, id = line number - 1) with tokenizers' reader."""
    if not path.is_file():
        raise AttnlabError(f"vocab file {path} not found")
    try:
        vocab = models.WordPiece.read_file(str(path))
    except Exception as error:  # tokenizers raises plain Exception on bad files
        raise AttnlabError(f"cannot read vocab file {path}: {error}") from error
    if vocab and len(vocab) != max(vocab.values()) + 1:  # a repeated line keeps its last id
        lines = path.read_text(encoding="utf-8").splitlines()
        repeated = next(
            (t for t, n in Counter(line.rstrip() for line in lines).items() if n > 1), ""
        )
        raise AttnlabError(
            f"vocab file {path} lists the token {repeated!r} more than once: token ids would "
            "not be line numbers, and would not match the model's embedding rows"
        )
    return vocab


def _read_json(path: Path) -> object:
    """Parse a JSON file, naming it in any error."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:  # ValueError: bad text or JSON
        raise AttnlabError(f"cannot read {path}: {error}") from error
    check_no_lone_surrogates(data, str(path))  # an added token's content is tokenized
    return data


def _check_tokenizer_class(root: Path, config: dict) -> None:
    """Refuse a checkpoint whose tokenizer_class is not BERT's (say BertJapaneseTokenizer)."""
    where = root / "tokenizer_config.json"
    name = config.get("tokenizer_class")
    if name is None and (root / "config.json").is_file():  # where AutoTokenizer looks next
        where = root / "config.json"
        try:
            data = json.loads(where.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):  # the model's loader reports it
            data = None
        name = data.get("tokenizer_class") if isinstance(data, dict) else None
    if name not in BERT_TOKENIZER_CLASSES:
        raise AttnlabError(
            f"{where} names tokenizer_class {name!r}: attnlab tokenizes as BERT's "
            "BertTokenizer only, and would split text otherwise than that tokenizer"
        )


def _check_special_tokens(root: Path, config: dict) -> None:
    """Refuse special tokens named otherwise than BERT's [CLS], [SEP], [PAD], [UNK], [MASK]."""
    sources = [(root / "tokenizer_config.json", config)]
    special_map = root / "special_tokens_map.json"
    # transformers reads special_tokens_map.json only when added_tokens_decoder is absent
    if special_map.is_file() and "added_tokens_decoder" not in config:
        sources.append((special_map, _read_json(special_map)))
    for path, data in sources:
        if not isinstance(data, dict):
            raise AttnlabError(f"{path} does not hold a JSON object")
        named = {key: data.get(key, default) for key, default in SPECIAL_TOKEN_KEYS.items()}
        named = {k: v.get("content") if isinstance(v, dict) else v for k, v in named.items()}
        other = [f"{k} {v!r}" for k, v in named.items() if v != SPECIAL_TOKEN_KEYS[k]]
        if other:
            raise AttnlabError(
                f"{path} names {', '.join(other)}: attnlab's BERT tokenizer uses "
                f"{', '.join(SPECIAL_TOKENS)} only"
            )


def _recorded_added_tokens(root: Path, config: dict) -> list[tuple[int, AddedToken]]:
    """(id, token) pairs recorded beside a vocab.txt: added_tokens_decoder, or added_tokens.json."""
    path = root / "tokenizer_config.json"
    if "added_tokens_decoder" in config:
        recorded = config["added_tokens_decoder"]
        if not isinstance(recorded, dict):
            raise AttnlabError(f"{path}: added_tokens_decoder must map ids to added tokens")
        return [(_token_id(i, path), _added_token(entry, path)) for i, entry in recorded.items()]
    path = root / "added_tokens.json"
    if not path.is_file():
        return []
    recorded = _read_json(path)
    if not isinstance(recorded, dict):
        raise AttnlabError(f"{path} must map added tokens to their ids")
    # transformers' reading of this legacy file: BERT's own specials stay special and raw
    return [
        (
            _token_id(i, path),
            _added_token({"content": token, "special": token in SPECIAL_TOKENS}, path),
        )
        for token, i in recorded.items()
    ]


def _load_wordpiece(
    root: Path, config: dict
) -> tuple[tokenizers.Tokenizer, list[tuple[int, AddedToken]]]:
    """The WordPiece backend of a checkpoint directory, and the added tokens it still lacks.

    From tokenizer.json where there is one, else from vocab.txt; each added token comes with
    the id tokenizer_config.json records for it.
    """
    tokenizer_json, vocab_txt = root / "tokenizer.json", root / "vocab.txt"
    if tokenizer_json.is_file():
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_json))
        except Exception as error:  # tokenizers raises plain Exception on bad JSON
            raise AttnlabError(f"cannot read {tokenizer_json}: {error}") from error
        if not isinstance(backend.model, models.WordPiece):
            raise AttnlabError(
                f"{tokenizer_json} holds a {type(backend.model).__name__} model, "
                "not WordPiece: is this a BERT checkpoint?"
            )
        # tokenizer.json holds its own added tokens; transformers also adds those of
        # added_tokens_decoder that it lacks, with their recorded ids.
        added = []
        if "added_tokens_decoder" in config:
            added = [
                (token_id, token)
                for token_id, token in _recorded_added_tokens(root, config)
                if backend.token_to_id(token.content) is None
            ]
    elif vocab_txt.is_file():
        backend = tokenizers.Tokenizer(
            models.WordPiece(
                _read_vocab_txt(vocab_txt),
                unk_token=UNK,
                max_input_chars_per_word=MAX_INPUT_CHARS_PER_WORD,
            )
        )
        added = _recorded_added_tokens(root, config)
    else:
        raise AttnlabError(f"no vocab.txt or tokenizer.json in {root}: is this a BERT checkpoint?")
    return backend, added


def _stored_max_length(config: dict) -> int:
    """The model_max_length of tokenizer_config.json, or BERT's 512 where it sets no limit."""
    # max_len is the key that old transformers versions saved; transformers still reads it.
    stored = config.get("model_max_length", config.get("max_len"))
    ok = isinstance(stored, int) and not isinstance(stored, bool) and 0 < stored < _NO_LIMIT
    return stored if ok else 512


def _added_token(entry: object, path: Path) -> AddedToken:
    """An AddedToken from its JSON form; like transformers, other keys (__type) are ignored."""
    if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
        raise AttnlabError(f"{path}: {entry!r} is not an added token")
    flags = {k: entry[k] for k in _ADDED_TOKEN_FLAGS if k in entry}
    if not all(isinstance(v, bool) for v in flags.values()):
        raise AttnlabError(
            f"{path}: the flags of added token {entry['content']!r} must be booleans"
        )
    # normalized defaults to not special, in tokenizers as in transformers
    return AddedToken(entry["content"], **flags)


def _token_id(value: object, path: Path) -> int:
    """A token id, written as an integer or (a JSON object's key) a string of digits."""
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise AttnlabError(f"{path}: {value!r} is not a token id")
    return value


def _config_value(
    config: dict, key: str, default: bool | None, path: Path, nullable: bool = True
) -> bool | None:
    """A boolean (or, if nullable, null) setting of tokenizer_config.json, or its default."""
    value = config.get(key, default)
    if not isinstance(value, bool) and not (nullable and value is None):
        allowed = "true, false or null" if nullable else "true or false"
        raise AttnlabError(f"{path}: {key} must be {allowed}, got {json.dumps(value)}")
    return value


# ---- training ---------------------------------------------------------------------------


MAX_TRAINED_VOCAB = 10_000_000  # far above any real vocabulary (BERT's 30k, XLM-R's 250k)


def train_wordpiece(
    files: list[str | Path],
    vocab_size: int,
    lowercase: bool = True,
    strip_accents: bool | None = None,
    min_frequency: int = 2,
    limit_alphabet: int = 6000,
) -> BertTokenizer:
    """Train a new WordPiece vocabulary on UTF-8 text files (.gz allowed), one text a line.

    Specials take ids [PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3, [MASK]=4. CJK ideographs are
    split one per token, so each one in the alphabet (the `limit_alphabet` most frequent
    characters, ties broken by code point) becomes a token of its own. The same corpus and
    settings give the same vocabulary in every process (see `_continuations`).
    """
    paths = _wordpiece_inputs(files, vocab_size)
    backend = tokenizers.Tokenizer(
        models.WordPiece(unk_token=UNK, max_input_chars_per_word=MAX_INPUT_CHARS_PER_WORD)
    )
    normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=strip_accents, lowercase=lowercase
    )
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.normalizer, backend.pre_tokenizer = normalizer, pre_tokenizer
    # The trainer puts each alphabet character in the vocabulary before any merge and never
    # drops it, and also ##c where c can stand inside a word, so the alphabet is cut to fit.
    alphabet = _alphabet(
        paths, normalizer, pre_tokenizer, limit_alphabet, vocab_size - len(SPECIAL_TOKENS)
    )
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[*SPECIAL_TOKENS, *_continuations(alphabet, normalizer, pre_tokenizer)],
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        continuing_subword_prefix="##",
        show_progress=False,
    )
    # The corpus is read on another thread while the trainer holds backend: the line filter
    # uses the normalizer and pre-tokenizer themselves (backend.normalizer would wait forever).
    batches = _trainable(_corpus_pieces(paths), normalizer, pre_tokenizer)
    backend.train_from_iterator(batches, trainer=trainer)

    vocab = backend.get_vocab(with_added_tokens=True)
    if len(vocab) <= len(SPECIAL_TOKENS):
        names = ", ".join(str(path) for path in paths)
        raise AttnlabError(f"corpus {names} holds no text to learn a vocabulary from")
    # The trainer lists its alphabet in hash-map order, which differs from run to run; WordPiece
    # ignores ids when it matches, so sorting the rest makes the same corpus give the same ids.
    rest = sorted(token for token in vocab if token not in SPECIAL_TOKENS)
    ordered = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *rest])}
    return BertTokenizer.from_vocab(ordered, lowercase=lowercase, strip_accents=strip_accents)


def _wordpiece_inputs(files: list[str | Path] | str | Path, vocab_size: int) -> list[Path]:
    """train_wordpiece's corpus files, each checked readable, once vocab_size is in range."""
    paths = [Path(files)] if isinstance(files, (str, Path)) else [Path(f) for f in files]
    if not paths:
        raise AttnlabError("train_wordpiece needs at least one corpus file")
    for path in paths:
        check_input_file(path, "corpus file")
    _check_max_length(vocab_size, "vocab_size", minimum=len(SPECIAL_TOKENS) + 2)
    if vocab_size > MAX_TRAINED_VOCAB:  # tokenizers allocates for it (and aborts when it cannot)
        raise AttnlabError(
            f"vocab_size must be at most {MAX_TRAINED_VOCAB:,}, got {vocab_size}",
            options=("vocab_size",),
        )
    return paths


_PIECE_BYTES = 1 << 16  # a corpus line is read this many bytes at a time at most
_BATCH_CHARS = 1 << 18  # and handed to the trainer in batches of about this many characters
# A run of non-space characters long enough to hold a word past MAX_INPUT_CHARS_PER_WORD.
_LONG_RUN = re.compile(rf"\S{{{MAX_INPUT_CHARS_PER_WORD + 1},}}")


def _trainable(
    batches: Iterable[list[tuple[str, bool]]],
    normalizer: normalizers.Normalizer,
    pre_tokenizer: pre_tokenizers.PreTokenizer,
) -> Iterator[list[str]]:
    """The corpus as the trainer reads it: without the words WordPiece encodes as [UNK] for
    their length, and a line read in pieces handed on in pieces, each word whole.

    None of such a word's pieces would ever be used for it, and the trainer's merges cost the
    square of a word's length, so one long line without spaces could stall training. The
    trainer also normalises each string it is given with offsets for every byte, many times
    the string's size in memory. A word that a piece's end cuts waits, normalised, for the
    next piece.
    """
    held = ""  # the normalised start of a word cut by a piece's end
    dropping = False  # that word is already too long to keep: its rest goes too
    for batch in batches:
        kept = []
        for text, ends_line in batch:
            if ends_line and not held and not dropping:  # a whole line (or the rest of one)
                if _LONG_RUN.search(text):  # the exact split (Chinese runs are split) only here
                    words = pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text))
                    text = " ".join(w for w, _ in words if len(w) <= MAX_INPUT_CHARS_PER_WORD)
                kept.append(text)
                continue
            joined = held + normalizer.normalize_str(text)
            spans = pre_tokenizer.pre_tokenize_str(joined)
            # (word, whether it goes on a word already dropped)
            words = [(word, dropping and start == 0) for word, (start, _) in spans]
            held, dropping = "", False
            if not ends_line and spans and spans[-1][1][1] == len(joined):  # it may go on
                word, dropped = words.pop()
                if dropped or len(word) > MAX_INPUT_CHARS_PER_WORD:
                    dropping = True
                else:
                    held = word
            kept.append(
                " ".join(
                    word
                    for word, dropped in words
                    if not dropped and len(word) <= MAX_INPUT_CHARS_PER_WORD
                )
            )
        yield kept


def _alphabet(
    paths: list[Path],
    normalizer: normalizers.Normalizer,
    pre_tokenizer: pre_tokenizers.PreTokenizer,
    limit: int,
    budget: int,
) -> list[str]:
    """The most frequent characters of the normalised corpus, ties broken by code point: at
    most `limit` of them, and no more than `budget` vocabulary entries fit.

    The trainer's own cut keeps the most frequent characters too, but breaks ties in hash-map
    order, so the same corpus gave different vocabularies from run to run; an initial alphabet
    of exactly the characters wanted leaves it nothing to choose. BERT's normaliser works one
    character at a time, so each distinct character is normalised once, not the whole corpus.
    A character costs two entries (c and ##c) where it can stand inside a word, one where the
    normaliser or pre-tokenizer always makes it a word of its own (a CJK ideograph, a
    punctuation mark): halving the budget for every character left a Chinese vocabulary at
    about half of --vocab-size, the other characters of the corpus [UNK].
    """
    raw: Counter[str] = Counter()
    for batch in _corpus_pieces(paths):
        raw.update("".join(text for text, _ in batch))
    counts: Counter[str] = Counter()
    for char, count in raw.items():
        for piece in normalizer.normalize_str(char):
            if not piece.isspace():
                counts[piece] += count
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    alphabet: list[str] = []
    for char, _ in ranked[:limit]:
        budget -= 1 if _stands_alone(char, normalizer, pre_tokenizer) else 2
        if budget < 0:
            break
        alphabet.append(char)
    return alphabet


def _stands_alone(
    char: str, normalizer: normalizers.Normalizer, pre_tokenizer: pre_tokenizers.PreTokenizer
) -> bool:
    """Whether the normaliser or pre-tokenizer always makes char a word of its own."""
    # "a" + char + "a" splits into three words where char always stands alone.
    return len(pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(f"a{char}a"))) == 3


def _continuations(
    alphabet: list[str],
    normalizer: normalizers.Normalizer,
    pre_tokenizer: pre_tokenizers.PreTokenizer,
) -> list[str]:
    """##c for each alphabet character c that can stand inside a word, in alphabet order.

    Given to the trainer with the specials, so that it numbers them before it reads the
    corpus. Left to itself it numbers each ##c when it first meets c inside a word, in its
    hash map's order of words, which changes from process to process, and it breaks ties
    between merges of equal count by those numbers (huggingface/tokenizers#1794, #2066): the
    same corpus gave another vocabulary in each of 4 processes (the bundled corpus, 1,678 or
    1,679 tokens; zh-corpus reviews 6,425, 6,428, 6,430). A ##c the corpus never needs stays
    in the vocabulary, within the two entries `_alphabet` counts for c.
    """
    return [f"##{char}" for char in alphabet if not _stands_alone(char, normalizer, pre_tokenizer)]


def _corpus_pieces(paths: list[Path]) -> Iterator[list[tuple[str, bool]]]:
    """Yield the corpus text in batches of (piece, ends_line), a piece at most a whole line.

    A batch holds at most 1,000 pieces and _BATCH_CHARS characters (the first piece past
    them aside), a piece at most _PIECE_BYTES bytes (io.text_pieces).
    """
    pieces = (p for path in paths for p in text_pieces(path, "corpus file ", _PIECE_BYTES))
    return _in_batches(pieces, most_chars=_BATCH_CHARS, chars=lambda piece: len(piece[0]))


def _corpus_batches(paths: list[Path]) -> Iterator[list[str]]:
    """Yield the corpus lines in batches, raising AttnlabError at the first non-UTF-8 line."""
    return _in_batches(line for path in paths for line in text_lines(path, "corpus file "))


T = TypeVar("T")


def _in_batches(
    items: Iterable[T],
    most: int = 1000,
    most_chars: float = math.inf,
    chars: Callable[[T], int] = len,
) -> Iterator[list[T]]:
    """items in lists of at most `most`, each ended too once its items' chars reach most_chars."""
    batch: list[T] = []
    size = 0
    for item in items:
        batch.append(item)
        size += chars(item)
        if len(batch) == most or size >= most_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch
