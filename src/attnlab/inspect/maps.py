"""Attention weights with their tokens, from every model: BERT (and its task models), the
translation Transformer and the decoder-only LM.

Each weight is softmax(QK^T / sqrt(d_k) + bias) of eq. (1) (Vaswani et al. 2017), per layer
and head, as the explicit attention path returns it. ``attention_maps`` runs the model once
on one input and returns ``AttentionMaps``: tensors (layers, heads, queries, keys) of float32,
indexed like HF's ``output_attentions`` stacked over layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.errors import AttnlabError

KINDS = ("encoder", "decoder", "cross")
_NO_LIMIT = 10**9  # tokenize without truncation, to see how long the input really is


@dataclass
class AttentionMaps:
    """Attention weights of one input, each (layers, heads, queries, keys), and their tokens.

    ``tokens`` are the positions of the encoder weights (BERT: ``[CLS] A [SEP] B [SEP]``; the
    translation model: the source + ``<eos>``; the LM: its whole text). ``pair_tokens`` are
    BERT's segment B (``B [SEP]``), the last ``len(pair_tokens)`` of ``tokens``.
    ``target_tokens`` are the decoder's inputs (``<sos> y1 .. ym``), the queries of the
    decoder and cross weights; cross keys are ``tokens``. The LM has decoder weights over
    ``tokens`` only.
    """

    tokens: list[str]
    pair_tokens: list[str] | None = None
    target_tokens: list[str] | None = None
    encoder: Tensor | None = None  # (layers, heads, seq, seq)
    decoder: Tensor | None = None  # (layers, heads, tgt, tgt), causal
    cross: Tensor | None = None  # (layers, heads, tgt, seq)
    # After select(): the model's own layer and head numbers of what is kept, per kind.
    layer_labels: dict[str, list[int]] = field(default_factory=dict)
    head_labels: dict[str, list[int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what a selection left out

    def kinds(self) -> dict[str, Tensor]:
        """The weights this model has, by kind ("encoder", "decoder", "cross")."""
        return {k: w for k in KINDS if (w := getattr(self, k)) is not None}

    def query_tokens(self, kind: str) -> list[str]:
        """The tokens of a kind's queries (rows)."""
        return (
            self.tokens if kind == "encoder" or self.target_tokens is None else self.target_tokens
        )

    def key_tokens(self, kind: str) -> list[str]:
        """The tokens of a kind's keys (columns)."""
        return self.target_tokens if kind == "decoder" and self.target_tokens else self.tokens

    def select(
        self, layers: list[int] | None = None, heads: list[int] | None = None
    ) -> AttentionMaps:
        """The maps of some layers and heads only (None: all), numbered as in the model.

        A layer that no kind has, or a head past the model's, is an error; a kind with fewer
        layers (a shallower encoder) keeps those it has, and one with none of them is left out.
        """
        kinds = self.kinds()
        n_layers = max(w.shape[0] for w in kinds.values())
        n_heads = next(iter(kinds.values())).shape[1]
        check_indices(layers, n_layers, "layers", "layer")
        check_indices(heads, n_heads, "heads", "head")
        chosen, layer_labels, head_labels, notes = {}, {}, {}, list(self.notes)
        for kind, weights in kinds.items():
            keep_layers = [i for i in (layers or range(weights.shape[0])) if i < weights.shape[0]]
            if not keep_layers:
                notes.append(f"The {kind} weights are left out: they have no layer {layers}.")
                continue
            keep_heads = list(heads or range(n_heads))
            chosen[kind] = weights[keep_layers][:, keep_heads]
            layer_labels[kind], head_labels[kind] = keep_layers, keep_heads
        empty = dict.fromkeys(KINDS)
        return replace(self, **{**empty, **chosen}, layer_labels=layer_labels,
                       head_labels=head_labels, notes=notes)  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        """{"tokens", "pair_tokens"?, "target_tokens"?, "attention": {kind: [layer][head][q][k]}}."""
        out: dict[str, Any] = {"tokens": self.tokens}
        if self.pair_tokens is not None:
            out["pair_tokens"] = self.pair_tokens
        if self.target_tokens is not None:
            out["target_tokens"] = self.target_tokens
        out["attention"] = {kind: w.tolist() for kind, w in self.kinds().items()}
        return out


def check_indices(chosen: list[int] | None, size: int, option: str, what: str) -> None:
    """Refuse an empty selection or an index outside 0..size-1, naming option."""
    if chosen is None:
        return
    if not chosen:
        raise AttnlabError(f"{option} selects no {what}", options=(option,))
    bad = [i for i in chosen if not 0 <= i < size]
    if bad:
        raise AttnlabError(
            f"{option} {bad[0]} is out of range: this model numbers them 0-{size - 1}",
            options=(option,),
        )


def _stack(weights: list[Tensor]) -> Tensor:
    """Per-layer (1, heads, q, k) -> (layers, heads, q, k) float32 on the CPU."""
    return torch.stack([w[0] for w in weights]).float().cpu()


def _too_long(n: int, limit: int, what: str) -> AttnlabError:
    return AttnlabError(
        f"{what} has {n} tokens but the model takes at most {limit}: shorten it or pass "
        "truncate=True",
        options=("truncate",),
    )


# --- BERT ---------------------------------------------------------------------------------


def _bert_maps(bert: nn.Module, tokenizer: Any, text: str, pair: str | None, truncate: bool):
    limit = bert.config.max_positions
    encoding = tokenizer.encode(text, pair, max_length=limit if truncate else _NO_LIMIT)
    if len(encoding.ids) > limit:
        raise _too_long(len(encoding.ids), limit, "the input")
    device = next(bert.parameters()).device
    ids = torch.tensor([encoding.ids], device=device)
    types = torch.tensor([encoding.type_ids], device=device)
    with torch.inference_mode():
        out = bert(ids, token_type_ids=types, need_weights=True)
    tokens = tokenizer.convert_ids_to_tokens(encoding.ids)
    pair_tokens = None
    if pair is not None:
        pair_tokens = [t for t, s in zip(tokens, encoding.type_ids, strict=True) if s == 1]
    return AttentionMaps(tokens, pair_tokens, encoder=_stack(out.attentions))


# --- the translation Transformer -------------------------------------------------------------


def _translation_maps(
    model: nn.Module, tokenizer: Any, text: str, target: str | None, truncate: bool
) -> AttentionMaps:
    from attnlab.decode.search import greedy_search

    config = model.config
    limit = config.max_positions
    src = [*tokenizer.encode(text.strip()), tokenizer.eos_id]
    if len(src) > limit:
        if not truncate:
            raise _too_long(len(src), limit, "the source")
        src = [*src[: limit - 1], tokenizer.eos_id]
    device = next(model.parameters()).device
    src_ids = torch.tensor([src], device=device)
    # By default the model's own (greedy) translation.
    tgt = greedy_search(model, src_ids)[0] if target is None else tokenizer.encode(target.strip())
    if len(tgt) + 1 > limit:
        if not truncate:
            raise _too_long(len(tgt) + 1, limit, "the target")
        tgt = tgt[: limit - 1]
    tgt_in = torch.tensor([[config.bos_id, *tgt]], device=device)
    model.eval()
    with torch.inference_mode():
        out = model(src_ids, tgt_in, need_weights=True)
    vocab = tokenizer.backend
    return AttentionMaps(
        tokens=[vocab.id_to_token(i) for i in src],
        target_tokens=[vocab.id_to_token(i) for i in tgt_in[0].tolist()],
        encoder=_stack(out["encoder_attentions"]),
        decoder=_stack(out["decoder_attentions"]),
        cross=_stack(out["cross_attentions"]),
    )


# --- the decoder-only LM ----------------------------------------------------------------------


def _token_text(tokenizer: Any, token_id: int) -> str:
    """A token as text: decoded (byte-level BPE's "Ġthe" reads " the"), or its vocabulary
    entry when it holds part of a character's bytes."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    return tokenizer.backend.id_to_token(token_id) if "\ufffd" in text or not text else text


def _lm_maps(model: nn.Module, tokenizer: Any, text: str, truncate: bool) -> AttentionMaps:
    limit = model.config.max_positions
    ids = tokenizer.encode(text)
    if len(ids) > limit:
        if not truncate:
            raise _too_long(len(ids), limit, "the text")
        ids = ids[:limit]
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model(torch.tensor([ids], device=device), need_weights=True)
    # Causal self-attention: the "decoder" kind, over the text's own tokens.
    return AttentionMaps(
        tokens=[_token_text(tokenizer, i) for i in ids],
        target_tokens=None,
        decoder=_stack(out.attentions),
    )


# --- every model ------------------------------------------------------------------------------


def _bert_of(model: nn.Module) -> nn.Module | None:
    """The BertModel inside a BERT model (itself, or the ``bert`` of a head or pretraining model)."""
    from attnlab.models.bert import BertModel

    if isinstance(model, BertModel):
        return model
    inner = getattr(model, "bert", None)
    return inner if isinstance(inner, BertModel) else None


def attention_maps(
    model: nn.Module,
    tokenizer: Any,
    text: str,
    pair: str | None = None,
    target: str | None = None,
    truncate: bool = False,
) -> AttentionMaps:
    """Every attention weight of model on text (and pair, or target), with the tokens.

    BERT models take ``pair`` (segment B); the translation Transformer takes ``target`` (by
    default its own greedy translation). Input longer than the model takes is an error unless
    ``truncate``. The model runs in eval mode (no dropout) and is left in eval mode.
    """
    from attnlab.models.gpt import GPT
    from attnlab.models.seq2seq import Transformer

    if not isinstance(text, str) or not text.strip():
        raise AttnlabError("text is empty: give a sentence to look at")
    model.eval()
    bert = _bert_of(model)
    if bert is not None:
        if target is not None:
            raise AttnlabError(
                "target is for translation models; BERT takes a pair", options=("target", "pair")
            )
        return _bert_maps(bert, tokenizer, text, pair, truncate)
    if isinstance(model, Transformer):
        if pair is not None:
            raise AttnlabError(
                "pair is for BERT models; a translation model takes a target",
                options=("pair", "target"),
            )
        return _translation_maps(model, tokenizer, text, target, truncate)
    if isinstance(model, GPT):
        if pair is not None or target is not None:
            raise AttnlabError(
                "a language model reads one text: no pair or target", options=("pair", "target")
            )
        return _lm_maps(model, tokenizer, text, truncate)
    raise AttnlabError(
        f"{type(model).__name__} has no attention weights attnlab can show: "
        "expected a BERT, translation or GPT model"
    )


def load_attention_model(path: str | Path) -> tuple[nn.Module, Any]:
    """The model (eval mode) and tokenizer of a BERT (or task), translation or GPT directory."""
    import json

    root = Path(path)
    if not root.is_dir():
        what = "is a file" if root.exists() else "does not exist"
        raise AttnlabError(f"model directory {root} {what}: pass a model directory")
    config_file = root / "config.json"
    if not config_file.is_file():
        raise AttnlabError(
            f"no config.json in {root}: not a model directory with attention weights "
            "(a BERT checkpoint, a translation model or a GPT)"
        )
    try:
        kind = json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
    except (ValueError, AttributeError, RecursionError, UnicodeDecodeError):
        raise AttnlabError(f"{config_file} is not a JSON object") from None
    from attnlab.interop.gpt2 import is_gpt_folder
    from attnlab.tasks.translate import MODEL_TYPE, load_translation_model

    if kind == MODEL_TYPE:
        return load_translation_model(root)
    if is_gpt_folder(root):
        from attnlab.tasks.lm import load_lm

        return load_lm(root)
    from attnlab.interop.hf import load_bert
    from attnlab.text.tokenizer import BertTokenizer

    model = load_bert(root)  # a task checkpoint's encoder: its head holds no attention
    return model, BertTokenizer.from_dir(root)
