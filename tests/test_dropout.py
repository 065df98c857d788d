"""Fast dropout (attnlab.fast.dropout): the rate, the rescaling, the gradient, and dropout in attention.

References: the definition of inverted dropout (drop with probability p, scale the rest by
1 / (1 - p)), binomial tolerances for the rates, and eq. (1) of Vaswani et al. written out
with the same mask for attention dropout.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attnlab import fast
from attnlab.fast.attention import cpu_attention as scaled_dot_product_attention
from attnlab.fast.dropout import FastDropout, dropout, keep_mask
from attnlab.nn.attention import MultiHeadAttention, padding_bias


def training_attention(*args: object, **kwargs: object) -> MultiHeadAttention:
    """MultiHeadAttention(*args, **kwargs) in training mode with its fast twin swapped in."""
    return fast.for_training(MultiHeadAttention(*args, **kwargs), "attention").train()


N = 1 << 20  # elements: the rate is then known to about 3e-4 (one standard error at p = 0.1)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_drop_rate_and_scale_follow_the_definition(p: float) -> None:
    torch.manual_seed(0)
    x = torch.rand(N) + 0.5
    y = dropout(x, p)
    dropped = y == 0
    sd = math.sqrt(p * (1 - p) / N)
    assert abs(dropped.float().mean().item() - p) < 5 * sd
    rounded_p = round(p * 65536) / 65536  # the mask's resolution, documented in the module
    assert torch.allclose(y[~dropped], x[~dropped] / (1 - rounded_p), rtol=1e-6, atol=0)


def test_expectation_is_the_input() -> None:
    torch.manual_seed(1)
    ones = torch.ones(N)
    mean = dropout(ones, 0.1).mean().item()
    assert abs(mean - 1.0) < 5 * math.sqrt(0.1 * 0.9 / N) / 0.9


def test_the_four_values_drawn_together_are_independent() -> None:
    # One 64-bit draw gives four neighbouring elements: each lane has rate p, and two
    # neighbours are dropped together at rate p^2, not more.
    torch.manual_seed(2)
    p = 0.3
    drop = (keep_mask((N // 4, 4), p, torch.device("cpu")) == 0).float()
    sd = math.sqrt(p * (1 - p) / (N // 4))
    for lane in range(4):
        assert abs(drop[:, lane].mean().item() - p) < 5 * sd
    both = (drop[:, 0] * drop[:, 1]).mean().item()
    assert abs(both - p * p) < 5 * math.sqrt(p * p * (1 - p * p) / (N // 4))


def test_gradient_is_masked_and_scaled_like_the_output() -> None:
    torch.manual_seed(3)
    x = torch.randn(64, 33, requires_grad=True)
    y = dropout(x, 0.2)
    upstream = torch.randn_like(y)
    (y * upstream).sum().backward()
    kept = y != 0
    scale = 65536 / (65536 - round(0.2 * 65536))
    expected = torch.where(kept, upstream * scale, torch.zeros_like(upstream))
    torch.testing.assert_close(x.grad, expected, rtol=1e-6, atol=0)


def test_evaluation_zero_and_one() -> None:
    x = torch.randn(8, 8)
    assert dropout(x, 0.5, training=False) is x
    assert dropout(x, 0.0) is x
    assert torch.equal(dropout(x, 1.0), torch.zeros_like(x))
    module = fast.for_training(torch.nn.Dropout(0.5), "dropout").eval()
    assert type(module) is FastDropout and module(x) is x
    assert module.p == 0.5 and module.state_dict() == {}


def test_same_seed_same_mask() -> None:
    x = torch.randn(100, 100)
    torch.manual_seed(4)
    a = dropout(x, 0.1)
    torch.manual_seed(4)
    b = dropout(x, 0.1)
    assert torch.equal(a, b)


def test_attention_dropout_equals_the_formula_with_the_same_mask() -> None:
    # Training-mode attention on CPU: softmax(q k^T / sqrt(d) + bias), the mask's entries
    # zeroed, the rest scaled, times v. The mask is redrawn from the same seed.
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 7, 8, generator=g) for _ in range(3))
    keep = torch.ones(2, 7, dtype=torch.long)
    keep[1, 5:] = 0
    bias = padding_bias(keep, torch.float32)
    torch.manual_seed(6)
    out, _ = scaled_dot_product_attention(q, k, v, bias, dropout_p=0.25)
    torch.manual_seed(6)
    drop = keep_mask((2, 3, 7, 7), 0.25, torch.device("cpu")) == 0
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(8) + bias, dim=-1)
    scale = 65536 / (65536 - round(0.25 * 65536))
    expected = weights.masked_fill(drop, 0.0) * scale @ v
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_causal_attention_with_dropout_never_sees_the_future() -> None:
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g) for _ in range(3))
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 4:] += 10.0
    v2[:, :, 4:] -= 10.0
    torch.manual_seed(8)
    a, _ = scaled_dot_product_attention(q, k, v, causal=True, dropout_p=0.3)
    torch.manual_seed(8)
    b, _ = scaled_dot_product_attention(q, k2, v2, causal=True, dropout_p=0.3)
    torch.testing.assert_close(a[:, :, :4], b[:, :, :4])
    assert not torch.allclose(a[:, :, 4:], b[:, :, 4:])


def test_matches_torch_dropout_in_distribution() -> None:
    # Same rate and scale as F.dropout: equal means and equal fractions of zeros.
    torch.manual_seed(9)
    x = torch.rand(N) + 1.0
    ours, theirs = dropout(x, 0.1), F.dropout(x, 0.1)
    assert abs((ours == 0).float().mean() - (theirs == 0).float().mean()) < 0.003
    assert abs(ours.mean() - theirs.mean()) < 0.003


def test_fast_dropout_twin_is_the_plain_formula_with_its_mask() -> None:
    # nn.Dropout drops with F.dropout's mask, the twin with keep_mask's; given the twin's
    # mask, the plain formula h * keep / (1 - p) is what it computes, gradient included.
    h = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(20), requires_grad=True)
    module = fast.for_training(torch.nn.Dropout(0.3), "dropout")
    assert type(module) is FastDropout
    torch.manual_seed(21)
    keep = keep_mask(h.shape, 0.3, h.device)
    scale = 65536 / (65536 - round(0.3 * 65536))
    torch.manual_seed(21)
    out = module(h)
    torch.testing.assert_close(out, h * keep * scale, rtol=0, atol=1e-6)
    out.sum().backward()
    torch.testing.assert_close(h.grad, keep * scale, rtol=0, atol=1e-6)
    assert type(fast.to_plain(module)) is torch.nn.Dropout


@pytest.mark.parametrize("case", ["self", "padded", "causal", "rows", "cross"])
def test_training_attention_equals_the_explicit_path_with_the_same_mask(case: str) -> None:
    # Training on CPU with attention dropout runs _DropoutAttention (projections in, heads
    # merged out, its own backward pass); need_weights=True runs the explicit path, autograd
    # over the formula. From the same seed they drop the same weights: same output, same
    # gradients for the inputs and every weight.
    g = torch.Generator().manual_seed(11)
    mha = training_attention(16, 4, dropout=0.2, cross=case == "cross")
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
    mha = training_attention(16, 4, dropout=0.2)
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
    mha = training_attention(8, 2, dropout=0.3).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=g, requires_grad=True)
    bias = padding_bias(torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]), torch.float64)

    def attend(x: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(14)
        return mha(x, bias=bias)[0]

    assert torch.autograd.gradcheck(attend, (x,))
