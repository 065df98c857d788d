"""Transformer blocks (Vaswani et al. 2017, sections 3.1 and 3.3).

- Position-wise feed-forward, eq. (2): ``FFN(x) = act(x W1 + b1) W2 + b2``.
- Residual + LayerNorm in both arrangements: post-LN ``LN(x + Sublayer(x))`` (the paper, BERT)
  and pre-LN ``x + Sublayer(LN(x))`` (GPT-2 and later, analysed by Xiong et al. 2020; trains
  without warm-up tricks, and its stack ends with one more LayerNorm).
- Encoder layer: self-attention + FFN. Decoder layer: masked self-attention + cross-attention
  over the encoder output + FFN. Stacks of N layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.errors import AttnlabError
from attnlab.nn.attention import KVCache, MultiHeadAttention, gather_rows
from attnlab.nn.dropout import Dropout
from attnlab.nn.linear import Linear
from attnlab.nn.packed import PackedLinear

ACTIVATION_FUNCTIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,  # exact (erf) GELU, as BERT and HF's "gelu"
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,  # the Transformer paper
}


class FeedForward(nn.Module):
    """FFN(x) = act(x W1 + b1) W2 + b2, applied to each position alike."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "relu") -> None:
        super().__init__()
        self.fc1 = Linear(d_model, d_ff)
        self.fc2 = Linear(d_ff, d_model)
        self.act = ACTIVATION_FUNCTIONS[activation]

    def forward(self, x: Tensor) -> Tensor:
        """(batch, seq, d_model) -> (batch, seq, d_model)."""
        packed = self.fc1.__dict__.get("forward")  # set inside packed_linears (inference)
        if self.act is F.relu and isinstance(packed, PackedLinear):
            return self.fc2(packed(x, relu=True))  # ReLU applied as the product is written
        return self.fc2(self.act(self.fc1(x)))


def add_and_norm(
    x: Tensor, h: Tensor, dropout: Dropout, norm: nn.LayerNorm, pre_norm: bool
) -> Tensor:
    """The residual connection around a sublayer's output h: x + dropout(h), then LN if post-LN.

    (Pre-LN normalised the sublayer's input instead, so the sum is left as it is.)
    """
    x = dropout.residual(x, h)
    return x if pre_norm else norm(x)


@dataclass(frozen=True)
class KeptRows:
    """The positions whose outputs a caller needs, e.g. BERT's masked tokens and [CLS].

    ``index`` (batch, q) lists each sequence's kept positions in ascending order, padded with
    other positions up to q, the largest count; ``valid`` (batch, q) marks the kept entries,
    or is None when every sequence keeps q. ``flatten`` turns (batch, q, d) into the kept
    rows (count, d) in the row-major order of the mask given to ``from_mask``, i.e.
    ``full_output[mask]``.
    """

    index: Tensor
    valid: Tensor | None

    @classmethod
    def from_mask(cls, keep: Tensor) -> KeptRows:
        """KeptRows of a boolean (batch, seq) mask that keeps at least one position."""
        counts = keep.sum(1)
        q = int(counts.max()) if keep.numel() else 0
        if q == 0:
            raise AttnlabError("keep selects no position: pass None to compute them all")
        # A stable sort of "not kept" puts each row's kept positions first, in order.
        index = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :q]
        if bool((counts == q).all()):
            return cls(index, None)
        return cls(index, torch.arange(q, device=keep.device) < counts[:, None])

    def flatten(self, x: Tensor) -> Tensor:
        """(batch, q, d) -> (count, d): the valid rows, sequence by sequence."""
        return x.flatten(0, 1) if self.valid is None else x[self.valid]


class EncoderLayer(nn.Module):
    """Self-attention then feed-forward, each wrapped in residual + LayerNorm (post or pre)."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float = 0.1,
        attention_dropout: float = 0.0,
        activation: str = "relu",
        norm_position: str = "post",
        layer_norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.pre_norm = norm_position == "pre"
        self.self_attn = MultiHeadAttention(d_model, n_heads, attention_dropout)
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.ffn = FeedForward(d_model, d_ff, activation)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.dropout = Dropout(dropout)

    def forward(
        self,
        x: Tensor,
        bias: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        need_weights: bool = False,
        rows: KeptRows | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """x (batch, seq, d_model) -> (same shape, attention weights (batch, heads, seq, seq) or None).

        With ``rows`` only those positions are computed (they still attend to every position)
        and the output is (number of kept positions, d_model), as ``KeptRows.flatten`` gives.
        """
        h = self.norm1(x) if self.pre_norm else x
        h, weights, _ = self.self_attn(
            h, bias=bias, rope=rope, need_weights=need_weights,
            query_rows=None if rows is None else rows.index,
        )  # fmt: skip
        if rows is not None:
            x, h = rows.flatten(gather_rows(x, rows.index)), rows.flatten(h)
        x = add_and_norm(x, h, self.dropout, self.norm1, self.pre_norm)
        h = self.ffn(self.norm2(x) if self.pre_norm else x)
        return add_and_norm(x, h, self.dropout, self.norm2, self.pre_norm), weights


class DecoderLayer(nn.Module):
    """Masked self-attention, cross-attention to the encoder output, feed-forward."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float = 0.1,
        attention_dropout: float = 0.0,
        activation: str = "relu",
        norm_position: str = "post",
        layer_norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.pre_norm = norm_position == "pre"
        self.self_attn = MultiHeadAttention(d_model, n_heads, attention_dropout)
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.cross_attn = MultiHeadAttention(d_model, n_heads, attention_dropout, cross=True)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.ffn = FeedForward(d_model, d_ff, activation)
        self.norm3 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.dropout = Dropout(dropout)

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None,
        self_bias: Tensor | None = None,
        memory_bias: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        cache: KVCache | None = None,
        index: int = 0,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """x (batch, tgt, d_model), memory (batch, src, d_model) -> (x, self weights, cross weights).

        With a cache, x holds only the new positions; layer ``index``'s slots are read and updated.
        """
        past = cache.self_kv[index] if cache is not None else None  # appended to in place
        h = self.norm1(x) if self.pre_norm else x
        h, self_w, _ = self.self_attn(
            h, bias=self_bias, causal=True, rope=rope, past=past, need_weights=need_weights
        )
        x = add_and_norm(x, h, self.dropout, self.norm1, self.pre_norm)

        past = cache.cross_kv[index] if cache is not None else None
        h = self.norm2(x) if self.pre_norm else x
        h, cross_w, kv = self.cross_attn(
            h, memory=memory, bias=memory_bias, past=past, need_weights=need_weights
        )
        if cache is not None and past is None:
            # Stored contiguous: per head, the (src, d_head) keys are one block, which every
            # later step's matmul then reads in place instead of copying (kv_proj's output
            # interleaves heads).
            cache.cross_kv[index] = (kv[0].contiguous(), kv[1].contiguous())
        x = add_and_norm(x, h, self.dropout, self.norm2, self.pre_norm)

        h = self.ffn(self.norm3(x) if self.pre_norm else x)
        return add_and_norm(x, h, self.dropout, self.norm3, self.pre_norm), self_w, cross_w


class Encoder(nn.Module):
    """A stack of N encoder layers (plus a final LayerNorm in the pre-LN arrangement).

    share_layers=True is ALBERT's cross-layer sharing: one layer's weights applied N times.
    """

    def __init__(
        self,
        n_layers: int,
        norm_position: str = "post",
        share_layers: bool = False,
        **layer_args: object,
    ) -> None:
        super().__init__()
        n_distinct = 1 if share_layers else n_layers
        self.repeats = n_layers // n_distinct
        self.layers = nn.ModuleList(
            EncoderLayer(norm_position=norm_position, **layer_args) for _ in range(n_distinct)
        )
        d_model, eps = layer_args["d_model"], layer_args.get("layer_norm_eps", 1e-5)
        self.final_norm = nn.LayerNorm(d_model, eps=eps) if norm_position == "pre" else None

    def forward(
        self,
        x: Tensor,
        bias: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        need_weights: bool = False,
        output_hidden_states: bool = False,
        keep: Tensor | None = None,
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """Run every layer; returns (last hidden state, hidden states per layer, attention weights per layer).

        The bias (padding and positional) is built once by the caller and shared by all layers.
        ``keep`` (batch, seq, bool) asks for the final states of those positions only: the
        last layer then computes just them and the last hidden state is ``full[keep]``,
        (count, d_model). The layers below still run at every position, because the kept
        positions attend to all of them.
        """
        rows = KeptRows.from_mask(keep) if keep is not None else None
        hidden, weights = [], []
        stack = [layer for layer in self.layers for _ in range(self.repeats)]
        for i, layer in enumerate(stack):
            if output_hidden_states:
                hidden.append(x)
            last_rows = rows if i == len(stack) - 1 else None
            x, w = layer(x, bias=bias, rope=rope, need_weights=need_weights, rows=last_rows)
            if need_weights:
                weights.append(w)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if output_hidden_states:
            hidden.append(x)
        return x, hidden, weights


class Decoder(nn.Module):
    """A stack of N decoder layers (plus a final LayerNorm in the pre-LN arrangement)."""

    def __init__(self, n_layers: int, norm_position: str = "post", **layer_args: object) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            DecoderLayer(norm_position=norm_position, **layer_args) for _ in range(n_layers)
        )
        d_model, eps = layer_args["d_model"], layer_args.get("layer_norm_eps", 1e-5)
        self.final_norm = nn.LayerNorm(d_model, eps=eps) if norm_position == "pre" else None

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None,
        self_bias: Tensor | None = None,
        memory_bias: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        cache: KVCache | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """Run every layer; returns (output, self-attention weights, cross-attention weights)."""
        self_ws, cross_ws = [], []
        for i, layer in enumerate(self.layers):
            x, sw, cw = layer(
                x, memory, self_bias, memory_bias, rope, cache, i, need_weights=need_weights
            )
            if need_weights:
                self_ws.append(sw)
                cross_ws.append(cw)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x, self_ws, cross_ws
