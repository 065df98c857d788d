"""Fast twins of attention and the encoder stack (the plain ones: attnlab.nn.attention, nn.blocks).

Each twin computes what its plain class computes and falls back to it for inputs it does not
serve (tensors off the CPU, code traced by ``torch.compile``):

- ``FastMultiHeadAttention``: on CPU, the explicit formula where it beats the fused kernel (a
  decoding step's few queries; attention dropout, with the cheaper mask of fast dropout);
  training with attention dropout as one autograd function from the projections to the
  merged heads (``_DropoutAttention``); a sentence's beams sharing one row of cross-attention
  keys without copies (``_to_groups``); and queries at chosen positions only (``query_rows``).
- ``FastEncoderLayer`` and ``FastEncoder`` (training): with BertModel's ``keep``, the last
  layer computes only the kept positions (``KeptRows``), which still attend to every position.
- ``UnpaddedEncoder``: in evaluation with ``keep``, no layer computes padding. The
  position-wise parts (projections, feed-forward, LayerNorm) run on the real rows only, packed
  one after another; attention alone sees them in the padded (batch, seq) layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx

from attnlab.errors import AttnlabError
from attnlab.fast.dropout import dropout, dropout_scale, has_keep_mask, keep_mask
from attnlab.fast.linear import linear, matmul
from attnlab.nn.attention import (
    Cache,
    MultiHeadAttention,
    apply_rotary,
    scaled_dot_product_attention,
    with_causal_bias,
)
from attnlab.nn.blocks import Encoder, EncoderLayer

# --- eq. (1) on CPU ---------------------------------------------------------------------------


def cpu_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None = None,
    causal: bool = False,
    dropout_p: float = 0.0,
    need_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``scaled_dot_product_attention`` for CPU tensors, by the explicit formula where it pays.

    A decoding step has a few queries per row (one, or one per beam where beams share their
    cross-attention keys): two plain products cost less there than the fused kernel's tiling.
    With dropout, the fused kernel falls back to its unfused math path and a per-element
    bernoulli mask; the explicit path with fast dropout's cheaper mask does the same work.
    """
    q_len, k_len = q.shape[-2], k.shape[-2]
    explicit = need_weights or dropout_p > 0.0 or q_len <= 8
    if not explicit:
        return scaled_dot_product_attention(q, k, v, bias, causal, dropout_p)
    if causal and q_len > 1:  # one query at the newest position sees every key
        bias = with_causal_bias(bias, q_len, k_len, q.dtype, q.device)
    # Scale q (seq x d_head) rather than the scores (seq x seq); add the bias in place, which
    # autograd allows because a product does not keep its output for the backward pass.
    scores = matmul(q * (1.0 / math.sqrt(q.shape[-1])), k.transpose(-2, -1))
    if bias is not None:
        scores.add_(bias)
    weights = torch.softmax(scores, dim=-1)
    out = matmul(dropout(weights, dropout_p), v)
    return out, (weights if need_weights else None)


class _DropoutAttention(torch.autograd.Function):
    """Training attention on CPU with dropout on the weights, from projections to merged heads.

    Computes what the explicit path computes, ``softmax(q k^T / sqrt(d) + bias)`` with
    dropout, times v, but takes the projections' outputs as they come, (batch, len, n d_model)
    with heads side by side, and returns heads concatenated, (batch, q_len, d_model): autograd
    then keeps no per-head views, whose backward pass stacks and copies the gradients of q, k
    and v twice over. The scale sqrt(d) is applied while q is copied to one block per head, the
    dropout scale to the (q_len, d_head) products instead of the (q_len, k_len) weights, and
    the dropped weights are the softmax times a 1-byte keep mask (fast dropout's, so the same
    seed drops the same weights as the explicit path).
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        q_in: Tensor,
        kv_in: Tensor | None,
        heads: int,
        bias: Tensor | None,
        p: float,
    ) -> Tensor:
        # q_in: (batch, q_len, 3 d_model) holding q, k, v (self-attention, kv_in None), or
        # (batch, q_len, d_model) with kv_in (batch, k_len, 2 d_model) holding k, v.
        fused = kv_in is None
        b, q_len = q_in.shape[:2]
        d_model = q_in.shape[-1] // 3 if fused else q_in.shape[-1]
        kv = q_in[..., d_model:] if fused else kv_in
        k_len, d = kv.shape[1], d_model // heads
        q = q_in[..., :d_model].view(b, q_len, heads, d).transpose(1, 2)
        k, v = kv.view(b, k_len, 2, heads, d).permute(2, 0, 3, 1, 4)
        scaled_q = q.new_empty(b * heads, q_len, d)
        torch.mul(q, 1.0 / math.sqrt(d), out=scaled_q.view(b, heads, q_len, d))
        k = k.reshape(b * heads, k_len, d)
        v = v.reshape(b * heads, k_len, d)
        scores = torch.bmm(scaled_q, k.transpose(1, 2))
        if bias is not None:
            scores.view(b, heads, q_len, k_len).add_(bias)
        weights = torch.softmax(scores, dim=-1)
        keep = keep_mask(weights.shape, p, weights.device)
        kept = torch.mul(weights, keep)
        keep_scale = dropout_scale(p)
        out = torch.bmm(kept, v).mul_(keep_scale)
        ctx.save_for_backward(scaled_q, k, v, weights, keep, kept)
        ctx.sizes, ctx.keep_scale, ctx.fused = (b, heads, q_len, k_len, d), keep_scale, fused
        ctx.bias_shape = None if bias is None else bias.shape
        return out.view(b, heads, q_len, d).transpose(1, 2).reshape(b, q_len, d_model)

    @staticmethod
    def backward(
        ctx: FunctionCtx, grad: Tensor
    ) -> tuple[Tensor, Tensor | None, None, Tensor | None, None]:
        scaled_q, k, v, weights, keep, kept = ctx.saved_tensors
        b, heads, q_len, k_len, d = ctx.sizes
        grad = grad.view(b, q_len, heads, d).transpose(1, 2).reshape(b * heads, q_len, d)
        grad_v = torch.bmm(kept.transpose(1, 2), grad).mul_(ctx.keep_scale)
        grad_weights = torch.bmm(grad, v.transpose(1, 2)).mul_(keep)  # keep_scale comes below
        grad_scores = torch._softmax_backward_data(grad_weights, weights, -1, weights.dtype)
        grad_q = torch.bmm(grad_scores, k).mul_(ctx.keep_scale / math.sqrt(d))
        grad_k = torch.bmm(grad_scores.transpose(1, 2), scaled_q).mul_(ctx.keep_scale)
        grad_bias = None
        if ctx.needs_input_grad[3]:  # a learned bias (T5's relative positions) trains too
            scores_grad = grad_scores.view(b, heads, q_len, k_len) * ctx.keep_scale
            grad_bias = scores_grad.sum_to_size(ctx.bias_shape)

        # Into the layout the projections wrote: (batch, len, [q k v], heads, d_head).
        if ctx.fused:
            grad_q_in = grad_kv_in = grad_q.new_empty(b, q_len, 3, heads, d)
            parts = grad_q_in.unbind(2)
        else:
            grad_q_in = grad_q.new_empty(b, q_len, 1, heads, d)
            grad_kv_in = grad_k.new_empty(b, k_len, 2, heads, d)
            parts = (grad_q_in[:, :, 0], *grad_kv_in.unbind(2))
        for part, g in zip(parts, (grad_q, grad_k, grad_v), strict=True):
            part.copy_(g.view(b, heads, -1, d).transpose(1, 2))
        grad_kv_in = None if ctx.fused else grad_kv_in.flatten(2)
        return grad_q_in.flatten(2), grad_kv_in, None, grad_bias, None


# --- queries at some positions only -------------------------------------------------------------


def gather_rows(x: Tensor, rows: Tensor) -> Tensor:
    """x (batch, seq, d) at the positions rows (batch, q) -> (batch, q, d)."""
    return x.gather(1, rows.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def _bias_rows(bias: Tensor | None, rows: Tensor, batch: int) -> Tensor | None:
    """A bias's rows for the queries at positions rows (batch, q); a bias shared by all queries as it is."""
    if bias is None or bias.shape[-2] == 1:
        return bias
    bias = bias.expand(batch, -1, -1, -1)
    return bias.gather(2, rows[:, None, :, None].expand(-1, bias.shape[1], -1, bias.shape[-1]))


def _causal_bias_rows(bias: Tensor | None, rows: Tensor, k_len: int, dtype: torch.dtype) -> Tensor:
    """bias plus a large negative where the query at position rows[b, i] would see a later key."""
    future = torch.arange(k_len, device=rows.device) > rows[:, None, :, None]
    causal_bias = torch.zeros(future.shape, dtype=dtype, device=rows.device)
    causal_bias.masked_fill_(future, torch.finfo(dtype).min)
    return causal_bias if bias is None else bias + causal_bias


# --- a sentence's beams sharing its cross-attention keys ----------------------------------------


def _group_size(q_rows: int, kv_rows: int, bias: Tensor | None) -> int:
    """How many consecutive query rows share each key/value row (cross-attention in beam search)."""
    if q_rows == kv_rows:
        return 1
    if kv_rows == 0 or q_rows % kv_rows:
        raise AttnlabError(f"{q_rows} query rows cannot share {kv_rows} key/value rows evenly")
    if bias is not None and (bias.shape[0] not in (1, kv_rows) or bias.shape[-2] != 1):
        raise AttnlabError("a bias for shared keys/values must be (kv_rows or 1, ., 1, k_len)")
    return q_rows // kv_rows


def _to_groups(x: Tensor, group: int) -> Tensor:
    """(rows * group, heads, q_len, d) -> (rows, heads, group * q_len, d): a group's queries side by side."""
    bg, h, q_len, d = x.shape
    x = x.view(bg // group, group, h, q_len, d).transpose(1, 2)
    return x.reshape(bg // group, h, group * q_len, d)


def _from_groups(x: Tensor, group: int) -> Tensor:
    """Inverse of _to_groups for outputs and weights: (rows, heads, group * q_len, n) -> (rows * group, heads, q_len, n)."""
    b, h, gq, n = x.shape
    x = x.view(b, h, group, gq // group, n).transpose(1, 2)
    return x.reshape(b * group, h, gq // group, n)


# --- the twins --------------------------------------------------------------------------------


def _on_cpu(x: Tensor) -> bool:
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


class FastMultiHeadAttention(MultiHeadAttention):
    """MultiHeadAttention by the CPU routes above; ``query_rows`` computes some positions only."""

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        bias: Tensor | None = None,
        causal: bool = False,
        rope: tuple[Tensor, Tensor] | None = None,
        cache: Cache | None = None,
        layer: int = 0,
        need_weights: bool = False,
        query_rows: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """As MultiHeadAttention.forward; ``query_rows`` (batch, q) limits self-attention's
        queries to those positions of x (keys and values still come from all of x), and the
        output is then (batch, q, d_model), the full output's rows at those positions."""
        if query_rows is not None and (self.cross or cache is not None):
            raise AttnlabError("query_rows serves self-attention without a cache only")
        if self._fused_dropout_serves(x, rope, cache, need_weights, causal, query_rows):
            return self._train_with_dropout(x, memory, bias, causal, query_rows), None
        if query_rows is None:
            return super().forward(x, memory, bias, causal, rope, cache, layer, need_weights)
        q, kv = self._row_projections(x, query_rows)
        (q,), (k, v) = self.split_heads(q, 1), self.split_heads(kv, 2)
        if rope is not None:
            q_rope = (rope[0][query_rows].unsqueeze(1), rope[1][query_rows].unsqueeze(1))
            q, k = apply_rotary(q, q_rope), apply_rotary(k, rope)
        bias = _bias_rows(bias, query_rows, len(x))
        if causal:  # the queries sit at positions query_rows, not at the last q ones
            bias = _causal_bias_rows(bias, query_rows, x.shape[1], q.dtype)
        out, weights = self.attend(q, k, v, bias, False, need_weights)
        return self.out_proj(self.merge_heads(out)), weights

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, causal: bool, need_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        """As MultiHeadAttention.attend; shared keys are read in place, not copied per query row."""
        if not _on_cpu(q) or (causal and q.shape[0] != k.shape[0]):
            return super().attend(q, k, v, bias, causal, need_weights)
        group = _group_size(q.shape[0], k.shape[0], bias)
        if group > 1:
            q = _to_groups(q, group)
        dropout_p = self.dropout if self.training else 0.0
        out, weights = cpu_attention(q, k, v, bias, causal, dropout_p, need_weights)
        if group > 1:
            out = _from_groups(out, group)
            weights = None if weights is None else _from_groups(weights, group)
        return out, weights

    def _fused_dropout_serves(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor] | None,
        cache: Cache | None,
        need_weights: bool,
        causal: bool,
        query_rows: Tensor | None,
    ) -> bool:
        """Whether _DropoutAttention computes this call: a training step's attention on CPU.

        RoPE, a cache, returned weights and causal attention over some queries keep the
        general path.
        """
        return (
            self.training
            and has_keep_mask(self.dropout)
            and _on_cpu(x)
            and x.dtype in (torch.float32, torch.float64)
            and not torch.is_autocast_enabled("cpu")
            and rope is None
            and cache is None
            and not need_weights
            and not (causal and query_rows is not None)
        )

    def _row_projections(self, x: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
        """Queries (batch, q, d_model) from the given rows only, keys and values side by side
        (batch, seq, 2 d_model) from every position: the fused weight's first d_model outputs
        are W^Q, the rest W^K and W^V."""
        d, w, b = self.d_model, self.qkv_proj.weight, self.qkv_proj.bias
        q = linear(gather_rows(x, rows), w[:d], None if b is None else b[:d])
        return q, linear(x, w[d:], None if b is None else b[d:])

    def _train_with_dropout(
        self,
        x: Tensor,
        memory: Tensor | None,
        bias: Tensor | None,
        causal: bool,
        query_rows: Tensor | None,
    ) -> Tensor:
        """forward() while training on CPU with attention dropout: one _DropoutAttention call."""
        if self.cross:
            q_in, kv_in = self.q_proj(x), self.kv_proj(memory)
        elif query_rows is not None:
            q_in, kv_in = self._row_projections(x, query_rows)
            bias = _bias_rows(bias, query_rows, len(x))
        else:
            q_in, kv_in = self.qkv_proj(x), None  # q, k and v side by side
        if causal:
            k_len = x.shape[1] if kv_in is None else kv_in.shape[1]
            bias = with_causal_bias(bias, q_in.shape[1], k_len, x.dtype, x.device)
        out = _DropoutAttention.apply(q_in, kv_in, self.n_heads, bias, self.dropout)
        return self.out_proj(out)


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


class FastEncoderLayer(EncoderLayer):
    """EncoderLayer that can compute the outputs at some positions only (``rows``)."""

    def forward(
        self,
        x: Tensor,
        bias: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        need_weights: bool = False,
        rows: KeptRows | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """As EncoderLayer.forward; with ``rows`` only those positions are computed (they still
        attend to every position) and the output is (kept positions, d_model), as
        ``KeptRows.flatten`` gives."""
        if rows is None:
            return super().forward(x, bias, rope, need_weights)
        if not isinstance(self.self_attn, FastMultiHeadAttention):
            x, weights = super().forward(x, bias, rope, need_weights)
            return rows.flatten(gather_rows(x, rows.index)), weights
        residual = self.attn_residual
        h, weights = self.self_attn(
            residual.sublayer_input(x), bias=bias, rope=rope, need_weights=need_weights,
            query_rows=rows.index,
        )  # fmt: skip
        x = residual(rows.flatten(gather_rows(x, rows.index)), rows.flatten(h))
        return self.ffn_residual(x, self.ffn(self.ffn_residual.sublayer_input(x))), weights


class FastEncoder(Encoder):
    """Encoder whose last layer computes only the positions ``keep`` asks for."""

    def forward(
        self,
        x: Tensor,
        bias: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        need_weights: bool = False,
        output_hidden_states: bool = False,
        keep: Tensor | None = None,
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """As Encoder.forward (every layer's weights and states, when asked for, are whole)."""
        *below, last = self.stack()
        if (
            keep is None
            or need_weights
            or output_hidden_states
            or not isinstance(last, FastEncoderLayer)
            or not bool(keep.any())
        ):
            return super().forward(x, bias, rope, need_weights, output_hidden_states, keep)
        for layer in below:
            x, _ = layer(x, bias=bias, rope=rope)
        x, _ = last(x, bias=bias, rope=rope, rows=KeptRows.from_mask(keep))
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x, [], []


# --- no work on padding ------------------------------------------------------------------------


@dataclass(frozen=True)
class RealRows:
    """Where an unpadded encoder's rows sit in the padded (batch, seq) layout.

    ``rows`` (count,) are the flat indices (into batch * seq) of the positions computed: those
    some query attends to (keys that are not padding) and those the caller keeps, ascending,
    so ``x.flatten(0, 1)[rows]`` packs them in row-major order. ``kept`` (kept count,) are the
    places within ``rows`` of the kept positions: ``packed[kept]`` is ``full[keep]``.
    """

    shape: tuple[int, int]  # (batch, seq)
    rows: Tensor
    kept: Tensor

    @classmethod
    def of(cls, bias: Tensor, keep: Tensor) -> RealRows | None:
        """The rows of a key-padding bias (batch or 1, 1, 1, seq) and a keep mask (batch, seq),
        or None when there is nothing to leave out (or the bias is not a key mask alone)."""
        if bias.dim() != 4 or bias.shape[1] != 1 or bias.shape[2] != 1:
            return None  # a positional bias per query: keep the general path
        seen = (bias[:, 0, 0, :] > torch.finfo(bias.dtype).min).expand_as(keep)
        computed = seen | keep
        if bool(computed.all()):
            return None
        flat = computed.flatten()
        return cls(
            (keep.shape[0], keep.shape[1]),
            flat.nonzero().squeeze(1),
            keep.flatten()[flat].nonzero().squeeze(1),
        )

    def scatter(self, packed: Tensor) -> Tensor:
        """(count, d) packed rows -> (batch, seq, d), zeros at the positions left out."""
        full = packed.new_zeros(self.shape[0] * self.shape[1], packed.shape[-1])
        return full.index_copy_(0, self.rows, packed).view(*self.shape, -1)


def unpadded_layer(
    layer: EncoderLayer,
    x: Tensor,
    at: RealRows,
    bias: Tensor,
    rope: tuple[Tensor, Tensor] | None,
    last: bool,
) -> Tensor:
    """EncoderLayer.forward on the packed rows x (count, d_model) only; the last layer outputs
    just the kept rows (kept count, d_model). Attention runs in the padded layout."""
    attn, residual = layer.self_attn, layer.attn_residual
    q, k, v = attn.split_heads(at.scatter(attn.qkv_proj(residual.sublayer_input(x))), 3)
    if rope is not None:
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
    out, _ = attn.attend(q, k, v, bias, False, False)
    wanted = at.rows[at.kept] if last else at.rows
    h = attn.out_proj(attn.merge_heads(out).flatten(0, 1).index_select(0, wanted))
    x = residual(x[at.kept] if last else x, h)
    return layer.ffn_residual(x, layer.ffn(layer.ffn_residual.sublayer_input(x)))


class UnpaddedEncoder(FastEncoder):
    """FastEncoder that, in evaluation with ``keep``, computes no padding in any layer."""

    def forward(
        self,
        x: Tensor,
        bias: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        need_weights: bool = False,
        output_hidden_states: bool = False,
        keep: Tensor | None = None,
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """As Encoder.forward; the packed route serves evaluation (no dropout) on CPU of
        self-attention layers with a key-padding bias, when ``keep`` is given."""
        at = None
        if self._serves(x, bias, keep, need_weights or output_hidden_states):
            at = RealRows.of(bias, keep)  # type: ignore[arg-type]
        if at is None:
            return super().forward(x, bias, rope, need_weights, output_hidden_states, keep)
        layers = self.stack()
        x = x.flatten(0, 1).index_select(0, at.rows)
        for i, layer in enumerate(layers):
            x = unpadded_layer(layer, x, at, bias, rope, last=i == len(layers) - 1)  # type: ignore[arg-type]
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x, [], []

    def _serves(
        self, x: Tensor, bias: Tensor | None, keep: Tensor | None, full_outputs: bool
    ) -> bool:
        plain_attention = (MultiHeadAttention, FastMultiHeadAttention)  # not Shaw's
        return (
            keep is not None
            and bias is not None
            and not full_outputs
            and not self.training
            and _on_cpu(x)
            and bool(keep.any())
            and all(type(layer.self_attn) in plain_attention for layer in self.layers)
        )
