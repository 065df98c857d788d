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

import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.nn.attention import Cache, MultiHeadAttention, self_attention

ACTIVATION_FUNCTIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,  # exact (erf) GELU, as BERT and HF's "gelu"
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,  # the Transformer paper
}


class FeedForward(nn.Module):
    """FFN(x) = act(x W1 + b1) W2 + b2, eq. (2), applied to each position alike."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "relu") -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)
        self.act = ACTIVATION_FUNCTIONS[activation]

    def forward(self, x: Tensor) -> Tensor:
        """(batch, seq, d_model) -> (batch, seq, d_model)."""
        return self.fc2(self.act(self.fc1(x)))


class Residual(nn.Module):
    """The residual connection around a sublayer, with dropout and LayerNorm (section 5.4).

    Post-LN (the paper, BERT): ``LayerNorm(x + Dropout(Sublayer(x)))``; pre-LN:
    ``x + Dropout(Sublayer(LayerNorm(x)))``. A layer calls ``sublayer_input(x)``, runs the
    sublayer on it, and passes its output h to ``forward(x, h)``.

    The LayerNorm belongs to the layer (``norm1``, ``norm2``, ... in its state dict, as in
    checkpoints and the HF mapping); this module holds a reference to it, not a copy.
    """

    def __init__(self, norm: nn.LayerNorm, dropout: float, pre_norm: bool) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self._norm = (norm,)  # in a tuple: not registered a second time as a submodule
        self.pre_norm = pre_norm

    @property
    def norm(self) -> nn.LayerNorm:
        """The layer's LayerNorm for this sublayer."""
        return self._norm[0]

    def sublayer_input(self, x: Tensor) -> Tensor:
        """What the sublayer reads: LayerNorm(x) in pre-LN, x itself in post-LN."""
        return self.norm(x) if self.pre_norm else x

    def add(self, x: Tensor, h: Tensor) -> Tensor:
        """x + Dropout(h): the residual sum itself."""
        return x + self.dropout(h)

    def forward(self, x: Tensor, h: Tensor) -> Tensor:
        """x (batch, seq, d_model) and the sublayer's output h (same shape) -> the layer's output."""
        x = self.add(x, h)
        return x if self.pre_norm else self.norm(x)


class EncoderLayer(nn.Module):
    """Self-attention then feed-forward, each inside a residual connection (figure 1, left)."""

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
        shaw_max_distance: int | None = None,
        shaw_values: bool = True,
    ) -> None:
        super().__init__()
        self.pre_norm = pre_norm = norm_position == "pre"
        # Shaw et al.'s relative positions (a clipping distance given) live in self-attention.
        self.self_attn = self_attention(
            d_model, n_heads, attention_dropout, shaw_max_distance, shaw_values
        )
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.ffn = FeedForward(d_model, d_ff, activation)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.attn_residual = Residual(self.norm1, dropout, pre_norm)
        self.ffn_residual = Residual(self.norm2, dropout, pre_norm)

    def forward(
        self,
        x: Tensor,
        bias: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """x (batch, seq, d_model) -> (same shape, attention weights (batch, heads, seq, seq) or None)."""
        h = self.attn_residual.sublayer_input(x)
        h, weights = self.self_attn(h, bias=bias, rope=rope, need_weights=need_weights)
        x = self.attn_residual(x, h)
        return self.ffn_residual(x, self.ffn(self.ffn_residual.sublayer_input(x))), weights


class DecoderLayer(nn.Module):
    """Masked self-attention, cross-attention to the encoder output, feed-forward (figure 1, right)."""

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
        shaw_max_distance: int | None = None,
        shaw_values: bool = True,
    ) -> None:
        super().__init__()
        self.pre_norm = pre_norm = norm_position == "pre"
        # Shaw et al.'s relative positions (a clipping distance given) live in self-attention.
        self.self_attn = self_attention(
            d_model, n_heads, attention_dropout, shaw_max_distance, shaw_values
        )
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.cross_attn = MultiHeadAttention(d_model, n_heads, attention_dropout, cross=True)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.ffn = FeedForward(d_model, d_ff, activation)
        self.norm3 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.self_attn_residual = Residual(self.norm1, dropout, pre_norm)
        self.cross_attn_residual = Residual(self.norm2, dropout, pre_norm)
        self.ffn_residual = Residual(self.norm3, dropout, pre_norm)

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None,
        self_bias: Tensor | None = None,
        memory_bias: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        cache: Cache | None = None,
        index: int = 0,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """x (batch, tgt, d_model), memory (batch, src, d_model) -> (x, self weights, cross weights).

        With a cache, x holds only the new positions; layer ``index``'s slots are read and updated.
        """
        # Masked self-attention: each position sees itself and the positions before it.
        h = self.self_attn_residual.sublayer_input(x)
        h, self_w = self.self_attn(
            h, bias=self_bias, causal=True, rope=rope, cache=cache, layer=index,
            need_weights=need_weights,
        )  # fmt: skip
        x = self.self_attn_residual(x, h)
        # Cross-attention: queries from the decoder, keys and values from the encoder output.
        h = self.cross_attn_residual.sublayer_input(x)
        h, cross_w = self.cross_attn(
            h, memory, bias=memory_bias, cache=cache, layer=index, need_weights=need_weights
        )
        x = self.cross_attn_residual(x, h)
        h = self.ffn(self.ffn_residual.sublayer_input(x))
        return self.ffn_residual(x, h), self_w, cross_w


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

    def stack(self) -> list[EncoderLayer]:
        """The layers in the order they run (a shared layer once per use)."""
        return [layer for layer in self.layers for _ in range(self.repeats)]

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
        last hidden state is then ``full[keep]``, (count, d_model).
        """
        hidden, weights = [], []
        for layer in self.stack():
            if output_hidden_states:
                hidden.append(x)
            x, w = layer(x, bias=bias, rope=rope, need_weights=need_weights)
            if need_weights:
                weights.append(w)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if output_hidden_states:
            hidden.append(x)
        return (x if keep is None else x[keep]), hidden, weights


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
        cache: Cache | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """Run every layer; returns (output, self-attention weights, cross-attention weights).

        With a cache, x (batch, new, d_model) holds only the positions after ``cache.length``.
        """
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
