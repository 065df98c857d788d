"""HuggingFace BERT checkpoints, both ways: config.json + weights <-> attnlab's BERT.

A checkpoint directory holds ``config.json`` (HF field names), ``vocab.txt`` and/or
``tokenizer.json``, and ``model.safetensors`` (or a legacy ``pytorch_model.bin``, read with
``weights_only=True``; or the shards an ``.index.json`` of either names). attnlab saves in this same layout, so its models go back to the HF
ecosystem unchanged; settings HF has no field for (another positional scheme, pre-LN) ride in
config.json under ``"attnlab"``, and such models only load in attnlab.

The name mapping is the only translation: HF's separate query/key/value matrices are
concatenated into attnlab's fused QKV projection on load and split again on save.
"""

from __future__ import annotations

import json
import math
import pickle
import re
import warnings
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from attnlab.config import BertConfig
from attnlab.errors import AttnlabError, first_line
from attnlab.io import staged_dir, write_text_atomic, write_with_atomic
from attnlab.models.bert import BertForPreTraining, BertModel, BertPooler, count_parameters
from attnlab.models.heads import POOLINGS, PROBLEM_TYPES

HF_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
}
# attnlab config field <- HF config.json field
HF_FIELDS = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "d_ff": "intermediate_size",
    "max_positions": "max_position_embeddings",
    "type_vocab_size": "type_vocab_size",
    "dropout": "hidden_dropout_prob",
    "attention_dropout": "attention_probs_dropout_prob",
    "layer_norm_eps": "layer_norm_eps",
    "pad_token_id": "pad_token_id",
    "initializer_range": "initializer_range",
}
ATTNLAB_ONLY = (
    "norm_position",
    "position_encoding",
    "relative_buckets",
    "relative_max_distance",
    "shaw_max_distance",
    "shaw_values",
    "rope_base",
    "embedding_size",
    "share_layers",
)
# settings of a task head (not of BertConfig) that also ride under "attnlab"
HEAD_ONLY = ("pooling",)


# ---------------------------------------------------------------------------- config


def config_from_hf(data: dict[str, Any], source: str = "config.json") -> BertConfig:
    """BertConfig from the fields of an HF BERT config.json."""
    if not isinstance(data, dict):
        raise AttnlabError(f"{source}: expected a JSON object")
    model_type = data.get("model_type", "bert")
    if model_type not in ("bert", "attnlab-bert"):
        raise AttnlabError(f"{source}: model_type is {model_type!r}, attnlab loads BERT models")
    fields: dict[str, Any] = {}
    for ours, theirs in HF_FIELDS.items():
        if theirs in data and data[theirs] is not None:
            fields[ours] = data[theirs]
    for required in ("vocab_size", "d_model", "n_layers", "n_heads"):
        if required not in fields:
            raise AttnlabError(f"{source}: missing {HF_FIELDS[required]!r}: is this a BERT config?")
    fields.setdefault("d_ff", 4 * fields["d_model"])
    act = data.get("hidden_act", "gelu")
    if not isinstance(act, str) or act not in HF_ACTIVATIONS:
        raise AttnlabError(
            f"{source}: unsupported hidden_act {act!r} (supported: {', '.join(HF_ACTIVATIONS)})"
        )
    fields["activation"] = HF_ACTIVATIONS[act]
    pos_type = data.get("position_embedding_type", "absolute")
    if pos_type not in ("absolute", None):
        raise AttnlabError(f"{source}: position_embedding_type {pos_type!r} is not supported")
    fields["position_encoding"] = "learned"
    # HF's BERT turns into a causal decoder (and adds cross-attention layers) with these set;
    # attnlab's BERT is bidirectional, so such a model would run with another mask.
    for flag in ("is_decoder", "add_cross_attention"):
        if data.get(flag):
            raise AttnlabError(
                f"{source}: {flag} is true (a BERT decoder): attnlab loads BERT encoders only"
            )
    extra = data.get("attnlab", {})
    if not isinstance(extra, dict):
        raise AttnlabError(f"{source}: 'attnlab' must be an object")
    unknown = sorted(set(extra) - set(ATTNLAB_ONLY) - set(HEAD_ONLY))
    if unknown:  # a misspelt setting (say norm_position) would silently change the model
        raise AttnlabError(
            f"{source}: unknown 'attnlab' setting(s) {', '.join(map(repr, unknown))} "
            f"(known: {', '.join(ATTNLAB_ONLY)})"
        )
    for key in ATTNLAB_ONLY:
        if key in extra:
            fields[key] = extra[key]
    try:
        return BertConfig(**fields)
    except AttnlabError as err:
        raise AttnlabError(f"{source}: {err}") from None
    except TypeError as err:
        raise AttnlabError(f"{source}: malformed value ({err})") from None


def config_to_hf(config: BertConfig, architecture: str = "BertForPreTraining") -> dict[str, Any]:
    """An HF BERT config.json dict for this config (attnlab-only settings under 'attnlab').

    A config HF's BERT cannot run exactly (hf_compatible) gets model_type "attnlab-bert", so
    transformers refuses it instead of loading it with missing or misread weights.
    """
    model_type = "bert" if hf_compatible(config) is None else "attnlab-bert"
    data: dict[str, Any] = {"architectures": [architecture], "model_type": model_type}
    for ours, theirs in HF_FIELDS.items():
        data[theirs] = getattr(config, ours)
    # gelu_tanh is torch's F.gelu(approximate="tanh"), which HF calls gelu_pytorch_tanh; its
    # gelu_new is the same formula written out, equal only to within rounding.
    data["hidden_act"] = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}[
        config.activation
    ]
    data["position_embedding_type"] = "absolute"
    data["attnlab"] = {key: getattr(config, key) for key in ATTNLAB_ONLY}
    return data


def hf_compatible(config: BertConfig) -> str | None:
    """None if HF's BertModel can run this config exactly, else the reason it cannot."""
    if config.position_encoding != "learned":
        return (
            f"position_encoding {config.position_encoding!r} (HF BERT has learned positions only)"
        )
    if config.norm_position != "post":
        return "pre-LN layers (HF BERT is post-LN)"
    if config.embedding_size not in (None, config.d_model):
        return "factorised embeddings (an ALBERT setting HF BERT lacks)"
    if config.share_layers:
        return "cross-layer parameter sharing (an ALBERT setting HF BERT lacks)"
    return None


# ---------------------------------------------------------------------------- weights

_LAYER = re.compile(r"^encoder\.layers\.(\d+)\.(.+)$")
# attnlab name inside a layer -> HF name inside encoder.layer.N
_LAYER_NAMES = {
    "self_attn.out_proj": "attention.output.dense",
    "norm1": "attention.output.LayerNorm",
    "ffn.fc1": "intermediate.dense",
    "ffn.fc2": "output.dense",
    "norm2": "output.LayerNorm",
}
_TOP_NAMES = {
    "embeddings.word_embeddings.weight": "embeddings.word_embeddings.weight",
    "embeddings.token_type_embeddings.weight": "embeddings.token_type_embeddings.weight",
    "embeddings.positions.weight": "embeddings.position_embeddings.weight",
    "embeddings.norm.weight": "embeddings.LayerNorm.weight",
    "embeddings.norm.bias": "embeddings.LayerNorm.bias",
    "pooler.dense.weight": "pooler.dense.weight",
    "pooler.dense.bias": "pooler.dense.bias",
}
_HEAD_NAMES = {
    "mlm.dense.weight": "cls.predictions.transform.dense.weight",
    "mlm.dense.bias": "cls.predictions.transform.dense.bias",
    "mlm.norm.weight": "cls.predictions.transform.LayerNorm.weight",
    "mlm.norm.bias": "cls.predictions.transform.LayerNorm.bias",
    "mlm.bias": "cls.predictions.bias",
    "nsp.weight": "cls.seq_relationship.weight",
    "nsp.bias": "cls.seq_relationship.bias",
}


def _in_hf_layer(name: str) -> bool:
    """Whether HF's BERT layer has this parameter of ours (not Shaw et al.'s relative tables)."""
    return not name.startswith("self_attn.relative.")


def _normalise_hf_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
    # Old TF-converted checkpoints call LayerNorm parameters gamma/beta; some add "bert.".
    out = {}
    for name, tensor in state.items():
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight")
        name = name.replace("LayerNorm.beta", "LayerNorm.bias")
        if name.startswith("bert."):
            name = name[len("bert.") :]
        out[name] = tensor
    return out


def bert_state_from_hf(state: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    """attnlab state dict for model (BertModel or BertForPreTraining) from HF-named tensors."""
    hf = _normalise_hf_names(state)
    prefix = "bert." if isinstance(model, BertForPreTraining) else ""
    ours: dict[str, Tensor] = {}
    missing: list[str] = []

    def take(hf_name: str) -> Tensor | None:
        if hf_name not in hf:
            missing.append(hf_name)
            return None
        return _checked_weight(hf_name, hf[hf_name])

    for name in model.state_dict():
        plain = name[len(prefix) :] if name.startswith(prefix) else name
        if plain == "mlm.word_embeddings.weight":
            continue  # tied to the input embeddings
        if plain in _TOP_NAMES:
            tensor = take(_TOP_NAMES[plain])
        elif plain in _HEAD_NAMES:
            tensor = take(_HEAD_NAMES[plain])
        elif (match := _LAYER.match(plain)) and _in_hf_layer(match.group(2)):
            index, rest = match.groups()
            base = f"encoder.layer.{index}."
            if rest.startswith("self_attn.qkv_proj."):
                kind = rest.rsplit(".", 1)[1]  # weight / bias
                parts = [
                    take(f"{base}attention.self.{p}.{kind}") for p in ("query", "key", "value")
                ]
                tensor = None if any(p is None for p in parts) else torch.cat(parts, dim=0)
            else:
                module, kind = rest.rsplit(".", 1)
                if module not in _LAYER_NAMES:
                    raise AttnlabError(f"no HF name for parameter {name}")
                tensor = take(f"{base}{_LAYER_NAMES[module]}.{kind}")
        else:
            tensor = take(f"attnlab.{plain}")  # attnlab-only, e.g. a relative-bias table
        if tensor is not None:
            ours[name] = tensor
    if missing:
        shown = ", ".join(missing[:3]) + (
            f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        )
        raise AttnlabError(f"checkpoint is missing weights: {shown}")
    return ours


def bert_state_to_hf(model: nn.Module) -> dict[str, Tensor]:
    """HF-named tensors (BertForPreTraining layout with 'bert.' when heads exist) from an attnlab model."""
    has_heads = isinstance(model, BertForPreTraining)
    prefix = "bert." if has_heads else ""
    out: dict[str, Tensor] = {}
    for name, tensor in model.state_dict().items():
        plain = name[len(prefix) :] if name.startswith(prefix) else name
        tensor = tensor.detach().contiguous()
        if plain == "mlm.word_embeddings.weight":
            continue
        if plain in _TOP_NAMES:
            out[prefix + _TOP_NAMES[plain]] = tensor
        elif plain in _HEAD_NAMES:
            out[_HEAD_NAMES[plain]] = tensor
        elif (match := _LAYER.match(plain)) and _in_hf_layer(match.group(2)):
            index, rest = match.groups()
            base = f"{prefix}encoder.layer.{index}."
            if rest.startswith("self_attn.qkv_proj."):
                kind = rest.rsplit(".", 1)[1]
                for part, chunk in zip(
                    ("query", "key", "value"), tensor.chunk(3, dim=0), strict=True
                ):
                    out[f"{base}attention.self.{part}.{kind}"] = chunk.contiguous()
            else:
                module, kind = rest.rsplit(".", 1)
                out[f"{base}{_LAYER_NAMES[module]}.{kind}"] = tensor
        else:
            out[f"{prefix}attnlab.{plain}"] = tensor  # attnlab-only (e.g. relative bias table)
    return out  # the MLM decoder weight and bias are tied in HF too, so they are not saved


# ---------------------------------------------------------------------------- directories


def read_config(path: Path) -> BertConfig:
    """BertConfig from DIR/config.json, with one-line errors for every way it can be wrong."""
    path = Path(path)
    if not path.exists():
        raise AttnlabError(f"model directory {path} does not exist")
    if not path.is_dir():
        raise AttnlabError(f"{path} is not a directory: pass a model directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise AttnlabError(f"config.json not found in {path}: is this a BERT checkpoint?")
    try:
        data = json.loads(config_file.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as err:  # also too deep, or an integer too long
        raise AttnlabError(f"{config_file}: not valid JSON ({err})") from None
    return config_from_hf(data, str(config_file))


def sentence_max_length(path: Path) -> int | None:
    """max_seq_length of a sentence-transformers folder (sentence_bert_config.json), else None.

    sentence-transformers truncates to this length (256 for all-MiniLM-L6-v2, whose positions
    go to 512), so embeddings of longer texts match its ``encode`` only when cut there too.
    """
    file = Path(path) / "sentence_bert_config.json"
    if not file.is_file():
        return None
    try:
        value = json.loads(file.read_text(encoding="utf-8")).get("max_seq_length")
    except (ValueError, RecursionError, AttributeError) as err:  # AttributeError: not an object
        raise AttnlabError(f"{file}: not a valid sentence-transformers config ({err})") from None
    if value is None:
        return None
    if type(value) is not int or value < 2:
        raise AttnlabError(
            f"{file}: max_seq_length must be an integer of at least 2, got {value!r}"
        )
    return value


def check_vocabulary(path: Path, tokenizer_size: int, config: BertConfig) -> None:
    """Refuse a tokenizer with more tokens than the model's embedding table has rows."""
    if tokenizer_size > config.vocab_size:  # else an IndexError deep in the embedding
        raise AttnlabError(
            f"the tokenizer in {path} has {tokenizer_size} tokens but config.json "
            f"says vocab_size {config.vocab_size}: are they from the same model?"
        )


# In HF's order of preference; an index.json names the shards of a large checkpoint.
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def _weight_files(path: Path) -> list[Path]:
    """The files holding DIR's weights: one of WEIGHT_FILES, or the shards its index names."""
    file = _weight_file(Path(path))
    if file.name.endswith(".index.json"):
        return _shard_files(file, _weight_map(file))
    return [file]


def _weight_file(path: Path) -> Path:
    for name in WEIGHT_FILES:
        if (path / name).is_file():
            return path / name
    raise AttnlabError(f"no model.safetensors or pytorch_model.bin (or their index.json) in {path}")


def _weight_map(index: Path) -> dict[str, str]:
    """The weight_map (tensor name -> shard file name) of a sharded checkpoint's index.json."""
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as err:
        raise AttnlabError(f"{index}: not valid JSON ({err})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if (
        not isinstance(weight_map, dict)
        or not weight_map
        or not all(isinstance(v, str) for v in weight_map.values())
    ):
        raise AttnlabError(f"{index}: expected a non-empty weight_map of tensor name: shard file")
    return weight_map


def _shard_files(index: Path, weight_map: dict[str, str]) -> list[Path]:
    """The shard files weight_map names, each once, each a file beside the index."""
    names = list(dict.fromkeys(weight_map.values()))
    for name in names:
        # A name with a folder in it could read a file outside the checkpoint directory.
        if Path(name).name != name or name in (".", ".."):
            raise AttnlabError(f"{index}: shard {name!r} is not a file name in its directory")
        if not (index.parent / name).is_file():
            raise AttnlabError(f"{index}: shard {name} not found in {index.parent}")
    return [index.parent / name for name in names]


def read_weights(path: Path) -> dict[str, Tensor]:
    """The tensors of DIR's weights (see WEIGHT_FILES); .bin files are read with weights_only."""
    file = _weight_file(Path(path))
    if not file.name.endswith(".index.json"):
        return _read_weight_file(file)
    weight_map = _weight_map(file)
    state: dict[str, Tensor] = {}
    for shard in _shard_files(file, weight_map):
        state.update(_read_weight_file(shard))
    absent = sorted(set(weight_map) - set(state))
    if absent:  # a shard from another download, say
        raise AttnlabError(f"{file} names tensors no shard holds: {', '.join(absent[:3])}")
    return state


def _read_weight_file(file: Path) -> dict[str, Tensor]:
    """The tensors of one .safetensors file, or of a .bin file of plain tensors."""
    if file.stat().st_size == 0:  # torch.load says only EOFError()
        raise AttnlabError(f"cannot read weights in {file}: the file is empty")
    try:
        if file.suffix == ".safetensors":
            return load_file(str(file))
        with warnings.catch_warnings():  # torch's notes on pickle protocols: not for users
            warnings.simplefilter("ignore")
            state = torch.load(str(file), map_location="cpu", weights_only=True)
        if not isinstance(state, dict):
            raise AttnlabError(f"{file}: expected a state dict")
        odd = next((k for k, v in state.items() if not isinstance(v, Tensor)), None)
        if odd is not None:
            raise AttnlabError(f"{file}: entry {odd!r} is not a tensor")
        return state
    except AttnlabError:
        raise
    except pickle.UnpicklingError:  # torch's message suggests weights_only=False: never here
        raise AttnlabError(
            f"{file} is not a file of plain tensors (only weights are loaded, never pickled "
            "code): if it comes from a source you trust, convert it to model.safetensors"
        ) from None
    except Exception as err:  # corrupt or truncated file: the libraries raise many types
        raise AttnlabError(f"cannot read weights in {file}: {first_line(err)}") from None


def weight_names(path: Path) -> set[str]:
    """The tensor names of DIR's weights; from the safetensors headers alone where they are."""
    files = _weight_files(Path(path))
    if all(f.suffix == ".safetensors" for f in files):
        try:
            names: set[str] = set()
            for file in files:
                with safe_open(str(file), "pt") as stored:
                    names.update(stored.keys())
            return names
        except Exception:  # a damaged file: read_weights below names the problem
            pass
    return set(read_weights(Path(path)))


def load_bert(
    path: str | Path, heads: bool = False, trained_heads: bool = False
) -> BertModel | BertForPreTraining:
    """A BERT from an HF or attnlab checkpoint directory, in eval mode.

    heads=True builds BertForPreTraining; checkpoints without pretraining heads then get
    freshly initialised ones, unless trained_heads=True, which refuses them (fill-mask and a
    distillation teacher need the masked-LM head a checkpoint was trained with).
    """
    path = Path(path)
    config = read_config(path)
    state = read_weights(path)
    _check_layer_count(state, config.n_layers, path)
    has_pooler = any(k.endswith("pooler.dense.weight") for k in state)
    has_heads = any(k.startswith("cls.predictions") for k in state)
    has_sentence_head = any(k.startswith("cls.seq_relationship") for k in state)
    if trained_heads and not has_heads:
        raise AttnlabError(
            f"{path} has no masked-LM head (cls.predictions): this needs a BertForPreTraining "
            "or BertForMaskedLM checkpoint, not an encoder-only one"
        )
    if heads and not has_heads:
        # An encoder-only checkpoint: its weights fill the encoder, the heads start fresh.
        encoder = BertModel(config, add_pooler=has_pooler)
        _load_checked(encoder, bert_state_from_hf(state, encoder), path)
        model = BertForPreTraining(config)
        model.bert.load_state_dict(encoder.state_dict(), strict=False)
        return model.eval()
    if heads:
        state = _tied_mlm_head(_normalise_hf_names(state), _read_config_json(path), path)
        model: nn.Module = BertForPreTraining(config, sentence_head=has_sentence_head)
        if has_pooler and model.bert.pooler is None:
            # A trained pooler without an NSP head (transformers before 3.1 saved
            # BertForMaskedLM so): kept, so that an export or classifier still has it.
            model.bert.pooler = BertPooler(config)
    else:
        model = BertModel(config, add_pooler=has_pooler)
    _load_checked(model, bert_state_from_hf(state, model), path)
    return model.eval()


def _tied_mlm_head(hf: dict[str, Tensor], data: dict[str, Any], path: Path) -> dict[str, Tensor]:
    """hf with the MLM output bias as cls.predictions.bias; a decoder of its own is refused.

    attnlab's MLM decoder is the word embedding matrix (BERT ties them): a checkpoint whose
    decoder weight or bias is another tensor would give other logits.
    """
    weight = hf.get("cls.predictions.decoder.weight")
    embeddings = hf.get("embeddings.word_embeddings.weight")
    if not data.get("tie_word_embeddings", True) or (
        weight is not None and (embeddings is None or not torch.equal(weight, embeddings))
    ):
        raise AttnlabError(
            f"{path} has a masked-LM decoder not tied to the word embeddings "
            "(tie_word_embeddings false, or a cls.predictions.decoder.weight of its own), which "
            "attnlab's MLM head cannot hold: load the encoder alone (heads=False)"
        )
    bias, decoder_bias = hf.get("cls.predictions.bias"), hf.get("cls.predictions.decoder.bias")
    if decoder_bias is None:
        return hf
    if bias is None:  # some conversions store the one bias under the decoder's name only
        return {**hf, "cls.predictions.bias": decoder_bias}
    if not torch.equal(bias, decoder_bias):
        raise AttnlabError(
            f"{path} holds two different masked-LM output biases (cls.predictions.bias and "
            "cls.predictions.decoder.bias; HF uses the second): remove the one not trained"
        )
    return hf


def all_finite(tensor: Tensor) -> bool:
    """Whether a float tensor holds no NaN or infinity."""
    # A NaN or infinity makes the sum non-finite; one pass, about 15x faster than isfinite's
    # mask (0.04 against 0.69 s for 110M floats, 2 threads). A sum that overflows on finite
    # values is told apart by the exact test.
    return math.isfinite(float(tensor.sum())) or bool(torch.isfinite(tensor).all())


def _checked_weight(name: str, tensor: Tensor) -> Tensor:
    """tensor, unless it holds integers (converted in silence) or NaN/inf (NaN outputs)."""
    if not tensor.is_floating_point():
        raise AttnlabError(f"weight {name} holds {tensor.dtype}, not floats")
    if not all_finite(tensor):
        raise AttnlabError(f"weight {name} holds NaN or infinite values")
    return tensor


def _check_layer_count(state: dict[str, Tensor], n_layers: int, path: Path) -> None:
    """Refuse weights of more encoder layers than config.json has (they would be dropped)."""
    found = {int(m.group(1)) for k in state if (m := _HF_LAYER_INDEX.search(k))}
    if found and max(found) >= n_layers:
        raise AttnlabError(
            f"{path} holds weights of {max(found) + 1} encoder layers but config.json says "
            f"num_hidden_layers {n_layers}"
        )


_HF_LAYER_INDEX = re.compile(r"(?:^|\.)encoder\.layer\.(\d+)\.")


def _load_checked(model: nn.Module, weights: dict[str, Tensor], path: Path) -> None:
    expected = model.state_dict()
    for name, tensor in weights.items():
        if name not in expected:
            continue
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise AttnlabError(
                f"weight {name} in {path} has shape {tuple(tensor.shape)}, "
                f"config.json implies {tuple(expected[name].shape)}"
            )
    missing = [
        n for n in expected if n not in weights and not n.endswith("mlm.word_embeddings.weight")
    ]
    if missing:
        raise AttnlabError(f"checkpoint in {path} is missing weights: {', '.join(missing[:3])}")
    model.load_state_dict({k: v for k, v in weights.items() if k in expected}, strict=False)


def save_bert(
    model: BertModel | BertForPreTraining,
    out: str | Path,
    tokenizer: Any | None = None,
    overwrite: bool = False,
    require_hf: bool = False,
) -> None:
    """Write model (+ tokenizer) to out in HF layout: config.json, model.safetensors, vocab files.

    The directory appears whole or not at all; an existing non-empty out is refused unless
    overwrite. require_hf refuses configs HF transformers cannot run.
    """
    config = model.config
    if require_hf and (reason := hf_compatible(config)):
        raise AttnlabError(f"cannot export to HF format: {reason}")
    arch = "BertModel"
    if isinstance(model, BertForPreTraining):
        arch = "BertForPreTraining" if model.nsp is not None else "BertForMaskedLM"
    with staged_dir(Path(out), overwrite, flag="out") as stage:
        write_text_atomic(stage / "config.json", json.dumps(config_to_hf(config, arch), indent=2))
        state = bert_state_to_hf(model)
        write_with_atomic(
            stage / "model.safetensors",
            lambda p: save_file(state, str(p), metadata={"format": "pt"}),
        )
        if tokenizer is not None:
            tokenizer.save(stage)


def describe(model: nn.Module) -> dict[str, Any]:
    """Config and parameter count as a JSON-ready dict."""
    return {"config": model.config.to_dict(), "parameters": count_parameters(model)}


# ---------------------------------------------------------------------------- task heads

# attnlab task -> the HF class whose checkpoint layout (and config.json) a fine-tuned model has
TASK_ARCHITECTURES = {
    "classify": "BertForSequenceClassification",
    "regress": "BertForSequenceClassification",
    "ner": "BertForTokenClassification",
    "qa": "BertForQuestionAnswering",
}
_HEAD_PREFIXES = {"classify": "classifier.", "regress": "classifier.", "ner": "classifier."}


def _read_config_json(path: Path) -> dict[str, Any]:
    read_config(path)  # every way config.json can be wrong, as one-line errors
    return json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))


def checkpoint_task(path: str | Path, weights: Collection[str] | None = None) -> str | None:
    """The task a checkpoint's head was trained for (classify/regress/ner/qa), None for an encoder.

    A head attnlab cannot run as trained (multi-label), or one config.json does not name, is
    an error rather than None, so that no trained head is taken for an encoder and replaced.
    weights: the checkpoint's tensor names where the caller has read them already.
    """
    path = Path(path)
    data = _read_config_json(path)
    architectures = data.get("architectures") or []
    arch = architectures[0] if isinstance(architectures, list) and architectures else None
    if arch == "BertForTokenClassification":
        return "ner"
    if arch == "BertForQuestionAnswering":
        return "qa"
    if arch == "BertForSequenceClassification":
        # HF infers regression from a single label when problem_type is unset.
        problem = data.get("problem_type")
        if problem is None:
            id2label = data.get("id2label") or {}
            if not isinstance(id2label, dict):
                raise AttnlabError(f"{path}/config.json: id2label must be an object of id: label")
            problem = "regression" if len(id2label) == 1 else PROBLEM_TYPES[0]
        if problem not in PROBLEM_TYPES:
            raise AttnlabError(
                f"{path}/config.json: problem_type {problem!r} is not supported (attnlab trains "
                f"{' and '.join(PROBLEM_TYPES)} heads); finetune with new_head trains a new "
                "head on its encoder",
                options=("new_head",),
            )
        return "regress" if problem == "regression" else "classify"
    _refuse_unnamed_head(path, architectures, weights)
    return None


def _refuse_unnamed_head(path: Path, architectures: Any, names: Collection[str] | None) -> None:
    """Refuse trained head weights that config.json's "architectures" does not name."""
    names = weight_names(path) if names is None else names
    if any(name.startswith("qa_outputs.") for name in names):
        head, fix = "qa_outputs", '["BertForQuestionAnswering"]'
    elif any(name.startswith("classifier.") for name in names):
        head = "classifier"
        fix = '["BertForSequenceClassification"] (["BertForTokenClassification"] for a tagger)'
    else:
        return
    said = f"architectures {architectures}" if architectures else 'no "architectures"'
    raise AttnlabError(
        f"{path}/config.json has {said} but its weights hold a trained {head} head: "
        f'add "architectures": {fix} to config.json (or replace the head: finetune with '
        "new_head)",
        options=("new_head",),
    )


def checkpoint_labels(path: str | Path) -> list[str] | None:
    """The label names in config.json's id2label, in id order (None when there are none)."""
    id2label = _read_config_json(Path(path)).get("id2label")
    if id2label is not None and not isinstance(id2label, dict):
        raise AttnlabError(f"{path}/config.json: id2label must be a table of id: name")
    if not id2label:
        return None
    try:
        ids = sorted(int(i) for i in id2label)
    except ValueError:
        raise AttnlabError(f"{path}/config.json: id2label keys must be integers") from None
    if ids != list(range(len(ids))):
        raise AttnlabError(f"{path}/config.json: id2label ids must be 0..{len(ids) - 1}")
    # str() would make labels such as "None" or "['x']"; a line break or tab in a name would
    # split a predicted CoNLL line or an error message.
    odd = [n for n in id2label.values() if not isinstance(n, str) or not n.isprintable()]
    if odd:
        raise AttnlabError(
            f"{path}/config.json: id2label names must be printable strings, got {odd[0]!r}"
        )
    by_id = {int(i): name for i, name in id2label.items()}
    return [by_id[i] for i in ids]


def build_task_model(
    config: BertConfig,
    task: str,
    num_labels: int = 2,
    classifier_dropout: float | None = None,
    pooling: str = "cls",
) -> nn.Module:
    """A freshly initialised task model (encoder and head) for task.

    classifier_dropout is HF's config field: the dropout before a classifier (None: the
    encoder's hidden dropout); HF's question-answering head has none. pooling: what a
    classify or regress head reads, the [CLS] pooler or the mean of the token states.
    """
    from attnlab.models.heads import (
        BertForQuestionAnswering,
        BertForSequenceClassification,
        BertForTokenClassification,
    )

    if task == "classify":
        return BertForSequenceClassification(
            config, num_labels, classifier_dropout=classifier_dropout, pooling=pooling
        )
    if task == "regress":
        return BertForSequenceClassification(
            config, 1, "regression", classifier_dropout=classifier_dropout, pooling=pooling
        )
    if task == "ner":
        return BertForTokenClassification(config, num_labels, classifier_dropout)
    if task == "qa":
        return BertForQuestionAnswering(config)
    raise AttnlabError(f"unknown task {task!r} (choose from {', '.join(TASK_ARCHITECTURES)})")


def _head_state(state: dict[str, Tensor], task: str) -> dict[str, Tensor]:
    prefix = _HEAD_PREFIXES.get(task, "qa_outputs.")
    return {
        k[len(prefix) :]: _checked_weight(k, v) for k, v in state.items() if k.startswith(prefix)
    }


def load_task_model(
    path: str | Path,
    task: str,
    num_labels: int | None = None,
    new_head: bool = False,
    pooling: str | None = None,
) -> tuple[nn.Module, list[str]]:
    """A task model from an HF or attnlab checkpoint dir, and the names of freshly initialised parts.

    A fine-tuned checkpoint of the same task loads whole; an encoder (or pretraining)
    checkpoint, or new_head=True, gives the encoder's weights and a new random head
    (plus a new pooler for [CLS] classification when the checkpoint has none, as HF does).
    A head of another task, or with another number of labels, is an error unless new_head.
    pooling: a classifier's (cls or mean); None, the one saved in config.json (else cls).
    """
    path = Path(path)
    config = read_config(path)
    state = read_weights(path)
    saved = None if new_head else checkpoint_task(path, weights=state.keys())
    _check_layer_count(state, config.n_layers, path)
    head = _head_state(state, task)
    if saved is not None and saved != task and not new_head:
        raise AttnlabError(
            f"{path} holds a {TASK_ARCHITECTURES[saved]} model for task {saved!r}, "
            f"which does not fit task {task!r}"
        )
    keep_head = bool(head) and saved == task and not new_head
    if keep_head and set(head) != {"weight", "bias"}:
        prefix = _HEAD_PREFIXES.get(task, "qa_outputs.")
        raise AttnlabError(
            f"{path}: the {prefix[:-1]} head holds {', '.join(sorted(head))}, not weight and bias"
        )
    if num_labels is None:
        if not keep_head and task in ("classify", "ner"):
            raise AttnlabError(f"{path} has no {task} head: the number of labels is unknown")
        num_labels = head["weight"].shape[0] if keep_head and task != "qa" else 1
    data = _read_config_json(path)
    pooling = _saved_pooling(data, path) if pooling is None else pooling
    model = build_task_model(config, task, num_labels, _classifier_dropout(data, path), pooling)
    if keep_head and head["weight"].shape[0] != model.state_dict()[_head_key(task)].shape[0]:
        raise AttnlabError(
            f"the head in {path} has {head['weight'].shape[0]} outputs, this task needs "
            f"{model.state_dict()[_head_key(task)].shape[0]}"
        )
    has_pooler = any(k.endswith("pooler.dense.weight") for k in state)
    encoder = BertModel(config, add_pooler=has_pooler)
    _load_checked(encoder, bert_state_from_hf(state, encoder), path)
    model.bert.load_state_dict(encoder.state_dict(), strict=False)  # a pooler no head reads drops
    fresh = []
    if model.bert.pooler is not None and not has_pooler:
        fresh.append("pooler")
    head_module = model.qa_outputs if task == "qa" else model.classifier
    if keep_head:
        _load_checked(head_module, head, path)
    else:
        fresh.append(_head_key(task).split(".")[0])
    return model.eval(), fresh


def _classifier_dropout(data: dict[str, Any], path: Path) -> float | None:
    """config.json's classifier_dropout: None, or a probability below 1."""
    value = data.get("classifier_dropout")
    if value is not None and (
        not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1
    ):
        raise AttnlabError(
            f"{path}/config.json: classifier_dropout must be null or a number in [0, 1), "
            f"got {value!r}"
        )
    return value


def checkpoint_pooling(path: str | Path) -> str:
    """A fine-tuned classifier's pooling (cls or mean) as its config.json says; cls if unsaid."""
    return _saved_pooling(_read_config_json(Path(path)), Path(path))


def _saved_pooling(data: dict[str, Any], path: Path) -> str:
    # saved under "attnlab" by save_task_model; a folder from before it, or HF's, is cls
    value = (data.get("attnlab") or {}).get("pooling", "cls")
    if value not in POOLINGS:
        raise AttnlabError(f"{path}/config.json: pooling must be cls or mean, got {value!r}")
    return value


def task_hf_incompatible(path: str | Path) -> str | None:
    """None if HF transformers runs this fine-tuned checkpoint as attnlab does, else why not."""
    data = _read_config_json(Path(path))
    if _saved_pooling(data, Path(path)) == "mean":
        return "mean pooling (HF's BertForSequenceClassification reads the [CLS] pooler only)"
    return hf_compatible(config_from_hf(data, f"{path}/config.json"))


def _head_key(task: str) -> str:
    return "qa_outputs.weight" if task == "qa" else "classifier.weight"


def task_state_to_hf(model: nn.Module) -> dict[str, Tensor]:
    """HF-named tensors of a task model: 'bert.'-prefixed encoder, then the head as named."""
    state = {f"bert.{k}": v for k, v in bert_state_to_hf(model.bert).items()}
    for name, tensor in model.state_dict().items():
        if not name.startswith("bert."):
            state[name] = tensor.detach().contiguous()
    return state


def save_task_model(
    model: nn.Module,
    out: str | Path,
    tokenizer: Any | None = None,
    id2label: list[str] | None = None,
    extra_files: dict[str, str] | None = None,
    overwrite: bool = False,
) -> None:
    """Write a task model in HF layout (architectures, id2label/label2id, problem_type) to out.

    HF transformers' AutoModelFor* loads the result as is; extra_files (name -> text) are
    written beside it in the same atomic directory swap.
    """
    from attnlab.models.heads import BertForSequenceClassification

    arch = type(model).__name__
    data = config_to_hf(model.config, arch)
    if hasattr(model, "num_labels"):
        names = id2label or [f"LABEL_{i}" for i in range(model.num_labels)]
        if len(names) != model.num_labels:
            raise AttnlabError(f"{len(names)} label names for a head of {model.num_labels}")
        data["id2label"] = {str(i): name for i, name in enumerate(names)}
        data["label2id"] = {name: i for i, name in enumerate(names)}
    if isinstance(model, BertForSequenceClassification):
        data["problem_type"] = model.problem_type
        data["attnlab"]["pooling"] = model.pooling
        if model.pooling != "cls":  # HF would run it with a [CLS] pooler: it must refuse it
            data["model_type"] = "attnlab-bert"
    data["classifier_dropout"] = getattr(model, "classifier_dropout", None)
    with staged_dir(Path(out), overwrite, flag="out") as stage:
        write_text_atomic(stage / "config.json", json.dumps(data, indent=2, ensure_ascii=False))
        state = task_state_to_hf(model)
        write_with_atomic(
            stage / "model.safetensors",
            lambda p: save_file(state, str(p), metadata={"format": "pt"}),
        )
        if tokenizer is not None:
            tokenizer.save(stage)
        for name, text in (extra_files or {}).items():
            write_text_atomic(stage / name, text)
