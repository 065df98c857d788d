"""Positional schemes (attnlab.nn.positions): each checked against its defining property.

References are computed independently here (numpy formulas, the ALiBi paper's slope recipe,
rotation matrices built from the sinusoid's angle-addition identity), never read back from
the code under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from attnlab.config import POSITION_ENCODINGS
from attnlab.errors import AttnlabError
from attnlab.nn.attention import apply_rotary
from attnlab.nn.positions import (
    ALiBi,
    IntegerPositions,
    LearnedPositions,
    NormalizedPositions,
    PositionEncoding,
    RelativePositionBias,
    RotaryPositions,
    SinusoidalPositions,
    alibi_slopes,
    alternating_signs,
    build_position_encoding,
    relative_buckets,
    sinusoidal_table,
)

D_MODEL, N_POS = 16, 64


def numpy_sinusoid(n_positions: int, d_model: int) -> np.ndarray:
    """Vaswani et al. section 3.5, written out element by element."""
    pe = np.zeros((n_positions, d_model))
    for pos in range(n_positions):
        for i in range(0, d_model, 2):
            angle = pos / 10000 ** (i / d_model)
            pe[pos, i] = math.sin(angle)
            if i + 1 < d_model:
                pe[pos, i + 1] = math.cos(angle)
    return pe


# --- sinusoidal -------------------------------------------------------------------------------


@pytest.mark.parametrize("d_model", [16, 7])
def test_sinusoidal_table_matches_the_paper_formula(d_model: int) -> None:
    table = sinusoidal_table(N_POS, d_model)
    assert table.shape == (N_POS, d_model) and table.dtype == torch.float32
    np.testing.assert_allclose(table.numpy(), numpy_sinusoid(N_POS, d_model), atol=1e-6)


def test_sinusoidal_embed_looks_up_the_table_and_is_not_trained() -> None:
    pe = SinusoidalPositions(D_MODEL, N_POS)
    positions = torch.tensor([0, 5, 63])
    expected = numpy_sinusoid(N_POS, D_MODEL)[[0, 5, 63]]
    np.testing.assert_allclose(pe.embed(positions).numpy(), expected, atol=1e-6)
    assert list(pe.parameters()) == []
    assert "table" not in pe.state_dict()  # rebuilt from the formula, not saved


def offset_map(k: int, d_model: int) -> np.ndarray:
    """M_k with PE(pos + k) = M_k PE(pos): a 2x2 rotation by k * w_i on each (sin, cos) pair.

    From sin(a + b) = sin a cos b + cos a sin b and cos(a + b) = cos a cos b - sin a sin b.
    """
    m = np.zeros((d_model, d_model))
    for i in range(0, d_model, 2):
        w = 1.0 / 10000 ** (i / d_model)
        c, s = math.cos(k * w), math.sin(k * w)
        m[i : i + 2, i : i + 2] = [[c, s], [-s, c]]
    return m


@pytest.mark.parametrize("k", [1, 3, 10, 25])
def test_sinusoidal_offset_is_one_fixed_linear_map_for_every_position(k: int) -> None:
    table = SinusoidalPositions(D_MODEL, N_POS).table.double().numpy()
    m_k = offset_map(k, D_MODEL)
    shifted = table[: N_POS - k] @ m_k.T  # row pos -> M_k PE(pos)
    np.testing.assert_allclose(shifted, table[k:], atol=1e-5)
    # the map is orthogonal (a rotation), so it keeps every code's norm
    np.testing.assert_allclose(m_k @ m_k.T, np.eye(D_MODEL), atol=1e-12)


def test_positions_past_the_table_are_an_error() -> None:
    for pe in (SinusoidalPositions(D_MODEL, 8), LearnedPositions(D_MODEL, 8)):
        pe.embed(torch.arange(8))
        with pytest.raises(AttnlabError, match="max_positions"):
            pe.embed(torch.arange(9))


# --- learned ----------------------------------------------------------------------------------


def test_learned_positions_are_one_trainable_vector_per_position() -> None:
    torch.manual_seed(0)
    pe = LearnedPositions(D_MODEL, N_POS)
    assert isinstance(pe.weight, nn.Parameter) and pe.weight.requires_grad
    assert pe.weight.shape == (N_POS, D_MODEL)
    assert [p for p in pe.parameters()] == [pe.weight]
    positions = torch.tensor([2, 2, 7])
    out = pe.embed(positions)
    assert out.shape == (3, D_MODEL)
    torch.testing.assert_close(out, pe.weight.detach()[[2, 2, 7]])
    out.sum().backward()
    grad_rows = pe.weight.grad.abs().sum(-1).nonzero().flatten().tolist()
    assert grad_rows == [2, 7]
    assert torch.all(pe.weight.grad[2] == 2.0)  # used twice


# --- the two teaching baselines ---------------------------------------------------------------


def test_normalized_gives_one_position_different_codes_in_different_lengths() -> None:
    pe = NormalizedPositions(D_MODEL)
    positions = torch.arange(10)
    lengths = torch.tensor([5, 10])
    out = pe.embed(positions, lengths)  # (batch, seq, d_model)
    assert out.shape == (2, 10, D_MODEL)
    # position 2 is 2/4 in a 5-token sentence and 2/9 in a 10-token one: the notes' defect
    assert out[0, 2, 0].item() == pytest.approx(2 / 4)
    assert out[1, 2, 0].item() == pytest.approx(2 / 9)
    assert out[0, 2, 0] != out[1, 2, 0]
    # each real sequence spans exactly [0, 1], the value times +1, -1, +1, ... on the dimensions
    for b, n in enumerate(lengths.tolist()):
        real = out[b, :n]
        assert real[:, 0].min().item() == 0.0 and real[:, 0].max().item() == pytest.approx(1.0)
        np.testing.assert_allclose(real[:, 0].numpy(), np.arange(n) / (n - 1), atol=1e-7)
        assert torch.equal(real, real[:, :1] * alternating_signs(D_MODEL))
    assert out[..., 0].min() >= 0 and out[..., 0].max() <= 1  # padding is clamped, not > 1


def test_normalized_without_lengths_uses_the_sequence_length() -> None:
    out = NormalizedPositions(4).embed(torch.arange(6))
    np.testing.assert_allclose(out[..., 0].flatten().numpy(), np.arange(6) / 5, atol=1e-7)


def test_integer_positions_grow_without_bound() -> None:
    pe = IntegerPositions(D_MODEL)
    out = pe.embed(torch.tensor([0, 1, 2, 99, 100_000]))
    assert out.shape == (5, D_MODEL)
    np.testing.assert_array_equal(out[:, 0].numpy(), [1, 2, 3, 100, 100_001])
    assert torch.equal(out, out[:, :1] * alternating_signs(D_MODEL))
    assert torch.all(out[1:, 0] > out[:-1, 0])


@pytest.mark.parametrize("d_model", [6, 7])
def test_baselines_add_their_scalar_along_a_direction_of_mean_zero(d_model: int) -> None:
    # LayerNorm subtracts each vector's mean: a code whose mean is not zero would partly (and a
    # constant one wholly) vanish at BERT's embedding LayerNorm.
    signs = alternating_signs(d_model)
    assert signs.sum().item() == 0 and set(signs.tolist()) <= {-1.0, 0.0, 1.0}
    assert signs.abs().sum().item() == 2 * (d_model // 2)
    for pe in (IntegerPositions(d_model), NormalizedPositions(d_model)):
        assert pe.embed(torch.arange(5)).sum(-1).abs().max().item() == 0


# --- T5 relative buckets ----------------------------------------------------------------------


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_buckets_exact_small_offsets_and_range(bidirectional: bool) -> None:
    n_buckets, max_distance = 32, 128
    half = n_buckets // 2 if bidirectional else n_buckets
    exact = half // 2
    offsets = torch.arange(-400, 401)
    buckets = relative_buckets(offsets, n_buckets, max_distance, bidirectional)
    assert buckets.dtype == torch.long
    assert buckets.min() >= 0 and buckets.max() < n_buckets
    # the past (key before query, negative offset): distance d < exact gets bucket d, all distinct
    past = relative_buckets(-torch.arange(exact), n_buckets, max_distance, bidirectional)
    assert past.tolist() == list(range(exact))
    if bidirectional:
        # the future gets the upper half, again exact for small distances
        future = relative_buckets(torch.arange(1, exact), n_buckets, max_distance, True)
        assert future.tolist() == [half + d for d in range(1, exact)]
        assert torch.all(buckets[offsets > 0] >= half)
        assert torch.all(buckets[offsets <= 0] < half)
    else:
        # a causal model never looks ahead: every future offset shares bucket 0
        assert torch.all(buckets[offsets >= 0] == 0)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_buckets_grow_with_distance_and_saturate(bidirectional: bool) -> None:
    n_buckets, max_distance = 32, 128
    half = n_buckets // 2 if bidirectional else n_buckets
    exact = half // 2
    distance = torch.arange(0, 500)
    for sign in (-1, 1) if bidirectional else (-1,):
        b = relative_buckets(sign * distance, n_buckets, max_distance, bidirectional)
        b = b - (half if sign > 0 else 0) * (distance > 0)
        assert torch.all(b[1:] >= b[:-1])  # monotone non-decreasing in distance
        assert torch.all(b[distance >= max_distance] == half - 1)  # saturated
        assert torch.all(b[distance < max_distance] <= half - 1)
        # log-spaced: far fewer buckets than distances between exact and max_distance
        far = b[(distance >= exact) & (distance < max_distance)]
        assert far.min() == exact and len(far.unique()) == half - exact


def t5_bucket_reference(rel: int, n_buckets: int, max_distance: int) -> int:
    """Raffel et al.'s bidirectional bucket for one offset, in plain Python."""
    n = n_buckets // 2
    out = n if rel > 0 else 0
    d = abs(rel)
    exact = n // 2
    if d < exact:
        return out + d
    large = exact + int(math.log(d / exact) / math.log(max_distance / exact) * (n - exact))
    return out + min(large, n - 1)


def test_relative_buckets_match_a_scalar_reference() -> None:
    offsets = list(range(-200, 201))
    got = relative_buckets(torch.tensor(offsets), 32, 128, True).tolist()
    assert got == [t5_bucket_reference(r, 32, 128) for r in offsets]


def test_relative_bias_is_per_head_and_toeplitz() -> None:
    torch.manual_seed(0)
    n_heads, q_len, k_len = 3, 5, 7
    rpb = RelativePositionBias(n_heads, n_buckets=8, max_distance=16)
    bias = rpb.attention_bias(torch.arange(q_len), torch.arange(k_len))
    assert bias.shape == (1, n_heads, q_len, k_len)
    table = rpb.bias.weight.detach()  # (buckets, heads)
    for i in range(q_len):
        for j in range(k_len):
            # depends only on k - q ...
            if i > 0 and j > 0:
                assert torch.equal(bias[0, :, i, j], bias[0, :, i - 1, j - 1])
            # ... through that offset's bucket, one learned scalar per head
            bucket = t5_bucket_reference(j - i, 8, 16)
            assert torch.equal(bias[0, :, i, j], table[bucket])
    assert not torch.allclose(bias[0, 0], bias[0, 1])  # heads differ
    # shifting both position ranges changes nothing
    shifted = rpb.attention_bias(torch.arange(q_len) + 40, torch.arange(k_len) + 40)
    assert torch.equal(shifted, bias)
    bias.sum().backward()
    assert rpb.bias.weight.grad is not None


# --- ALiBi ------------------------------------------------------------------------------------


def alibi_paper_slopes(n: int) -> list[float]:
    """Press et al. 2022's get_slopes, written out again from the paper's recipe."""

    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_two(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_two(closest) + alibi_paper_slopes(2 * closest)[0::2][: n - closest]


def test_alibi_slopes_for_eight_heads_are_powers_of_one_half() -> None:
    expected = [1 / 2**h for h in range(1, 9)]
    np.testing.assert_allclose(alibi_slopes(8).numpy(), expected, rtol=1e-7)


@pytest.mark.parametrize("n_heads", [1, 2, 4, 6, 12, 16, 20])
def test_alibi_slopes_follow_the_paper_recipe(n_heads: int) -> None:
    slopes = alibi_slopes(n_heads)
    assert slopes.shape == (n_heads,)
    np.testing.assert_allclose(slopes.numpy(), alibi_paper_slopes(n_heads), rtol=1e-6)
    assert len(set(slopes.tolist())) == n_heads and bool(torch.all(slopes > 0))


def test_alibi_slopes_for_twelve_heads_explicitly() -> None:
    # 8 heads of 2^(-8/8 k), then every other slope of the 16-head sequence 2^(-k/2)
    expected = [2.0**-k for k in range(1, 9)] + [2.0 ** -(k / 2) for k in (1, 3, 5, 7)]
    np.testing.assert_allclose(alibi_slopes(12).numpy(), expected, rtol=1e-6)


def test_alibi_bias_is_minus_slope_times_distance() -> None:
    n_heads, q_len, k_len = 4, 5, 6
    alibi = ALiBi(n_heads)
    bias = alibi.attention_bias(torch.arange(q_len), torch.arange(k_len))
    assert bias.shape == (1, n_heads, q_len, k_len)
    slopes = np.array(alibi_paper_slopes(n_heads))
    i, j = np.arange(q_len)[:, None], np.arange(k_len)[None, :]
    expected = -slopes[:, None, None] * np.abs(i - j)[None]
    np.testing.assert_allclose(bias[0].numpy(), expected, rtol=1e-6)
    assert list(alibi.parameters()) == []  # nothing is learned


# --- RoPE -------------------------------------------------------------------------------------


def rotate(x: torch.Tensor, positions: torch.Tensor, rope: RotaryPositions) -> torch.Tensor:
    return apply_rotary(x, rope.rotary(positions))


def test_rope_scores_depend_only_on_the_offset() -> None:
    torch.manual_seed(0)
    d_head = 8
    rope = RotaryPositions(d_head)
    q, k = torch.randn(1, 1, 1, d_head), torch.randn(1, 1, 1, d_head)
    for m, n in [(0, 0), (3, 1), (2, 7), (10, 4)]:
        base = (rotate(q, torch.tensor([m]), rope) * rotate(k, torch.tensor([n]), rope)).sum()
        for s in (1, 5, 17, 60):
            q_s = rotate(q, torch.tensor([m + s]), rope)
            k_s = rotate(k, torch.tensor([n + s]), rope)
            assert (q_s * k_s).sum().item() == pytest.approx(base.item(), abs=1e-4)
    # and the score does change with the offset (the position is really there)
    at = [
        (rotate(q, torch.tensor([0]), rope) * rotate(k, torch.tensor([d]), rope)).sum()
        for d in (0, 1, 2)
    ]
    assert len({round(float(a), 4) for a in at}) == 3


def test_rope_is_a_norm_preserving_rotation_matching_the_formula() -> None:
    torch.manual_seed(1)
    d_head, seq = 8, 6
    rope = RotaryPositions(d_head)
    x = torch.randn(2, 3, seq, d_head)
    y = apply_rotary(x, rope.rotary(torch.arange(seq)))
    assert y.shape == x.shape
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[:, :, 0], x[:, :, 0])  # position 0 is not rotated
    # dims (i, i + d/2) turn by angle pos * 10000^(-2i/d), as a complex number times e^{i theta}
    half = d_head // 2
    theta = np.arange(seq)[:, None] / 10000 ** (2 * np.arange(half) / d_head)[None, :]
    xn = x.double().numpy()
    z = (xn[..., :half] + 1j * xn[..., half:]) * np.exp(1j * theta)
    expected = np.concatenate([z.real, z.imag], axis=-1)
    np.testing.assert_allclose(y.numpy(), expected, atol=1e-5)


# --- the interface ----------------------------------------------------------------------------


def test_unknown_position_encoding_is_an_attnlab_error() -> None:
    with pytest.raises(AttnlabError, match="unknown position encoding 'wavelet'"):
        build_position_encoding("wavelet", D_MODEL, 4, N_POS)


@pytest.mark.parametrize("name", POSITION_ENCODINGS)
def test_every_configured_scheme_builds_and_answers_its_hooks(name: str) -> None:
    n_heads, seq = 4, 5
    pe = build_position_encoding(name, D_MODEL, n_heads, N_POS)
    assert isinstance(pe, PositionEncoding)
    positions = torch.arange(seq)
    emb = pe.embed(positions, torch.tensor([seq]))
    bias = pe.attention_bias(positions, positions)
    rot = pe.rotary(positions)
    hooks = {"embed": emb is not None, "bias": bias is not None, "rotary": rot is not None}
    expected = {
        "learned": "embed",
        "sinusoidal": "embed",
        "normalized": "embed",
        "integer": "embed",
        "relative_bias": "bias",
        "alibi": "bias",
        "rope": "rotary",
        "shaw": None,  # inside each self-attention layer (tests/test_shaw.py)
        "none": None,
    }[name]
    assert [h for h, on in hooks.items() if on] == ([expected] if expected else [])
    if emb is not None:
        assert emb.shape[-2:] == (seq, D_MODEL)
    if bias is not None:
        assert bias.shape == (1, n_heads, seq, seq)
    if rot is not None:
        assert rot[0].shape == rot[1].shape == (seq, D_MODEL // n_heads)


def _bert_and_seq2seq(position_encoding: str, norm_position: str = "post"):
    """A tiny BERT encoder and a tiny seq2seq model (pre- or post-LN) with this scheme, eval mode."""
    from attnlab.config import BertConfig, TransformerConfig
    from attnlab.models.bert import BertModel
    from attnlab.models.seq2seq import Transformer

    torch.manual_seed(0)
    bert = BertModel(
        BertConfig(
            vocab_size=50,
            d_model=32,
            n_layers=2,
            n_heads=4,
            d_ff=64,
            max_positions=32,
            position_encoding=position_encoding,
            norm_position=norm_position,
        )
    )
    seq2seq = Transformer(
        TransformerConfig(
            src_vocab_size=40,
            tgt_vocab_size=40,
            d_model=32,
            n_heads=4,
            d_ff=64,
            n_encoder_layers=2,
            n_decoder_layers=2,
            max_positions=32,
            position_encoding=position_encoding,
            norm_position=norm_position,
        )
    )
    return bert.eval(), seq2seq.eval()


@pytest.mark.parametrize("norm_position", ["post", "pre"])
@pytest.mark.parametrize("name", POSITION_ENCODINGS)
def test_every_scheme_but_none_tells_the_model_where_a_token_is(name, norm_position):
    # Self-attention is order-blind: without position, permuting the tokens only permutes the
    # outputs. Every scheme must break that inside a whole model, where a LayerNorm reads the
    # embeddings first (BERT; pre-LN layers); a scalar added to every dimension alike would be
    # removed by LayerNorm's mean subtraction, leaving the model as blind as "none".
    bert, seq2seq = _bert_and_seq2seq(name, norm_position)
    ids = torch.randint(1, 40, (2, 12))
    order = torch.randperm(12, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for param in [*bert.parameters(), *seq2seq.parameters()]:
            if param.dim() > 1:  # weights large enough that attention scores are not ~0
                param.normal_(std=0.3)
        out = bert(ids).last_hidden_state
        moved = (bert(ids[:, order]).last_hidden_state - out[:, order]).abs().max().item()
        memory = seq2seq.encode(ids)
        moved_s2s = (seq2seq.encode(ids[:, order]) - memory[:, order]).abs().max().item()
    if name == "none":
        assert moved < 1e-5 and moved_s2s < 1e-5
    else:
        assert moved > 1e-2 and moved_s2s > 1e-2


@pytest.mark.parametrize("name", POSITION_ENCODINGS)
def test_every_scheme_runs_in_a_model_cast_to_bf16(name):
    # model.to(torch.bfloat16) casts buffers too: position codes, rotations and biases must
    # follow the model's dtype (not mix float32 into bf16 products) and stay close to float32.
    bert, seq2seq = _bert_and_seq2seq(name)
    ids = torch.randint(1, 40, (2, 12))
    with torch.no_grad():
        want = bert(ids).last_hidden_state
        got = bert.to(torch.bfloat16)(ids).last_hidden_state
        want_s2s = seq2seq(ids, ids[:, :7])["logits"]
        got_s2s = seq2seq.to(torch.bfloat16)(ids, ids[:, :7])["logits"]
    assert got.dtype == torch.bfloat16 and got_s2s.dtype == torch.bfloat16
    assert (got.float() - want).abs().max() < 0.1 * want.abs().max()
    assert (got_s2s.float() - want_s2s).abs().max() < 0.1 * want_s2s.abs().max() + 0.05
