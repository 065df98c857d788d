"""GPT model folders, both ways: HF GPT-2 checkpoints <-> attnlab's GPT.

A folder holds ``config.json`` and ``model.safetensors`` (or a legacy ``pytorch_model.bin``,
read with ``weights_only=True``, or the shards an ``.index.json`` names). Two kinds:

- ``model_type: "gpt2"``: HF ``GPT2LMHeadModel``'s layout, read from ``save_pretrained``
  folders and written for every config GPT-2 can express (learned positions, an activation
  HF knows), so an exported model loads in transformers unchanged;
- ``model_type: "attnlab-gpt"``: the config as attnlab's fields under ``"attnlab"`` and the
  weights under attnlab's names, for models GPT-2 cannot run (RoPE, ALiBi, ... positions).

The only translation is of names and of HF's ``Conv1D``, which stores a linear map as
(in, out), the transpose of ``nn.Linear``'s (out, in) weight.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import Tensor

from attnlab.config import GPTConfig
from attnlab.errors import AttnlabError
from attnlab.interop.hf import HF_ACTIVATIONS, all_finite, read_weights
from attnlab.io import staged_dir, write_text_atomic, write_with_atomic
from attnlab.models.gpt import GPT

HF_TYPE, ATTNLAB_TYPE = "gpt2", "attnlab-gpt"
GPT2_ACTIVATIONS = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}  # attnlab -> HF
# attnlab config field <- HF GPT2Config field
GPT2_FIELDS = {
    "vocab_size": "vocab_size",
    "d_model": "n_embd",
    "n_layers": "n_layer",
    "n_heads": "n_head",
    "max_positions": "n_positions",
    "dropout": "resid_pdrop",
    "attention_dropout": "attn_pdrop",
    "layer_norm_eps": "layer_norm_epsilon",
    "initializer_range": "initializer_range",
}
# HF name inside block i (after "h.i.") -> attnlab name inside layers.i, and whether HF's is a
# Conv1D weight (stored transposed)
BLOCK_NAMES = {
    "ln_1.weight": ("norm1.weight", False),
    "ln_1.bias": ("norm1.bias", False),
    "attn.c_attn.weight": ("self_attn.qkv_proj.weight", True),
    "attn.c_attn.bias": ("self_attn.qkv_proj.bias", False),
    "attn.c_proj.weight": ("self_attn.out_proj.weight", True),
    "attn.c_proj.bias": ("self_attn.out_proj.bias", False),
    "ln_2.weight": ("norm2.weight", False),
    "ln_2.bias": ("norm2.bias", False),
    "mlp.c_fc.weight": ("ffn.fc1.weight", True),
    "mlp.c_fc.bias": ("ffn.fc1.bias", False),
    "mlp.c_proj.weight": ("ffn.fc2.weight", True),
    "mlp.c_proj.bias": ("ffn.fc2.bias", False),
}
TOP_NAMES = {
    "wte.weight": "embed.weight",
    "wpe.weight": "positions.weight",
    "ln_f.weight": "final_norm.weight",
    "ln_f.bias": "final_norm.bias",
}


# ---------------------------------------------------------------------------- config


def config_from_gpt2(data: dict[str, Any], source: str = "config.json") -> GPTConfig:
    """GPTConfig from an HF GPT2Config dict; settings attnlab does not run are refused."""
    refused = {
        "add_cross_attention": (True, "cross-attention layers (an encoder-decoder)"),
        "scale_attn_weights": (False, "unscaled attention scores"),
        "scale_attn_by_inverse_layer_idx": (True, "scores scaled by 1 / layer index"),
    }
    for key, (bad, what) in refused.items():
        if data.get(key) is bad:
            raise AttnlabError(f"{source}: {key}={bad}: attnlab's GPT has no {what}")
    activation = data.get("activation_function", "gelu_new")
    if activation not in HF_ACTIVATIONS:
        raise AttnlabError(
            f"{source}: activation_function {activation!r} is not supported "
            f"(choose from {', '.join(HF_ACTIVATIONS)})"
        )
    defaults = GPTConfig()  # HF's GPT2Config defaults are GPT-2 small's, as these
    fields = {
        ours: data[theirs] if data.get(theirs) is not None else getattr(defaults, ours)
        for ours, theirs in GPT2_FIELDS.items()
    }
    n_inner, d_model = data.get("n_inner"), fields["d_model"]
    fields["d_ff"] = n_inner if n_inner is not None else 4 * d_model  # HF: None is 4 * n_embd
    fields["activation"] = HF_ACTIVATIONS[activation]
    fields["tie_embeddings"] = data.get("tie_word_embeddings", True)
    try:
        return GPTConfig(**fields)
    except TypeError as err:
        raise AttnlabError(f"{source}: {err}") from None


def gpt2_incompatible(config: GPTConfig) -> str | None:
    """Why HF's GPT-2 cannot run this config, or None when it can."""
    if config.position_encoding != "learned":
        return f"position_encoding {config.position_encoding!r} (GPT-2 has learned positions only)"
    if config.activation not in GPT2_ACTIVATIONS:
        return f"activation {config.activation!r}"
    return None


def config_to_gpt2(config: GPTConfig, eos_id: int | None = None) -> dict[str, Any]:
    """HF GPT2Config fields (config.json) for a config GPT-2 can run."""
    data: dict[str, Any] = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": HF_TYPE,
        **{theirs: getattr(config, ours) for ours, theirs in GPT2_FIELDS.items()},
        "n_inner": config.d_ff,
        "n_ctx": config.max_positions,
        "embd_pdrop": config.dropout,
        "activation_function": GPT2_ACTIVATIONS[config.activation],
        "tie_word_embeddings": config.tie_embeddings,
        "scale_attn_weights": True,
        "use_cache": True,
    }
    if eos_id is not None or config.vocab_size <= 50256:  # HF's default ids are GPT-2's 50256
        data["bos_token_id"] = data["eos_token_id"] = eos_id
    return data


def _read_config_json(path: Path) -> dict[str, Any]:
    file = path / "config.json"
    if not path.is_dir():
        raise AttnlabError(f"model folder {path} not found")
    if not file.is_file():
        raise AttnlabError(f"config.json not found in {path}: is this a model folder?")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as err:
        raise AttnlabError(f"{file}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise AttnlabError(f"{file}: expected a JSON object")
    return data


def is_gpt_folder(path: str | Path) -> bool:
    """Whether path is a GPT model folder (HF GPT-2's or attnlab's), by its config.json."""
    try:
        data = _read_config_json(Path(path))
    except AttnlabError:
        return False
    return data.get("model_type") in (HF_TYPE, ATTNLAB_TYPE)


def read_gpt_config(path: str | Path) -> GPTConfig:
    """The GPTConfig of a GPT folder; a clear error for any other folder (a BERT, say)."""
    path = Path(path)
    data = _read_config_json(path)
    kind = data.get("model_type")
    if kind == HF_TYPE:
        return config_from_gpt2(data, str(path / "config.json"))
    if kind == ATTNLAB_TYPE:
        if not isinstance(data.get("attnlab"), dict):
            raise AttnlabError(f'{path / "config.json"}: no "attnlab" config object')
        return GPTConfig.from_dict(data["attnlab"])
    raise AttnlabError(
        f"{path} is not a GPT language model (config.json model_type {kind!r}): give a folder "
        "written by attnlab's GPT or HF GPT2LMHeadModel.save_pretrained"
    )


# ---------------------------------------------------------------------------- weights


def gpt_state_from_gpt2(hf: dict[str, Tensor], config: GPTConfig) -> dict[str, Tensor]:
    """attnlab GPT state dict from HF GPT-2 tensors (with or without the ``transformer.`` prefix)."""
    state = {}
    for name, tensor in hf.items():
        plain = name.removeprefix("transformer.")
        if plain in TOP_NAMES:
            state[TOP_NAMES[plain]] = tensor
        elif plain == "lm_head.weight":
            if not config.tie_embeddings:
                state["lm_head.weight"] = tensor
        elif plain.startswith("h."):
            _, index, rest = plain.split(".", 2)
            if rest in BLOCK_NAMES:
                ours, transposed = BLOCK_NAMES[rest]
                state[f"layers.{index}.{ours}"] = tensor.t() if transposed else tensor
            # else: HF's saved causal-mask buffers (attn.bias, attn.masked_bias), not weights
    return state


def gpt_state_to_gpt2(model: GPT) -> dict[str, Tensor]:
    """HF GPT2LMHeadModel tensors (contiguous, as safetensors needs) from an attnlab GPT."""
    ours_to_hf = {ours: (f"transformer.{hf}", False) for hf, ours in TOP_NAMES.items()}
    for i in range(model.config.n_layers):
        for hf, (ours, transposed) in BLOCK_NAMES.items():
            ours_to_hf[f"layers.{i}.{ours}"] = (f"transformer.h.{i}.{hf}", transposed)
    ours_to_hf["lm_head.weight"] = ("lm_head.weight", False)
    out = {}
    for name, tensor in model.state_dict().items():
        hf, transposed = ours_to_hf[name]
        out[hf] = (tensor.t() if transposed else tensor).detach().contiguous()
    return out


def _load_checked(model: GPT, state: dict[str, Tensor], path: Path) -> None:
    """Load state into model after checking names, shapes and values, with one-line errors."""
    expected = model.state_dict()
    missing = [name for name in expected if name not in state]
    if missing:
        raise AttnlabError(f"the weights in {path} lack {', '.join(missing[:3])}")
    for name, tensor in state.items():
        if name not in expected:
            raise AttnlabError(
                f"the weights in {path} hold {name}, which the config has no place for"
            )
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise AttnlabError(
                f"weight {name} in {path} has shape {tuple(tensor.shape)}, "
                f"config.json implies {tuple(expected[name].shape)}"
            )
        if not tensor.is_floating_point() or not all_finite(tensor):
            raise AttnlabError(f"weight {name} in {path} is not finite floating-point numbers")
    model.load_state_dict(state)


# ---------------------------------------------------------------------------- folders


def load_gpt(path: str | Path) -> GPT:
    """The GPT (eval mode, fp32) of a folder written by HF GPT2LMHeadModel or attnlab."""
    path = Path(path)
    config = read_gpt_config(path)
    weights = read_weights(path)
    if _read_config_json(path).get("model_type") == HF_TYPE:
        weights = gpt_state_from_gpt2(weights, config)
    model = GPT(config)
    _load_checked(model, weights, path)
    return model.eval()


def save_gpt(
    model: GPT,
    out: str | Path,
    tokenizer: Any | None = None,
    overwrite: bool = False,
    require_hf: bool = False,
    eos_id: int | None = None,
) -> None:
    """Write model (+ tokenizer, anything with ``save(folder)``) to the folder out, atomically.

    GPT-2's layout where HF can run the config (so ``GPT2LMHeadModel.from_pretrained`` loads
    it), else attnlab's; require_hf refuses the latter. eos_id goes to config.json's
    bos/eos_token_id. An existing non-empty out is refused unless overwrite.
    """
    reason = gpt2_incompatible(model.config)
    if require_hf and reason:
        raise AttnlabError(f"cannot export to HF format: {reason}")
    if reason:
        config: dict[str, Any] = {"model_type": ATTNLAB_TYPE, "attnlab": model.config.to_dict()}
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    else:
        config, state = config_to_gpt2(model.config, eos_id), gpt_state_to_gpt2(model)
    with staged_dir(Path(out), overwrite, flag="out") as stage:
        write_text_atomic(stage / "config.json", json.dumps(config, indent=2))
        write_with_atomic(
            stage / "model.safetensors",
            lambda p: save_file(state, str(p), metadata={"format": "pt"}),
        )
        if tokenizer is not None:
            tokenizer.save(stage)
