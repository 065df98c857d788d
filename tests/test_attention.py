"""Attention (attnlab.nn.attention): both paths against numpy and against torch.nn.MultiheadAttention.

The fast path (PyTorch SDPA) and the explicit path (which also returns weights) must agree;
both must equal eq. (1) of Vaswani et al. written in numpy; multi-head attention must equal
PyTorch's own implementation given the same weights; cached decoding must equal a full pass.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

from attnlab.decode.cache import HeadMajorKVBuffer, KVBuffer, KVCache
from attnlab.errors import AttnlabError
from attnlab.fast import INFERENCE, chosen, swap
from attnlab.fast.attention import FastMultiHeadAttention, cpu_attention
from attnlab.fast.dropout import keep_mask
from attnlab.nn.attention import (
    MultiHeadAttention,
    apply_rotary,
    causal_mask,
    padding_bias,
    scaled_dot_product_attention,
)
from attnlab.nn.positions import RotaryPositions

B, H, D_HEAD = 2, 3, 4
D_MODEL = H * D_HEAD


def qkv(q_len: int, k_len: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, q_len, D_HEAD, generator=g, dtype=dtype)
    k = torch.randn(B, H, k_len, D_HEAD, generator=g, dtype=dtype)
    v = torch.randn(B, H, k_len, D_HEAD, generator=g, dtype=dtype)
    return q, k, v


def fast_twin(mha: MultiHeadAttention) -> FastMultiHeadAttention:
    """The same module (same weights) as its fast twin."""
    return swap(mha, chosen(INFERENCE, "attention"))


def numpy_attention(q, k, v, visible: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """softmax(Q K^T / sqrt(d)) V in float64; visible (broadcastable bool) hides keys where False."""
    q, k, v = (t.double().numpy() for t in (q, k, v))
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    if visible is not None:
        scores = np.where(visible, scores, -np.inf)
    scores = scores - scores.max(-1, keepdims=True)
    weights = np.exp(scores)
    weights = weights / weights.sum(-1, keepdims=True)
    return weights @ v, weights


MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])  # second row: 2 padded keys


# --- masks ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("q_len", "k_len"), [(4, 4), (1, 5), (3, 7)])
def test_causal_mask_is_bottom_right_aligned(q_len: int, k_len: int) -> None:
    expected = np.tril(np.ones((q_len, k_len), dtype=bool), k=k_len - q_len)
    np.testing.assert_array_equal(causal_mask(q_len, k_len).numpy(), expected)


def test_padding_bias_is_zero_on_kept_keys_and_most_negative_on_pads() -> None:
    bias = padding_bias(MASK, torch.float32)
    assert bias.shape == (2, 1, 1, 6) and bias.dtype == torch.float32
    assert torch.all(bias[MASK[:, None, None, :] == 1] == 0)
    assert torch.all(bias[MASK[:, None, None, :] == 0] == torch.finfo(torch.float32).min)


# --- scaled dot-product attention --------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_attention_equals_numpy_formula(dtype: torch.dtype) -> None:
    q, k, v = qkv(5, 6, dtype)
    expected_out, expected_w = numpy_attention(q, k, v)
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    for need_weights in (False, True):
        out, w = scaled_dot_product_attention(q, k, v, need_weights=need_weights)
        assert out.dtype == dtype
        np.testing.assert_allclose(out.double().numpy(), expected_out, atol=tol)
    np.testing.assert_allclose(w.double().numpy(), expected_w, atol=tol)


CASES = {
    "plain": dict(q_len=6, k_len=6, padded=False, causal=False),
    "padding": dict(q_len=6, k_len=6, padded=True, causal=False),
    "causal": dict(q_len=6, k_len=6, padded=False, causal=True),
    "padding+causal": dict(q_len=6, k_len=6, padded=True, causal=True),
    "cached-decoding": dict(q_len=2, k_len=6, padded=False, causal=True),
    "cached-decoding+padding": dict(q_len=1, k_len=6, padded=True, causal=True),
}


@pytest.mark.parametrize("case", CASES)
def test_explicit_path_equals_sdpa_path_and_numpy(case: str) -> None:
    c = CASES[case]
    q_len, k_len = c["q_len"], c["k_len"]
    q, k, v = qkv(q_len, k_len)
    bias = padding_bias(MASK, q.dtype) if c["padded"] else None
    fast, none = scaled_dot_product_attention(q, k, v, bias, c["causal"])
    slow, w = scaled_dot_product_attention(q, k, v, bias, c["causal"], need_weights=True)
    assert none is None and w.shape == (B, H, q_len, k_len)
    torch.testing.assert_close(fast, slow, atol=1e-6, rtol=1e-6)

    visible = np.ones((B, 1, q_len, k_len), dtype=bool)
    if c["padded"]:
        visible &= MASK.numpy().astype(bool)[:, None, None, :]
    if c["causal"]:
        visible &= np.tril(np.ones((q_len, k_len), dtype=bool), k=k_len - q_len)
    expected_out, expected_w = numpy_attention(q, k, v, visible)
    np.testing.assert_allclose(slow.numpy(), expected_out, atol=1e-6)
    np.testing.assert_allclose(w.numpy(), expected_w, atol=1e-6)
    # rows are distributions with nothing on hidden (padded or future) keys
    torch.testing.assert_close(w.sum(-1), torch.ones(B, H, q_len))
    hidden = torch.from_numpy(~np.broadcast_to(visible, w.shape))
    assert hidden.any() == (c["padded"] or c["causal"])
    assert torch.all(w[hidden] < 1e-30)


def test_cached_decoding_alignment_equals_last_rows_of_full_causal_pass() -> None:
    q, k, v = qkv(6, 6)
    full, _ = scaled_dot_product_attention(q, k, v, causal=True)
    for q_len in (1, 2, 5):
        tail, _ = scaled_dot_product_attention(q[:, :, -q_len:], k, v, causal=True)
        torch.testing.assert_close(tail, full[:, :, -q_len:], atol=1e-6, rtol=1e-6)


def test_causal_output_at_t_ignores_inputs_after_t() -> None:
    q, k, v = qkv(6, 6)
    out, _ = scaled_dot_product_attention(q, k, v, causal=True)
    t = 2
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for x in (q2, k2, v2):
        x[:, :, t + 1 :] += 10 * torch.randn_like(x[:, :, t + 1 :])
    out2, _ = scaled_dot_product_attention(q2, k2, v2, causal=True)
    torch.testing.assert_close(out2[:, :, : t + 1], out[:, :, : t + 1], atol=0, rtol=0)
    assert not torch.allclose(out2[:, :, t + 1 :], out[:, :, t + 1 :])


@pytest.mark.parametrize("need_weights", [False, True])
def test_causal_attention_over_query_rows_equals_those_rows_of_the_full_pass(
    need_weights: bool,
) -> None:
    # query_rows picks queries anywhere in the sequence; the causal mask must hide the keys
    # after each query's own position (it once hid those after the last q_len positions, and
    # none at all for a single row).
    torch.manual_seed(5)
    mha = MultiHeadAttention(D_MODEL, H).eval()
    x = torch.randn(B, 9, D_MODEL)
    full, full_w = mha(x, causal=True, need_weights=True)
    fast_twin(mha)
    for rows in (torch.tensor([[0, 3, 5], [1, 2, 8]]), torch.tensor([[2], [4]])):
        out, w = mha(x, causal=True, need_weights=need_weights, query_rows=rows)
        expected = full.gather(1, rows[..., None].expand(-1, -1, D_MODEL))
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
        if need_weights:
            index = rows[:, None, :, None].expand(-1, H, -1, full_w.shape[-1])
            torch.testing.assert_close(w, full_w.gather(2, index), atol=1e-6, rtol=1e-5)


def test_additive_bias_is_added_to_the_scores() -> None:
    q, k, v = qkv(4, 5)
    bias = torch.randn(1, H, 4, 5)
    out, w = scaled_dot_product_attention(q, k, v, bias, need_weights=True)
    scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(D_HEAD) + bias.double()
    expected_w = torch.softmax(scores, -1)
    torch.testing.assert_close(w.double(), expected_w, atol=1e-6, rtol=1e-6)
    fast, _ = scaled_dot_product_attention(q, k, v, bias)
    for path in (out, fast):
        torch.testing.assert_close(path.double(), expected_w @ v.double(), atol=1e-6, rtol=1e-6)


def test_apply_rotary_with_zero_angle_is_identity() -> None:
    q, _, _ = qkv(3, 3)
    zeros = torch.zeros(3, D_HEAD)
    assert torch.equal(apply_rotary(q, (zeros.cos(), zeros.sin())), q)


# --- multi-head attention vs torch.nn.MultiheadAttention --------------------------------------


def reference_mha(ours: MultiHeadAttention) -> nn.MultiheadAttention:
    """nn.MultiheadAttention holding our weights (its in_proj is [W_q; W_k; W_v])."""
    ref = nn.MultiheadAttention(D_MODEL, H, batch_first=True)
    with torch.no_grad():
        if ours.cross:
            ref.in_proj_weight.copy_(torch.cat((ours.q_proj.weight, ours.kv_proj.weight)))
            ref.in_proj_bias.copy_(torch.cat((ours.q_proj.bias, ours.kv_proj.bias)))
        else:
            ref.in_proj_weight.copy_(ours.qkv_proj.weight)
            ref.in_proj_bias.copy_(ours.qkv_proj.bias)
        ref.out_proj.weight.copy_(ours.out_proj.weight)
        ref.out_proj.bias.copy_(ours.out_proj.bias)
    return ref.eval()


@pytest.mark.parametrize("need_weights", [False, True])
def test_self_attention_equals_torch_multihead_attention(need_weights: bool) -> None:
    torch.manual_seed(0)
    mha = MultiHeadAttention(D_MODEL, H).eval()
    ref = reference_mha(mha)
    x = torch.randn(B, 6, D_MODEL)
    with torch.no_grad():
        cache = KVCache(n_layers=1)  # holds the keys and values attended to
        out, w = mha(x, bias=padding_bias(MASK, x.dtype), cache=cache, need_weights=need_weights)
        k, v = cache.self_kv[0].kv
        # need_weights=True keeps PyTorch off its fused fast path (which zeroes padded rows)
        ref_out, ref_w = ref(
            x, x, x, key_padding_mask=MASK == 0, need_weights=True, average_attn_weights=False
        )
    assert out.shape == (B, 6, D_MODEL) and k.shape == v.shape == (B, H, 6, D_HEAD)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    if need_weights:
        torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-5)
    else:
        assert w is None


def test_causal_self_attention_equals_torch_with_causal_mask() -> None:
    torch.manual_seed(1)
    mha = MultiHeadAttention(D_MODEL, H).eval()
    ref = reference_mha(mha)
    x = torch.randn(B, 5, D_MODEL)
    future = ~causal_mask(5, 5)  # True = not allowed, PyTorch's convention
    with torch.no_grad():
        out, _ = mha(x, causal=True)
        ref_out, _ = ref(x, x, x, attn_mask=future, need_weights=True)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)


def test_cross_attention_equals_torch_multihead_attention() -> None:
    torch.manual_seed(2)
    mha = MultiHeadAttention(D_MODEL, H, cross=True).eval()
    assert not hasattr(mha, "qkv_proj")
    ref = reference_mha(mha)
    x, memory = torch.randn(B, 4, D_MODEL), torch.randn(B, 6, D_MODEL)
    with torch.no_grad():
        cache = KVCache(n_layers=1)
        out, w = mha(x, memory, bias=padding_bias(MASK, x.dtype), cache=cache, need_weights=True)
        k, _ = cache.cross(0)
        ref_out, ref_w = ref(
            x,
            memory,
            memory,
            key_padding_mask=MASK == 0,
            need_weights=True,
            average_attn_weights=False,
        )
        # the cached memory keys/values replace the memory
        again, _ = mha(x, None, bias=padding_bias(MASK, x.dtype), cache=cache)
    assert k.shape == (B, H, 6, D_HEAD)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(again, out, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("twin", [False, True])
@pytest.mark.parametrize("q_len", [1, 4])
def test_cross_attention_shared_by_groups_equals_repeated_memory(q_len: int, twin: bool) -> None:
    # Beam search: the k beams of a sentence (consecutive rows) attend to one memory row; the
    # plain module repeats it per beam, the fast twin reads it in place.
    torch.manual_seed(3)
    mha = MultiHeadAttention(D_MODEL, H, cross=True).eval()
    group = 3
    x, memory = torch.randn(B * group, q_len, D_MODEL), torch.randn(B, 6, D_MODEL)
    bias = padding_bias(MASK, x.dtype)
    with torch.no_grad():
        copied, w_ref = mha(
            x, memory.repeat_interleave(group, 0), bias=bias.repeat_interleave(group, 0),
            need_weights=True,
        )  # fmt: skip
        if twin:
            fast_twin(mha)
        cache = KVCache(n_layers=1)
        shared, w = mha(x, memory, bias=bias, cache=cache, need_weights=True)
        cached, _ = mha(x, None, bias=bias, cache=cache)
    assert cache.cross(0)[0].shape[0] == B  # the cache keeps one row per sentence
    torch.testing.assert_close(shared, copied, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(cached, copied, atol=1e-6, rtol=1e-5)
    with pytest.raises(AttnlabError, match="share"):
        mha(torch.randn(B * group + 1, q_len, D_MODEL), memory)


# --- KV cache ---------------------------------------------------------------------------------


@pytest.mark.parametrize("twin", [False, True])
@pytest.mark.parametrize("use_rope", [False, True])
def test_token_by_token_with_a_cache_equals_full_causal_pass(use_rope: bool, twin: bool) -> None:
    torch.manual_seed(3)
    seq = 7
    mha = MultiHeadAttention(D_MODEL, H).eval()
    if twin:
        fast_twin(mha)
    rotary = RotaryPositions(D_HEAD)
    x = torch.randn(B, seq, D_MODEL)
    with torch.no_grad():
        full_rope = rotary.rotary(torch.arange(seq)) if use_rope else None
        whole = KVCache(n_layers=1)  # only to read the keys and values of the full pass
        full, _ = mha(x, causal=True, rope=full_rope, cache=whole)
        k_full, v_full = whole.self_kv[0].kv
        cache, steps = KVCache(n_layers=1), []
        for t in range(seq):
            rope = rotary.rotary(torch.tensor([t])) if use_rope else None
            out, _ = mha(x[:, t : t + 1], causal=True, rope=rope, cache=cache)
            steps.append(out)
            k, v = cache.self_kv[0].kv
            assert cache.length == t + 1 and k.shape == v.shape == (B, H, t + 1, D_HEAD)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(cache.self_kv[0].kv[0], k_full, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(cache.self_kv[0].kv[1], v_full, atol=1e-6, rtol=1e-6)


BUFFERS = [KVBuffer, HeadMajorKVBuffer]  # position-major (beam search) and head-major (sampling)


@pytest.mark.parametrize("layout", BUFFERS)
def test_kv_buffer_grows_and_reorders_like_cat_and_index_select(layout) -> None:
    # The reference is what the buffer replaces: torch.cat per step, index_select per reorder.
    torch.manual_seed(4)
    buffer, ref_k, ref_v = layout(), torch.empty(3, H, 0, D_HEAD), torch.empty(3, H, 0, D_HEAD)
    reorders = {5: [2, 0, 0], 9: [1, 1, 2], 20: [0, 2], 33: [1, 0, 0, 1]}  # rows change too
    for step in range(40):  # past the first capacity (16) and its doubling (34)
        rows = ref_k.shape[0]
        k, v = torch.randn(rows, H, 1, D_HEAD), torch.randn(rows, H, 1, D_HEAD)
        got_k, got_v = buffer.append(k, v)
        ref_k, ref_v = torch.cat((ref_k, k), 2), torch.cat((ref_v, v), 2)
        assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)
        if step in reorders:
            index = torch.tensor(reorders[step])
            buffer.select_rows(index)
            ref_k, ref_v = ref_k.index_select(0, index), ref_v.index_select(0, index)
            assert torch.equal(buffer.kv[0], ref_k) and torch.equal(buffer.kv[1], ref_v)
    assert buffer.length == 40 and buffer.kv[0].shape == (4, H, 40, D_HEAD)


@pytest.mark.parametrize("layout", BUFFERS)
def test_kv_cache_copy_rows_reads_every_source_before_writing(layout) -> None:
    # Row 3 is both a source and a destination: the copy must use its old contents.
    torch.manual_seed(5)
    cache = KVCache(n_layers=1, buffer=layout)
    buffer = cache.self_kv[0]
    k, v = torch.randn(4, H, 3, D_HEAD), torch.randn(4, H, 3, D_HEAD)
    buffer.append(k, v)
    cache.copy_rows(torch.tensor([1, 3]), torch.tensor([3, 0]))
    rows = torch.tensor([0, 3, 2, 0])  # the same result as a whole-buffer reorder
    assert torch.equal(buffer.kv[0], k[rows]) and torch.equal(buffer.kv[1], v[rows])
    # later steps append after the copied positions as usual
    k2, v2 = torch.randn(4, H, 1, D_HEAD), torch.randn(4, H, 1, D_HEAD)
    got_k, _ = buffer.append(k2, v2)
    assert torch.equal(got_k, torch.cat((k[rows], k2), 2))


@pytest.mark.parametrize("layout", BUFFERS)
def test_kv_cache_copy_rows_from_start_positions_keeps_the_rows_before(layout) -> None:
    # Pair (3 -> 1) from position 2, pair (0 -> 3) from 3: row 3 is read before it is written.
    torch.manual_seed(6)
    cache = KVCache(n_layers=2, buffer=layout)
    kv = [(torch.randn(4, H, 5, D_HEAD), torch.randn(4, H, 5, D_HEAD)) for _ in range(2)]
    for buffer, (k, v) in zip(cache.self_kv, kv, strict=True):
        buffer.append(k, v)  # 5 positions in a capacity of 16
    cache.copy_rows(torch.tensor([1, 3]), torch.tensor([3, 0]), start=torch.tensor([2, 3]))
    for buffer, pair in zip(cache.self_kv, kv, strict=True):
        for got, old in zip(buffer.kv, pair, strict=True):
            expected = old.clone()
            expected[1, :, 2:] = old[3, :, 2:]
            expected[3, :, 3:] = old[0, :, 3:]
            assert torch.equal(got, expected)


def test_kv_cache_slots_length_and_reorder() -> None:
    cache = KVCache(n_layers=2)
    assert all(b.length == 0 for b in cache.self_kv) and cache.cross_kv == [None, None]
    assert cache.length == 0
    k = torch.arange(3.0).view(3, 1, 1, 1).expand(3, H, 4, D_HEAD).clone()
    v = -k
    cache.self_kv[0].append(k, v)
    cache.cross_kv[0] = (k + 10, v - 10)
    assert cache.length == 4
    cache.reorder(torch.tensor([2, 0, 0, 1]), torch.tensor([2, 0, 0, 1]))
    sk, sv = cache.self_kv[0].kv
    assert sk.shape == (4, H, 4, D_HEAD)
    assert sk[:, 0, 0, 0].tolist() == [2.0, 0.0, 0.0, 1.0]
    assert sv[:, 0, 0, 0].tolist() == [-2.0, 0.0, 0.0, -1.0]
    assert cache.cross_kv[0][0][:, 0, 0, 0].tolist() == [12.0, 10.0, 10.0, 11.0]
    assert cache.cross_kv[0][1][:, 0, 0, 0].tolist() == [-12.0, -10.0, -10.0, -11.0]
    assert cache.self_kv[1].length == 0 and cache.cross_kv[1] is None
    # every row of a selected sample is carried whole
    assert torch.equal(sk[0], k[2]) and torch.equal(sk[3], k[1])
    # without cross_index the cross-attention rows stay as they are (beams share them)
    cache.reorder(torch.tensor([3, 0]))
    assert cache.self_kv[0].kv[0][:, 0, 0, 0].tolist() == [1.0, 2.0]
    assert cache.cross_kv[0][0].shape[0] == 4


def test_missing_keys_and_values_are_a_clear_error() -> None:
    x = torch.randn(2, 1, D_MODEL)
    with pytest.raises(AttnlabError, match="cross-attention needs memory or cached keys"):
        MultiHeadAttention(D_MODEL, H, cross=True)(x, cache=KVCache(n_layers=1))
    twin = fast_twin(MultiHeadAttention(D_MODEL, H))
    with pytest.raises(AttnlabError, match="query_rows serves self-attention without a cache"):
        twin(x, cache=KVCache(n_layers=1), query_rows=torch.zeros(2, 1, dtype=torch.long))


# --- the fast twin in training: attention dropout ----------------------------------------------


def test_fast_attention_dropout_equals_the_formula_with_the_same_mask() -> None:
    # Training-mode attention on CPU: softmax(q k^T / sqrt(d) + bias), the mask's entries
    # zeroed, the rest scaled, times v. The mask is redrawn from the same seed.
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 7, 8, generator=g) for _ in range(3))
    keep = torch.ones(2, 7, dtype=torch.long)
    keep[1, 5:] = 0
    bias = padding_bias(keep, torch.float32)
    torch.manual_seed(6)
    out, _ = cpu_attention(q, k, v, bias, dropout_p=0.25)
    torch.manual_seed(6)
    drop = keep_mask((2, 3, 7, 7), 0.25, torch.device("cpu")) == 0
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(8) + bias, dim=-1)
    scale = 65536 / (65536 - round(0.25 * 65536))
    expected = weights.masked_fill(drop, 0.0) * scale @ v
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("attention", [scaled_dot_product_attention, cpu_attention])
def test_causal_attention_with_dropout_never_sees_the_future(attention) -> None:
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g) for _ in range(3))
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 4:] += 10.0
    v2[:, :, 4:] -= 10.0
    torch.manual_seed(8)
    a, _ = attention(q, k, v, causal=True, dropout_p=0.3)
    torch.manual_seed(8)
    b, _ = attention(q, k2, v2, causal=True, dropout_p=0.3)
    torch.testing.assert_close(a[:, :, :4], b[:, :, :4])
    assert not torch.allclose(a[:, :, 4:], b[:, :, 4:])


@pytest.mark.parametrize("case", ["self", "padded", "causal", "cross"])
def test_fast_training_attention_equals_plain_without_dropout(case: str) -> None:
    # Values and gradients of the twin's training routes against the plain module, where the
    # two draw no masks (they draw theirs differently: see the statistics test below).
    g = torch.Generator().manual_seed(21)
    plain = MultiHeadAttention(16, 4, dropout=0.0, cross=case == "cross").train()
    twin = fast_twin(copy.deepcopy(plain))
    x = torch.randn(3, 7, 16, generator=g, requires_grad=True)
    memory = torch.randn(3, 5, 16, generator=g, requires_grad=True) if case == "cross" else None
    keep = torch.ones(3, 5 if case == "cross" else 7, dtype=torch.long)
    keep[1, 3:] = 0
    bias = padding_bias(keep, torch.float32) if case in ("padded", "cross") else None
    upstream = torch.randn(3, 7, 16, generator=g)
    results = []
    for mha in (plain, twin):
        out, _ = mha(x, memory, bias, causal=case == "causal")
        inputs = [x, *([memory] if memory is not None else []), *mha.parameters()]
        results.append((out, torch.autograd.grad(out, inputs, upstream)))
    (a, a_grads), (b, b_grads) = results
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for ga, gb in zip(a_grads, b_grads, strict=True):
        torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-5)


def test_fast_training_attention_dropout_has_the_plain_expectation() -> None:
    # With dropout the plain module (PyTorch's mask) and the twin (fast dropout's mask) differ
    # draw by draw; both are unbiased: their means over many draws approach the output
    # without dropout, equally well.
    torch.manual_seed(22)
    plain = MultiHeadAttention(16, 4, dropout=0.3).train()
    twin = fast_twin(copy.deepcopy(plain))
    x = torch.randn(2, 6, 16)
    with torch.no_grad():
        expected, _ = plain.eval()(x)
        plain.train()
        errors = []
        for mha in (plain, twin):
            mean = sum(mha(x)[0] for _ in range(400)) / 400
            errors.append((mean - expected).abs().mean().item())
            assert not torch.allclose(mha(x)[0], expected)  # dropout is on
    assert max(errors) < 0.02 and max(errors) < 2.5 * min(errors) + 0.005


@pytest.mark.parametrize("case", ["self", "padded", "causal", "rows", "cross"])
def test_training_attention_equals_the_explicit_path_with_the_same_mask(case: str) -> None:
    # Training on CPU with attention dropout runs _DropoutAttention (projections in, heads
    # merged out, its own backward pass); need_weights=True runs the explicit path, autograd
    # over the formula. From the same seed they drop the same weights: same output, same
    # gradients for the inputs and every weight.
    g = torch.Generator().manual_seed(11)
    mha = fast_twin(MultiHeadAttention(16, 4, dropout=0.2, cross=case == "cross").train())
    x = torch.randn(3, 7, 16, generator=g, requires_grad=True)
    memory = torch.randn(3, 5, 16, generator=g, requires_grad=True) if case == "cross" else None
    keep = torch.ones(3, 5 if case == "cross" else 7, dtype=torch.long)
    keep[1, 3:] = 0
    bias = padding_bias(keep, torch.float32) if case in ("padded", "rows", "cross") else None
    rows = torch.tensor([[0, 2], [1, 2], [0, 6]]) if case == "rows" else None
    upstream = torch.randn(3, 2 if case == "rows" else 7, 16, generator=g)
    results = []
    for need_weights in (False, True):
        torch.manual_seed(12)
        out, weights = mha(
            x, memory, bias, causal=case == "causal", need_weights=need_weights, query_rows=rows
        )
        assert (weights is None) != need_weights  # each call took the path meant
        inputs = [x, *([memory] if memory is not None else []), *mha.parameters()]
        results.append((out, torch.autograd.grad(out, inputs, upstream)))
    (fused, fused_grads), (explicit, explicit_grads) = results
    torch.testing.assert_close(fused, explicit, rtol=1e-5, atol=1e-6)
    for a, b in zip(fused_grads, explicit_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_training_attention_trains_a_learned_bias() -> None:
    # A learned score bias (T5's relative positions, broadcast over the batch) plus padding:
    # _DropoutAttention gives it the explicit path's gradient (it once gave it none, so
    # relative_bias tables never trained on CPU with attention dropout), also through
    # query_rows, and in float64 the numerical one.
    g = torch.Generator().manual_seed(15)
    mha = fast_twin(MultiHeadAttention(16, 4, dropout=0.2).train())
    x = torch.randn(3, 7, 16, generator=g)
    learned = torch.randn(1, 4, 7, 7, generator=g, requires_grad=True)
    keep = torch.ones(3, 7, dtype=torch.long)
    keep[1, 4:] = 0
    for rows in (None, torch.tensor([[0, 2], [1, 3], [0, 6]])):
        upstream = torch.randn(3, 7 if rows is None else 2, 16, generator=g)
        grads = []
        for need_weights in (False, True):
            torch.manual_seed(16)
            bias = padding_bias(keep, torch.float32) + learned
            out, weights = mha(x, bias=bias, need_weights=need_weights, query_rows=rows)
            assert (weights is None) != need_weights
            grads.append(torch.autograd.grad(out, learned, upstream)[0])
        assert grads[0].abs().sum() > 0
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)

    mha.double()
    x64, learned64 = x.double(), learned.detach().double().requires_grad_()

    def attend(table: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(17)
        return mha(x64, bias=table)[0]

    assert torch.autograd.gradcheck(attend, (learned64,))


def test_training_attention_gradient_is_the_numerical_one() -> None:
    # float64 central differences through _DropoutAttention, the mask drawn from one seed
    # in every evaluation.
    g = torch.Generator().manual_seed(13)
    mha = fast_twin(MultiHeadAttention(8, 2, dropout=0.3).double().train())
    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=g, requires_grad=True)
    bias = padding_bias(torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]), torch.float64)

    def attend(x: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(14)
        return mha(x, bias=bias)[0]

    assert torch.autograd.gradcheck(attend, (x,))
