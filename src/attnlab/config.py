"""Typed configuration for every model family, with the papers' defaults and named presets.

`BertConfig` follows Devlin et al. 2019 (and HF's `config.json` field names on export);
`TransformerConfig` follows Vaswani et al. 2017 (the encoder-decoder, Table 3 sizes);
`position_encoding` selects any scheme of `attnlab.nn.positions` for any model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from attnlab.errors import AttnlabError

POSITION_ENCODINGS = (
    "learned",
    "sinusoidal",
    "relative_bias",
    "shaw",
    "rope",
    "alibi",
    "normalized",
    "integer",
    "none",
)
ACTIVATIONS = ("gelu", "gelu_tanh", "relu")
NORM_POSITIONS = ("post", "pre")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AttnlabError(message)


def _expected(value: Any, hint: Any) -> str | None:
    """None when value (as JSON, TOML or YAML give it) fits the annotation hint, else what fits."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        misses = [_expected(value, arg) for arg in args]
        return None if None in misses else " or ".join(m for m in misses if m)
    if hint is type(None):
        return None if value is None else "null"
    if hint is bool:
        return None if isinstance(value, bool) else "true or false"
    if isinstance(value, bool):  # bool is an int subclass; True is not a size or a rate
        return {int: "an integer", float: "a number", str: "a string"}.get(hint, "a path")
    if hint is int:
        return None if isinstance(value, int) else "an integer"
    if hint is float:
        fits = isinstance(value, (int, float)) and math.isfinite(value)
        return None if fits else "a finite number"
    if hint is str:
        return None if isinstance(value, str) else "a string"
    if hint is Path:  # no system call takes a path holding NUL (TOML "\u0000", YAML "\0")
        fits = isinstance(value, (str, os.PathLike)) and str(value) and "\0" not in str(value)
        return None if fits else "a path"
    if origin is list:
        fits = isinstance(value, list) and all(_expected(v, args[0]) is None for v in value)
        return None if fits else "a list of paths" if args[0] is Path else f"a list of {args[0]}"
    if origin is tuple:
        fits = isinstance(value, (list, tuple)) and len(value) == len(args)
        fits = fits and all(_expected(v, a) is None for v, a in zip(value, args, strict=False))
        return None if fits else f"a list of {len(args)} numbers"
    return None  # Any, or a type this check does not know: the field's own validation decides


def check_types(cls: type, values: dict[str, Any], source: str | None) -> None:
    """Raise AttnlabError when a value does not fit its dataclass field's type.

    source names where the values come from (a file); None names each field as its flag.
    """
    hints = typing.get_type_hints(cls)
    for name, value in values.items():
        if name in hints:
            expected = _expected(value, hints[name])
            where = f"{source}: {name}" if source else f"--{name.replace('_', '-')}"
            _check(expected is None, f"{where} must be {expected}, got {value!r}")


def check_field_types(options: Any, source: str | None) -> None:
    """check_types on every field of a dataclass instance (options built from Python, say)."""
    fields = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    check_types(type(options), fields, source)


_C = TypeVar("_C", bound="_JsonConfig")


class _JsonConfig:
    """What both model configs share: validated copies, named presets, JSON round trips."""

    @classmethod
    def presets(cls) -> dict[str, dict[str, Any]]:
        """Named sizes: {name: field values}."""
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        """All fields as a JSON-ready dict."""
        return dataclasses.asdict(self)

    def replace(self: _C, **overrides: Any) -> _C:
        """A copy with some fields changed (validated)."""
        unknown = set(overrides) - {f.name for f in dataclasses.fields(self)}
        _check(not unknown, f"config: unknown field(s) {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **overrides)

    @classmethod
    def from_dict(cls: type[_C], data: dict[str, Any]) -> _C:
        """Build from a dict of field names (as to_dict writes them); unknown keys are an error."""
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        _check(not unknown, f"config: unknown field(s) {', '.join(sorted(unknown))}")
        return cls(**data)

    @classmethod
    def preset(cls: type[_C], name: str, **overrides: Any) -> _C:
        """A named size with optional field overrides (validated)."""
        table = cls.presets()
        if name not in table:
            raise AttnlabError(f"unknown preset {name!r} (choose from {', '.join(sorted(table))})")
        return cls.from_dict({**table[name], **overrides})

    def save(self, path: str | Path) -> None:
        """Write as attnlab JSON (atomic)."""
        from attnlab.io import write_text_atomic

        write_text_atomic(Path(path), json.dumps(self.to_dict(), indent=2, ensure_ascii=False))

    @classmethod
    def load(cls: type[_C], path: str | Path) -> _C:
        """Read a JSON file written by save."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as exc:
            raise AttnlabError(f"cannot read {cls.__name__} {path}: {exc}") from exc
        return cls.from_dict(data)


@dataclass
class BertConfig(_JsonConfig):
    """BERT encoder: sizes, dropout, activation, LayerNorm placement and positional scheme."""

    vocab_size: int = 30522
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    d_ff: int = 3072
    max_positions: int = 512
    type_vocab_size: int = 2
    dropout: float = 0.1
    attention_dropout: float = 0.1
    activation: str = "gelu"
    layer_norm_eps: float = 1e-12
    norm_position: str = "post"
    position_encoding: str = "learned"
    pad_token_id: int = 0
    initializer_range: float = 0.02
    relative_buckets: int = 32
    relative_max_distance: int = 128
    # shaw: clipping distance k. The paper finds no gain beyond k >= 2 (its ablation of k); 16 keeps
    # word-to-phrase distances apart while the tables stay small (2k + 1 vectors a layer).
    shaw_max_distance: int = 16
    shaw_values: bool = True  # shaw: a^V on the values too, as the paper's main model
    rope_base: float = 10000.0
    embedding_size: int | None = None  # ALBERT: factorised embeddings (E < d_model); None = d_model
    share_layers: bool = False  # ALBERT: one layer's weights used by all n_layers

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise AttnlabError when a field is out of range or fields contradict each other."""
        check_types(type(self), dataclasses.asdict(self), "config")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_positions"):
            value = getattr(self, name)
            _check(
                isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**31,
                f"config: {name} must be a positive integer below 2**31, got {value!r}",
            )
        _check(
            isinstance(self.type_vocab_size, int) and self.type_vocab_size >= 1,
            f"config: type_vocab_size must be an integer >= 1, got {self.type_vocab_size!r}",
        )
        _check(
            self.d_model % self.n_heads == 0,
            f"config: d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})",
        )
        for name in ("dropout", "attention_dropout"):
            value = getattr(self, name)
            _check(
                isinstance(value, (int, float)) and 0.0 <= value < 1.0,
                f"config: {name} must be in [0, 1), got {value!r}",
            )
        _check(
            self.activation in ACTIVATIONS,
            f"config: unknown activation {self.activation!r} (choose from {', '.join(ACTIVATIONS)})",
        )
        _check(
            self.norm_position in NORM_POSITIONS,
            f"config: norm_position must be 'post' or 'pre', got {self.norm_position!r}",
        )
        _check(
            self.position_encoding in POSITION_ENCODINGS,
            f"unknown position encoding {self.position_encoding!r} "
            f"(choose from {', '.join(POSITION_ENCODINGS)})",
        )
        _check(
            isinstance(self.pad_token_id, int) and 0 <= self.pad_token_id < self.vocab_size,
            f"config: pad_token_id {self.pad_token_id!r} is outside the vocabulary "
            f"(vocab_size {self.vocab_size})",
        )
        _check(
            self.embedding_size is None or 0 < self.embedding_size <= self.d_model,
            f"config: embedding_size must be from 1 to d_model ({self.d_model}) or null, got "
            f"{self.embedding_size!r} (ALBERT factorises the embeddings to a smaller width)",
        )
        _check(
            isinstance(self.share_layers, bool),
            f"config: share_layers must be true or false, got {self.share_layers!r}",
        )
        if self.position_encoding == "rope":
            _check(
                (self.d_model // self.n_heads) % 2 == 0,
                "config: rope needs an even head size (d_model / n_heads)",
            )
        _check_norm_and_positions(self)

    @property
    def d_head(self) -> int:
        """Size of one attention head."""
        return self.d_model // self.n_heads

    @property
    def d_embedding(self) -> int:
        """Width of the embedding tables (ALBERT's E; d_model when not factorised)."""
        return self.embedding_size or self.d_model

    @classmethod
    def presets(cls) -> dict[str, dict[str, Any]]:
        """The named sizes: bert-tiny ... bert-large."""
        return BERT_PRESETS


def _check_norm_and_positions(config: BertConfig | TransformerConfig) -> None:
    """Refuse a negative LayerNorm epsilon, an unusable relative-bias or Shaw table or RoPE base."""
    # Each would fail the model's build or first step, or make every output NaN.
    _check(
        config.layer_norm_eps >= 0,
        f"config: layer_norm_eps must be >= 0, got {config.layer_norm_eps!r}",
    )
    for name in ("relative_buckets", "relative_max_distance", "shaw_max_distance"):
        value = getattr(config, name)
        _check(0 < value < 2**31, f"config: {name} must be a positive integer, got {value!r}")
    if config.position_encoding == "relative_bias":
        # T5's buckets: half exact offsets, half log-spaced from there to the max distance
        # (nn/positions.py: relative_buckets), each for both directions.
        _check(
            config.relative_buckets >= 4,
            f"config: relative_buckets must be at least 4, got {config.relative_buckets}",
        )
        _check(
            config.relative_max_distance > config.relative_buckets // 2,
            f"config: relative_max_distance ({config.relative_max_distance}) must exceed half "
            f"of relative_buckets ({config.relative_buckets}), where the exact offsets end",
        )
    # The rotation angles are position * base ** (-2i / d): a base below 1 makes them grow
    # with i (past float range for a tiny base).
    _check(config.rope_base >= 1, f"config: rope_base must be >= 1, got {config.rope_base!r}")


def _sizes(n_layers: int, d_model: int, n_heads: int) -> dict[str, int]:
    return {"n_layers": n_layers, "d_model": d_model, "n_heads": n_heads, "d_ff": 4 * d_model}


# Published sizes: the paper's base/large and Turc et al. 2019's compact BERTs.
BERT_PRESETS: dict[str, dict[str, int]] = {
    "bert-tiny": _sizes(2, 128, 2),
    "bert-mini": _sizes(4, 256, 4),
    "bert-small": _sizes(4, 512, 8),
    "bert-medium": _sizes(8, 512, 8),
    "bert-base": _sizes(12, 768, 12),
    "bert-large": _sizes(24, 1024, 16),
}


@dataclass
class TransformerConfig(_JsonConfig):
    """Encoder-decoder Transformer (Vaswani et al. 2017): the base model's defaults.

    The paper shares one BPE vocabulary (~37k for EN-DE) between source and target, the two
    embedding tables, and the pre-softmax projection (section 3.4): ``share_embeddings`` and
    ``tie_output``. ``label_smoothing`` is the paper's epsilon_ls (section 5.4).
    """

    src_vocab_size: int = 37000
    tgt_vocab_size: int = 37000
    d_model: int = 512
    n_heads: int = 8
    d_ff: int = 2048
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6
    dropout: float = 0.1
    attention_dropout: float = 0.0  # the paper drops only sub-layer outputs and embedding sums
    activation: str = "relu"
    layer_norm_eps: float = 1e-5
    max_positions: int = 1024
    position_encoding: str = "sinusoidal"
    norm_position: str = "post"
    share_embeddings: bool = True  # one table for source and target tokens
    tie_output: bool = True  # the output projection is the target embedding matrix
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    label_smoothing: float = 0.1
    relative_buckets: int = 32
    relative_max_distance: int = 128
    shaw_max_distance: int = 16  # shaw's clipping distance k (see BertConfig)
    shaw_values: bool = True
    rope_base: float = 10000.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise AttnlabError when a field is out of range or fields contradict each other."""
        check_types(type(self), dataclasses.asdict(self), "config")
        for name in (
            "src_vocab_size",
            "tgt_vocab_size",
            "d_model",
            "n_heads",
            "d_ff",
            "n_encoder_layers",
            "n_decoder_layers",
            "max_positions",
        ):
            value = getattr(self, name)
            _check(
                isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**31,
                f"config: {name} must be a positive integer below 2**31, got {value!r}",
            )
        _check(
            self.d_model % self.n_heads == 0,
            f"config: d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})",
        )
        for name in ("dropout", "attention_dropout", "label_smoothing"):
            value = getattr(self, name)
            _check(
                isinstance(value, (int, float)) and 0.0 <= value < 1.0,
                f"config: {name} must be in [0, 1), got {value!r}",
            )
        _check(
            self.activation in ACTIVATIONS,
            f"config: unknown activation {self.activation!r} (choose from {', '.join(ACTIVATIONS)})",
        )
        _check(
            self.norm_position in NORM_POSITIONS,
            f"config: norm_position must be 'post' or 'pre', got {self.norm_position!r}",
        )
        _check(
            self.position_encoding in POSITION_ENCODINGS,
            f"unknown position encoding {self.position_encoding!r} "
            f"(choose from {', '.join(POSITION_ENCODINGS)})",
        )
        if self.position_encoding == "rope":
            _check(
                (self.d_model // self.n_heads) % 2 == 0,
                "config: rope needs an even head size (d_model / n_heads)",
            )
        _check_norm_and_positions(self)
        for name in ("share_embeddings", "tie_output"):
            _check(
                isinstance(getattr(self, name), bool),
                f"config: {name} must be true or false, got {getattr(self, name)!r}",
            )
        _check_vocabularies(self)

    @property
    def d_head(self) -> int:
        """Size of one attention head."""
        return self.d_model // self.n_heads

    @classmethod
    def presets(cls) -> dict[str, dict[str, Any]]:
        """The named sizes: transformer-small, -base, -big."""
        return TRANSFORMER_PRESETS


def _check_vocabularies(config: TransformerConfig) -> None:
    """Refuse shared embeddings over two vocabularies, or special ids outside them."""
    _check(
        not config.share_embeddings or config.src_vocab_size == config.tgt_vocab_size,
        f"config: share_embeddings needs one vocabulary, but src_vocab_size is "
        f"{config.src_vocab_size} and tgt_vocab_size {config.tgt_vocab_size}: use a joint "
        "vocabulary or set share_embeddings=False",
    )
    for name in ("pad_id", "bos_id", "eos_id"):
        value = getattr(config, name)
        _check(
            isinstance(value, int) and 0 <= value < config.tgt_vocab_size,
            f"config: {name} {value!r} is outside the target vocabulary "
            f"(tgt_vocab_size {config.tgt_vocab_size})",
        )
    _check(
        config.pad_id < config.src_vocab_size,
        f"config: pad_id {config.pad_id} is outside the source vocabulary "
        f"(src_vocab_size {config.src_vocab_size})",
    )
    _check(
        config.pad_id != config.eos_id,
        "config: pad_id and eos_id must differ (an ended sentence is told from padding)",
    )


def _seq2seq_sizes(
    n_layers: int, d_model: int, n_heads: int, d_ff: int, dropout: float
) -> dict[str, Any]:
    return {
        "n_encoder_layers": n_layers,
        "n_decoder_layers": n_layers,
        "d_model": d_model,
        "n_heads": n_heads,
        "d_ff": d_ff,
        "dropout": dropout,
    }


# The paper's Table 3 base and big models; "small" is sized for Multi30k (29k sentence pairs)
# on a 2-core CPU: ~4x fewer FLOPs per token than base, and a small data set overfits base.
TRANSFORMER_PRESETS: dict[str, dict[str, Any]] = {
    "transformer-small": _seq2seq_sizes(3, 256, 4, 1024, 0.1),
    "transformer-base": _seq2seq_sizes(6, 512, 8, 2048, 0.1),
    "transformer-big": _seq2seq_sizes(6, 1024, 16, 4096, 0.3),
}


@dataclass
class GPTConfig(_JsonConfig):
    """Decoder-only Transformer (Radford et al. 2018/2019): GPT-2 small's defaults.

    Pre-LN causal blocks, a final LayerNorm, the LM head tied to the token embedding
    (``tie_embeddings``), learned absolute positions unless ``position_encoding`` names
    another scheme of ``attnlab.nn.positions``. ``max_positions`` is the context length.
    """

    vocab_size: int = 50257
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    d_ff: int = 3072
    max_positions: int = 1024
    dropout: float = 0.1  # on the embedding sum and every residual branch (GPT-2's pdrops)
    attention_dropout: float = 0.1
    activation: str = "gelu_tanh"  # GPT-2's "gelu_new"
    layer_norm_eps: float = 1e-5
    position_encoding: str = "learned"
    tie_embeddings: bool = True  # the LM head is the token embedding matrix
    initializer_range: float = 0.02
    relative_buckets: int = 32
    relative_max_distance: int = 128
    shaw_max_distance: int = 16  # shaw's clipping distance k (see BertConfig)
    shaw_values: bool = True
    rope_base: float = 10000.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise AttnlabError when a field is out of range or fields contradict each other."""
        check_types(type(self), dataclasses.asdict(self), "config")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_positions"):
            value = getattr(self, name)
            _check(
                isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**31,
                f"config: {name} must be a positive integer below 2**31, got {value!r}",
            )
        _check(
            self.d_model % self.n_heads == 0,
            f"config: d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})",
        )
        for name in ("dropout", "attention_dropout"):
            value = getattr(self, name)
            _check(
                isinstance(value, (int, float)) and 0.0 <= value < 1.0,
                f"config: {name} must be in [0, 1), got {value!r}",
            )
        _check(
            self.activation in ACTIVATIONS,
            f"config: unknown activation {self.activation!r} (choose from {', '.join(ACTIVATIONS)})",
        )
        _check(
            self.position_encoding in POSITION_ENCODINGS,
            f"unknown position encoding {self.position_encoding!r} "
            f"(choose from {', '.join(POSITION_ENCODINGS)})",
        )
        _check(
            self.initializer_range > 0,
            f"config: initializer_range must be > 0, got {self.initializer_range!r}",
        )
        if self.position_encoding == "rope":
            _check(
                (self.d_model // self.n_heads) % 2 == 0,
                "config: rope needs an even head size (d_model / n_heads)",
            )
        _check_norm_and_positions(self)

    @property
    def d_head(self) -> int:
        """Size of one attention head."""
        return self.d_model // self.n_heads

    @classmethod
    def presets(cls) -> dict[str, dict[str, Any]]:
        """The named sizes: gpt-char, gpt2, gpt2-medium."""
        return GPT_PRESETS


# GPT-2 small and medium (Radford et al. 2019, table 2), and a character-level model sized
# for a 2-core CPU (nanoGPT's shakespeare_char, narrower): its vocab_size is the tokenizer's,
# set when the model is built. Small models fitting in minutes gain nothing from dropout.
GPT_PRESETS: dict[str, dict[str, Any]] = {
    "gpt-char": {
        **_sizes(4, 192, 6),
        "vocab_size": 256,
        "max_positions": 256,
        "dropout": 0.0,
        "attention_dropout": 0.0,
    },
    "gpt2": {**_sizes(12, 768, 12), "vocab_size": 50257, "max_positions": 1024},
    "gpt2-medium": {**_sizes(24, 1024, 16), "vocab_size": 50257, "max_positions": 1024},
}
