"""Attention (Vaswani et al. 2017, section 3.2).

Scaled dot-product attention, eq. (1): ``Attention(Q, K, V) = softmax(QK^T / sqrt(d_k)) V``,
with an additive bias for padding masks and positional biases, and a causal mask.
Multi-head attention, section 3.2.2: ``MultiHead(Q, K, V) = Concat(head_1..head_h) W^O``.

Two paths compute the same thing: the fast one calls PyTorch's fused
``scaled_dot_product_attention``; the explicit one spells out the formula and also returns the
attention weights (for visualisation), and serves decoding steps on CPU (a few queries), where
it is the faster of the two. Tests hold them equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx

from attnlab.errors import AttnlabError
from attnlab.nn.dropout import dropout, dropout_scale, has_keep_mask, keep_mask
from attnlab.nn.linear import Linear, linear, matmul


def causal_mask(q_len: int, k_len: int, device: torch.device | None = None) -> Tensor:
    """Boolean (q_len, k_len) mask, True where query i may see key j (j <= i + k_len - q_len).

    Queries are the last ``q_len`` positions of the ``k_len`` keys, as in cached decoding.
    """
    offset = k_len - q_len
    q_pos = torch.arange(q_len, device=device).unsqueeze(1) + offset
    k_pos = torch.arange(k_len, device=device).unsqueeze(0)
    return k_pos <= q_pos


def padding_bias(attention_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Additive bias (batch, 1, 1, k_len) from a 0/1 key mask: 0 where kept, a large negative where padded."""
    keep = attention_mask.to(torch.bool)[:, None, None, :]
    bias = torch.zeros(keep.shape, dtype=dtype, device=attention_mask.device)
    return bias.masked_fill_(~keep, torch.finfo(dtype).min)


def with_causal_bias(
    bias: Tensor | None, q_len: int, k_len: int, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """bias plus a large negative where query i may not see key j (causal_mask's False)."""
    future = ~causal_mask(q_len, k_len, device)
    causal_bias = torch.zeros(future.shape, dtype=dtype, device=device)
    causal_bias.masked_fill_(future, torch.finfo(dtype).min)
    return causal_bias if bias is None else bias + causal_bias


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None = None,
    causal: bool = False,
    dropout_p: float = 0.0,
    need_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """softmax(q k^T / sqrt(d_k) + bias) v, optionally causal; returns (output, weights or None).

    q: (batch, heads, q_len, d_head); k, v: (batch, heads, k_len, d_head);
    bias: additive, broadcastable to (batch, heads, q_len, k_len).
    """
    q_len, k_len = q.shape[-2], k.shape[-2]
    if causal and q_len == 1:
        causal = False  # one query at the newest position (a decoding step) sees every key
    # A decoding step has one query per row (or one per beam, up to 8 beams, where beams share
    # their cross-attention keys): on CPU two plain matmuls cost less there than the fused
    # kernel's tiling (one-off micro-benchmark, 2 threads, 4 queries x 16 keys x 32 rows: 110
    # vs 338 us per call; bench/translate.py times the whole search). Not measured on GPUs,
    # which keep the fused kernel.
    few_queries = q_len <= 8 and dropout_p == 0.0 and q.device.type == "cpu"
    # With dropout on CPU, SDPA falls back to its unfused math path and PyTorch's per-element
    # bernoulli mask; the explicit path with attnlab's cheaper mask does the same work faster.
    cpu_dropout = dropout_p > 0.0 and q.device.type == "cpu"
    explicit = need_weights or few_queries or cpu_dropout
    if causal and (bias is not None or q_len != k_len or explicit):
        # SDPA's is_causal aligns the mask top-left; cached decoding needs it bottom-right.
        bias, causal = with_causal_bias(bias, q_len, k_len, q.dtype, q.device), False
    if not explicit:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias, dropout_p=dropout_p, is_causal=causal
        )
        return out, None
    # Scale q (seq x d_head) rather than the scores (seq x seq); add the bias in place, which
    # autograd allows because a matmul does not keep its output for the backward pass.
    scores = matmul(q * (1.0 / math.sqrt(q.shape[-1])), k.transpose(-2, -1))
    if bias is not None:
        scores.add_(bias)
    weights = torch.softmax(scores, dim=-1)
    probs = dropout(weights, dropout_p)
    return matmul(probs, v), weights if need_weights else None


class _DropoutAttention(torch.autograd.Function):
    """Training attention on CPU with dropout on the weights, from projections to merged heads.

    Computes what the explicit path computes, ``softmax(q k^T / sqrt(d) + bias)`` with
    dropout, times v, but takes the projections' outputs as they come, (batch, len, n d_model)
    with heads side by side, and returns heads concatenated, (batch, q_len, d_model): autograd
    then keeps no per-head views, whose backward pass stacks and copies the gradients of q, k
    and v twice over. The scale sqrt(d) is applied while q is copied to one block per head, the
    dropout scale to the (q_len, d_head) products instead of the (q_len, k_len) weights, and
    the dropped weights are the softmax times a 1-byte keep mask (nn/dropout.py's, so the same
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


def gather_rows(x: Tensor, rows: Tensor) -> Tensor:
    """x (batch, seq, d) at the positions rows (batch, q) -> (batch, q, d)."""
    return x.gather(1, rows.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension (RoPE's 90-degree turn)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
    """Rotate (batch, heads, seq, d_head) by the per-position angles in rope=(cos, sin) of (seq, d_head)."""
    cos, sin = (part.to(x.dtype) for part in rope)
    return x * cos + rotate_half(x) * sin


class KVBuffer:
    """Self-attention keys and values (batch, heads, seq, d_head) of the positions decoded so far.

    Kept with room to grow: a step writes its new positions into spare capacity instead of
    concatenating (which copies the whole cache), and a beam reorder copies the filled
    positions into a second buffer kept for that. So a decoding step copies the cache once,
    not twice, and into memory already touched: fresh allocations of this size cost page
    faults on CPU (cat + index_select vs this, 128 rows x 20 positions of transformer-base,
    one thread, a one-off micro-benchmark on a busy machine: about 3 ms vs 0.6 ms per layer
    and tensor). Beam search copies less still: ``copy_entries`` rewrites in place only some
    positions of the rows of beams that died (``KVCache.copy_rows``, ``decode.py: keep_rows``);
    ``select_rows`` serves the first step and sentences leaving the batch.

    Stored position-major, (capacity, batch, heads, d_head), and read through a permuted view:
    the filled positions are then one compact block, where a (batch, heads, capacity, d_head)
    layout scatters them over the whole capacity, a short run per batch row and head. With
    caches evicted between steps, single-query attention over 128 rows x 4 heads ran at 220-460
    against 430-660 us for 6-30 positions, and an append at 27-44 against 38-167 us (one-off
    micro-benchmarks, 2 threads); whole beam searches ran 6-13% faster (bench/RESULTS.md).
    """

    def __init__(self) -> None:
        self.length = 0
        self._kv: tuple[Tensor, Tensor] | None = None  # (capacity, batch, heads, d_head) each
        self._spare: tuple[Tensor, Tensor] | None = None  # where the next reorder writes

    def _filled(self) -> tuple[Tensor, Tensor]:
        # (length, batch, heads, d_head): the storage's filled positions
        if self._kv is None:
            raise AttnlabError("the key/value buffer is empty")
        return self._kv[0][: self.length], self._kv[1][: self.length]

    @property
    def kv(self) -> tuple[Tensor, Tensor]:
        """(keys, values) of the filled positions: views (batch, heads, length, d_head)."""
        k, v = self._filled()
        return k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add the new positions' keys and values; returns all of them (see kv)."""
        end = self.length + k.shape[2]
        if self._kv is None or end > self._kv[0].shape[0]:
            b, h, _, d = k.shape
            grown = tuple(x.new_empty(max(2 * end, 16), b, h, d) for x in (k, v))
            if self._kv is not None:
                for old, buffer in zip(self._filled(), grown, strict=True):
                    buffer[: self.length] = old
            self._kv, self._spare = grown, None
        for new, buffer in zip((k, v), self._kv, strict=True):
            buffer[self.length : end] = new.permute(2, 0, 1, 3)
        self.length = end
        return self.kv

    def select_rows(self, rows: Tensor) -> None:
        """Keep/duplicate batch rows by index (beam reordering; finished sentences leaving)."""
        if self._kv is None:
            return
        capacity, _, h, d = self._kv[0].shape
        shape = (capacity, rows.shape[0], h, d)
        if self._spare is None or self._spare[0].shape != shape:
            self._spare = tuple(x.new_empty(shape) for x in self._kv)
        for old, target in zip(self._filled(), self._spare, strict=True):
            torch.index_select(old, 1, rows, out=target[: self.length])
        same_rows = shape[1] == self._kv[0].shape[1]
        self._kv, self._spare = self._spare, (self._kv if same_rows else None)

    @property
    def batch_size(self) -> int:
        """Rows held (0 while empty)."""
        return 0 if self._kv is None else self._kv[0].shape[1]

    def copy_entries(self, dst: Tensor, src: Tensor) -> None:
        """Overwrite entries dst with entries src in place (all sources read before any write).

        An entry is one position of one row, all heads: entry ``position * batch + row``.
        """
        if self._kv is None or dst.numel() == 0:
            return
        for buffer in self._kv:
            entries = buffer.view(buffer.shape[0] * buffer.shape[1], -1)
            entries.index_copy_(0, dst, entries.index_select(0, src))


@dataclass
class KVCache:
    """Keys and values of past positions for incremental decoding, one slot per layer.

    ``self_kv`` grows by one position per decoding step; ``cross_kv`` (encoder memory projected
    to keys/values) is computed once per source and reused at every step.
    Tensors are (batch, heads, seq, d_head).
    """

    n_layers: int
    self_kv: list[KVBuffer] = field(default_factory=list)
    cross_kv: list[tuple[Tensor, Tensor] | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.self_kv:
            self.self_kv = [KVBuffer() for _ in range(self.n_layers)]
        if not self.cross_kv:
            self.cross_kv = [None] * self.n_layers

    @property
    def length(self) -> int:
        """Number of positions already cached."""
        return self.self_kv[0].length

    def reorder(self, index: Tensor, cross_index: Tensor | None = None) -> None:
        """Keep/duplicate batch rows: self-attention ones by index, cross-attention ones by cross_index.

        cross_index=None leaves the cross-attention keys/values as they are: in beam search
        they hold one row per sentence, shared by its beams, and change only when sentences
        leave the batch.
        """
        for buffer in self.self_kv:
            buffer.select_rows(index)
        if cross_index is not None:
            self.cross_kv = [_select_rows(kv, cross_index) for kv in self.cross_kv]

    def copy_rows(self, dst: Tensor, src: Tensor, start: Tensor | None = None) -> None:
        """Self-attention rows dst become copies of rows src, in place; the others stay.

        A beam search that keeps each surviving beam in its row moves only the rows whose
        beam died, which costs less than copying every row (reorder). ``start`` (one per
        pair; default 0) copies only positions start[i] onward of each pair: a position's keys
        and values depend only on the tokens up to it, so where two beams' prefixes agree the
        row holds the right ones already (on the benchmark's random model, 90% of the copied
        positions). All sources are read before any write.
        """
        if start is None:
            start = torch.zeros_like(dst)
        positions = torch.arange(self.length, device=dst.device)
        pair, pos = (positions >= start.unsqueeze(1)).nonzero().unbind(1)  # what to copy
        if pair.numel() == 0:
            return
        rows = self.self_kv[0].batch_size  # every layer's buffer holds the same rows
        dst_entries, src_entries = pos * rows + dst[pair], pos * rows + src[pair]
        for buffer in self.self_kv:
            buffer.copy_entries(dst_entries, src_entries)


def _bias_rows(bias: Tensor | None, rows: Tensor, batch: int) -> Tensor | None:
    """A bias's rows for the queries at positions rows (batch, q); a bias shared by all queries as it is."""
    if bias is None or bias.shape[-2] == 1:
        return bias
    bias = bias.expand(batch, -1, -1, -1)
    return bias.gather(2, rows[:, None, :, None].expand(-1, bias.shape[1], -1, bias.shape[-1]))


def _select_rows(kv: tuple[Tensor, Tensor] | None, rows: Tensor) -> tuple[Tensor, Tensor] | None:
    return None if kv is None else (kv[0].index_select(0, rows), kv[1].index_select(0, rows))


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


class MultiHeadAttention(nn.Module):
    """Multi-head attention with a fused QKV projection (self) or Q + fused KV (cross)."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        dropout: float = 0.0,
        cross: bool = False,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.d_model, self.n_heads, self.d_head = d_model, n_heads, d_model // n_heads
        self.cross, self.dropout = cross, dropout
        if cross:
            self.q_proj = Linear(d_model, d_model, bias=bias)
            self.kv_proj = Linear(d_model, 2 * d_model, bias=bias)
        else:
            # One (d_model -> 3 d_model) matmul instead of three smaller ones.
            self.qkv_proj = Linear(d_model, 3 * d_model, bias=bias)
        self.out_proj = Linear(d_model, d_model, bias=bias)  # W^O

    def _heads(self, x: Tensor, n: int) -> tuple[Tensor, ...]:
        # (batch, seq, n * d_model) -> n tensors of (batch, heads, seq, d_head)
        b, s, _ = x.shape
        x = x.view(b, s, n, self.n_heads, self.d_head).permute(2, 0, 3, 1, 4)
        return x.unbind(0)

    def _row_projections(self, x: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
        """Queries (batch, q, d_model) from the given rows only, keys and values side by side
        (batch, seq, 2 d_model) from every position: the fused weight's first d_model outputs
        are W^Q, the rest W^K and W^V."""
        d, w, b = self.d_model, self.qkv_proj.weight, self.qkv_proj.bias
        q = linear(gather_rows(x, rows), w[:d], None if b is None else b[:d])
        return q, linear(x, w[d:], None if b is None else b[d:])

    def _row_qkv(self, x: Tensor, rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, kv = self._row_projections(x, rows)
        return *self._heads(q, 1), *self._heads(kv, 2)

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        bias: Tensor | None = None,
        causal: bool = False,
        rope: tuple[Tensor, Tensor] | None = None,
        past: KVBuffer | tuple[Tensor, Tensor] | None = None,
        need_weights: bool = False,
        query_rows: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None, tuple[Tensor, Tensor]]:
        """Attend from x (batch, q_len, d_model) to itself or to memory; returns (out, weights, kv).

        ``past`` holds cached keys/values: for self-attention a KVBuffer, which the new ones
        are appended to; for cross-attention a (keys, values) pair used as it is (memory may
        then be None). The returned kv are the keys and values attended to. Cross-attention
        keys/values may have fewer rows than x: each is then shared by x.shape[0] // rows
        consecutive query rows (the beams of one sentence), which attend to it together
        instead of to copies of it.

        ``query_rows`` (batch, q) limits self-attention's queries to those positions of x (keys
        and values still come from all of x): the output is then (batch, q, d_model), the rows
        of the full output at those positions.
        """
        dropout_p = self.dropout if self.training else 0.0
        # Training with attention dropout on CPU: one autograd function (_DropoutAttention).
        # It covers what a training step asks for; RoPE, cached keys, returned weights and
        # causal attention over a subset of queries keep the general path below.
        if (
            has_keep_mask(dropout_p)
            and x.device.type == "cpu"
            and x.dtype in (torch.float32, torch.float64)
            and not torch.is_autocast_enabled("cpu")
            and rope is None
            and past is None
            and not need_weights
            and not (causal and query_rows is not None)
            and not torch.compiler.is_compiling()  # compile brings its own kernels
        ):
            return self._train_with_dropout(x, memory, bias, causal, query_rows)
        group = 1
        if self.cross:
            (q,) = self._heads(self.q_proj(x), 1)
            if isinstance(past, KVBuffer):
                raise AttnlabError(
                    "cross-attention takes past as a (keys, values) pair, not a KVBuffer"
                )
            if past is not None:
                k, v = past
            else:
                k, v = self._heads(self.kv_proj(memory), 2)
            group = _group_size(q.shape[0], k.shape[0], bias)
            if group > 1:
                q = _to_groups(q, group)
        elif query_rows is not None:
            if past is not None:
                raise AttnlabError("query_rows cannot be combined with cached keys and values")
            q, k, v = self._row_qkv(x, query_rows)
            if rope is not None:
                q_rope = (rope[0][query_rows].unsqueeze(1), rope[1][query_rows].unsqueeze(1))
                q, k = apply_rotary(q, q_rope), apply_rotary(k, rope)
            bias = _bias_rows(bias, query_rows, len(x))
            if causal:  # the queries sit at positions query_rows, not at the last q_len ones
                future = torch.arange(x.shape[1], device=x.device) > query_rows[:, None, :, None]
                causal_bias = torch.zeros(future.shape, dtype=q.dtype, device=x.device)
                causal_bias.masked_fill_(future, torch.finfo(q.dtype).min)
                bias, causal = (causal_bias if bias is None else bias + causal_bias), False
        else:
            q, k, v = self._heads(self.qkv_proj(x), 3)
            if rope is not None:
                q, k = apply_rotary(q, rope), apply_rotary(k, rope)
            if past is not None:
                if not isinstance(past, KVBuffer):
                    raise AttnlabError(
                        "self-attention takes past as a KVBuffer (it grows each step), "
                        f"not {type(past).__name__}"
                    )
                k, v = past.append(k, v)
        out, weights = scaled_dot_product_attention(q, k, v, bias, causal, dropout_p, need_weights)
        if group > 1:
            out = _from_groups(out, group)
            weights = None if weights is None else _from_groups(weights, group)
        b, _, s, _ = out.shape
        out = out.transpose(1, 2).reshape(b, s, self.d_model)  # concatenate heads
        return self.out_proj(out), weights, (k, v)

    def _train_with_dropout(
        self,
        x: Tensor,
        memory: Tensor | None,
        bias: Tensor | None,
        causal: bool,
        query_rows: Tensor | None,
    ) -> tuple[Tensor, None, tuple[Tensor, Tensor]]:
        """forward() while training on CPU with attention dropout: one _DropoutAttention call."""
        if self.cross:
            q_in, kv_in = self.q_proj(x), self.kv_proj(memory)
        elif query_rows is not None:
            q_in, kv_in = self._row_projections(x, query_rows)
            bias = _bias_rows(bias, query_rows, len(x))
        else:
            q_in, kv_in = self.qkv_proj(x), None  # q, k and v side by side
        kv = q_in[..., self.d_model :] if kv_in is None else kv_in
        if causal:
            bias = with_causal_bias(bias, q_in.shape[1], kv.shape[1], x.dtype, x.device)
        out = _DropoutAttention.apply(q_in, kv_in, self.n_heads, bias, self.dropout)
        return self.out_proj(out), None, self._heads(kv, 2)
