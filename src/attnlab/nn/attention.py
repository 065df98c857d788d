"""Attention (Vaswani et al. 2017, section 3.2).

Read top to bottom: the masks (padding, causal); scaled dot-product attention, eq. (1),
``Attention(Q, K, V) = softmax(QK^T / sqrt(d_k)) V``, in two paths that compute the same thing
(PyTorch's fused ``scaled_dot_product_attention``, and the formula spelled out, which also
returns the weights, for visualisation); RoPE's rotation of queries and keys (Su et al. 2021);
then multi-head attention, section 3.2.2: ``MultiHead(Q, K, V) = Concat(head_1..head_h) W^O``;
last, Shaw et al. 2018's self-attention with relative position representations, the same
module with eq. (1) replaced by their eqs. (3) and (4).

Decoding caches keys and values (``attnlab.decode.cache``); this module sees a cache only
through the small ``Cache`` interface. Faster routes for CPU training and decoding are twins
in ``attnlab.fast.attention``.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.errors import AttnlabError
from attnlab.nn.positions import RelativePositionRepresentations

# --- masks ------------------------------------------------------------------------------------


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


# --- scaled dot-product attention, eq. (1) ------------------------------------------------------


def explicit_attention(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None = None, dropout_p: float = 0.0
) -> tuple[Tensor, Tensor]:
    """Eq. (1) written out: (softmax(q k^T / sqrt(d_k) + bias) with dropout) v, and the weights.

    q: (batch, heads, q_len, d_head); k, v: (batch, heads, k_len, d_head); bias additive,
    broadcastable to (batch, heads, q_len, k_len). Returns the output (batch, heads, q_len,
    d_head) and the weights before dropout (batch, heads, q_len, k_len).
    """
    scores = torch.matmul(q / math.sqrt(q.shape[-1]), k.transpose(-2, -1))
    if bias is not None:
        scores = scores + bias
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(F.dropout(weights, dropout_p), v), weights


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

    Shapes as in ``explicit_attention``. PyTorch's fused kernel computes it unless the weights
    are asked for; the causal mask is aligned bottom-right (queries are the last positions).
    """
    q_len, k_len = q.shape[-2], k.shape[-2]
    if causal and q_len == 1:
        causal = False  # one query at the newest position (a decoding step) sees every key
    if causal and (bias is not None or q_len != k_len or need_weights):
        # SDPA's is_causal aligns the mask top-left; cached decoding needs it bottom-right.
        bias, causal = with_causal_bias(bias, q_len, k_len, q.dtype, q.device), False
    if need_weights:
        return explicit_attention(q, k, v, bias, dropout_p)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=bias, dropout_p=dropout_p, is_causal=causal
    )
    return out, None


# --- rotary position embedding (RoPE) ------------------------------------------------------------


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension (RoPE's 90-degree turn)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
    """Rotate (batch, heads, seq, d_head) by the per-position angles in rope=(cos, sin) of (seq, d_head)."""
    cos, sin = (part.to(x.dtype) for part in rope)
    return x * cos + rotate_half(x) * sin


# --- multi-head attention, section 3.2.2 ----------------------------------------------------------


class Cache(Protocol):
    """What attention needs of a key/value cache (``attnlab.decode.cache.KVCache`` is one).

    Tensors are (batch, heads, seq, d_head). ``length`` is the number of positions cached.
    """

    @property
    def length(self) -> int:
        """Positions already cached (the next one's index)."""
        ...

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Self-attention: store the new positions' keys and values; return all positions'."""
        ...

    def cross(self, layer: int) -> tuple[Tensor, Tensor] | None:
        """Cross-attention: the encoder memory's keys and values, or None before the first step."""
        ...

    def set_cross(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Cross-attention: keep the memory's keys and values for the later steps."""
        ...


def share_rows(x: Tensor | None, rows: int) -> Tensor | None:
    """x (n, ...) with each row repeated for ``rows`` // n consecutive rows; rows of 1 or None as they are.

    Cross-attention keys may hold one row per sentence for that sentence's beams (consecutive
    query rows).
    """
    if x is None or x.shape[0] in (1, rows):
        return x
    if x.shape[0] == 0 or rows % x.shape[0]:
        raise AttnlabError(f"{rows} query rows cannot share {x.shape[0]} key/value rows evenly")
    return x.repeat_interleave(rows // x.shape[0], dim=0)


class MultiHeadAttention(nn.Module):
    """Multi-head attention with a fused Q|K|V projection (self) or Q and a fused K|V (cross).

    Each projection matrix holds the heads' W_i^Q (or W_i^K, W_i^V) side by side, so one
    matrix product projects every head at once.
    """

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
            self.q_proj = nn.Linear(d_model, d_model, bias=bias)  # W^Q
            self.kv_proj = nn.Linear(d_model, 2 * d_model, bias=bias)  # [W^K; W^V]
        else:
            self.qkv_proj = nn.Linear(d_model, 3 * d_model, bias=bias)  # [W^Q; W^K; W^V]
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)  # W^O

    def split_heads(self, x: Tensor, n: int) -> tuple[Tensor, ...]:
        """(batch, seq, n * d_model) -> n tensors (batch, heads, seq, d_head)."""
        b, s, _ = x.shape
        return x.view(b, s, n, self.n_heads, self.d_head).permute(2, 0, 3, 1, 4).unbind(0)

    def merge_heads(self, x: Tensor) -> Tensor:
        """(batch, heads, seq, d_head) -> (batch, seq, d_model): Concat(head_1, ..., head_h)."""
        b, _, s, _ = x.shape
        return x.transpose(1, 2).reshape(b, s, self.d_model)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, causal: bool, need_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        """Eq. (1) for every head at once, with attention dropout while training.

        k and v may have fewer rows than q: each is then shared by consecutive query rows.
        """
        rows = q.shape[0]
        k, v, bias = share_rows(k, rows), share_rows(v, rows), share_rows(bias, rows)
        dropout_p = self.dropout if self.training else 0.0
        return scaled_dot_product_attention(q, k, v, bias, causal, dropout_p, need_weights)

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
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from x (batch, q_len, d_model) to itself or to memory (batch, k_len, d_model).

        Returns the output (batch, q_len, d_model) and the weights (batch, heads, q_len,
        k_len) or None. With a cache (decoding), x holds only the new positions: self-attention
        adds their keys and values to the cache's slot ``layer`` and attends to all of them;
        cross-attention projects memory at the first step only.
        """
        if self.cross:
            (q,) = self.split_heads(self.q_proj(x), 1)
            kv = cache.cross(layer) if cache is not None else None
            if kv is None:
                if memory is None:
                    raise AttnlabError("cross-attention needs memory or cached keys and values")
                kv = self.split_heads(self.kv_proj(memory), 2)
                if cache is not None:
                    cache.set_cross(layer, *kv)
            k, v = kv
        else:
            q, k, v = self.split_heads(self.qkv_proj(x), 3)
            if rope is not None:
                q, k = apply_rotary(q, rope), apply_rotary(k, rope)
            if cache is not None:
                k, v = cache.update(layer, k, v)
        out, weights = self.attend(q, k, v, bias, causal, need_weights)
        return self.out_proj(self.merge_heads(out)), weights


# --- relative position representations (Shaw et al. 2018) ---------------------------------------


def relative_scores(q: Tensor, k: Tensor, a_keys: Tensor) -> Tensor:
    """Shaw et al. eq. (4): e_ij = q_i (k_j + a^K_ij)^T / sqrt(d_z), (batch, heads, q_len, k_len).

    Split in two as in their section 3.3, eq. (5): q_i k_j^T over the heads' keys, and
    q_i a^K_ij^T over the offsets' vectors, which all heads share. q: (batch, heads, q_len,
    d_head); k: (batch, heads, k_len, d_head); a_keys: (q_len, k_len, d_head).
    """
    content = torch.matmul(q, k.transpose(-2, -1))  # q_i k_j^T
    position = torch.einsum("bhqd,qkd->bhqk", q, a_keys.to(q.dtype))  # q_i a^K_ij^T
    return (content + position) / math.sqrt(q.shape[-1])


def relative_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a_keys: Tensor,
    a_values: Tensor | None,
    bias: Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Shaw et al. eqs. (4) and (3): attention that also sees each key's offset from the query.

    alpha_ij = softmax_j(e_ij + bias_ij) with e from ``relative_scores``, then
    z_i = sum_j alpha_ij (v_j + a^V_ij), again split in two (eq. (5)'s form); without a_values,
    z_i = sum_j alpha_ij v_j. v: (batch, heads, k_len, d_head); a_values (q_len, k_len, d_head)
    or None. Returns the output (batch, heads, q_len, d_head) and the weights before dropout
    (batch, heads, q_len, k_len).
    """
    scores = relative_scores(q, k, a_keys)
    if bias is not None:
        scores = scores + bias
    weights = torch.softmax(scores, dim=-1)
    dropped = F.dropout(weights, dropout_p)
    out = torch.matmul(dropped, v)  # sum_j alpha_ij v_j
    if a_values is not None:
        out = out + torch.einsum("bhqk,qkd->bhqd", dropped, a_values.to(q.dtype))
    return out, weights


class RelativeMultiHeadAttention(MultiHeadAttention):
    """Multi-head self-attention with Shaw et al.'s learned relative positions (their section 3).

    Projections, cache and W^O as ``MultiHeadAttention``; only Vaswani et al.'s eq. (1) changes,
    to ``relative_attention`` with this layer's a^K (and a^V), shared by its heads. A class of its
    own, so that code swapping in faster twins of ``MultiHeadAttention`` by class (attnlab.fast)
    leaves it on this plain path.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        dropout: float = 0.0,
        max_distance: int = 16,
        values: bool = True,
        bias: bool = True,
    ) -> None:
        super().__init__(d_model, n_heads, dropout, cross=False, bias=bias)
        self.relative = RelativePositionRepresentations(self.d_head, max_distance, values)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, causal: bool, need_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        """Eqs. (3)-(4) for every head at once; queries are the last q_len of the k_len positions."""
        rows, q_len, k_len = q.shape[0], q.shape[-2], k.shape[-2]
        k, v, bias = share_rows(k, rows), share_rows(v, rows), share_rows(bias, rows)
        if causal and q_len > 1:  # one query at the newest position (a decoding step) sees all
            bias = with_causal_bias(bias, q_len, k_len, q.dtype, q.device)
        a_keys, a_values = self.relative(q_len, k_len, q.device)
        dropout_p = self.dropout if self.training else 0.0
        out, weights = relative_attention(q, k, v, a_keys, a_values, bias, dropout_p)
        return out, (weights if need_weights else None)


def self_attention(
    d_model: int,
    n_heads: int,
    dropout: float = 0.0,
    shaw_max_distance: int | None = None,
    shaw_values: bool = True,
) -> MultiHeadAttention:
    """A layer's self-attention: plain, or Shaw et al.'s when given their clipping distance k."""
    if shaw_max_distance is None:
        return MultiHeadAttention(d_model, n_heads, dropout)
    return RelativeMultiHeadAttention(d_model, n_heads, dropout, shaw_max_distance, shaw_values)
