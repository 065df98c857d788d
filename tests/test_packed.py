"""Linear layers on pre-packed weights (attnlab.nn.packed): equal to F.linear, used only where
they may be, and gone after the block; decoding with them equals decoding without."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnlab.config import TransformerConfig
from attnlab.decode import beam_search
from attnlab.models.seq2seq import Transformer
from attnlab.nn.packed import PackedLinear, can_pack, packed_linears

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_transformer(tie_output: bool) -> Transformer:
    """A seeded 2+2-layer Transformer over a 40-token vocabulary, in eval mode."""
    config = TransformerConfig(
        src_vocab_size=40, tgt_vocab_size=40, d_model=32, n_heads=4, d_ff=64,
        n_encoder_layers=2, n_decoder_layers=2, max_positions=32, tie_output=tie_output,
    )  # fmt: skip
    torch.manual_seed(0)
    return Transformer(config).eval()


def test_cpu_fp32_weights_are_packed_here() -> None:
    # The x86 CPU wheels of torch ship oneDNN: the fast path must really run in CI.
    weight = torch.randn(8, 4)
    assert can_pack(weight)
    assert PackedLinear(weight).packed is not None
    assert not can_pack(weight.to(torch.bfloat16))


@pytest.mark.parametrize("shape", [(5, 48), (3, 7, 48), (1, 48)])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("relu", [False, True])
def test_packed_linear_equals_f_linear(shape: tuple[int, ...], with_bias: bool, relu: bool) -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(300, 48), torch.randn(300) if with_bias else None
    x = torch.randn(*shape)
    with torch.inference_mode():
        got = PackedLinear(weight, bias)(x, relu=relu)
    want = F.linear(x, weight, bias)
    want = F.relu(want) if relu else want
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the plain path (gradients on) applies the same ReLU
    torch.testing.assert_close(PackedLinear(weight, bias)(x, relu=relu), want)


def test_packed_linear_falls_back_where_gradients_are_needed() -> None:
    linear = nn.Linear(6, 4)
    x = torch.randn(3, 6, requires_grad=True)
    y = PackedLinear(linear.weight, linear.bias)(x)
    y.sum().backward()  # the packed op has no backward: this must be the plain path
    torch.testing.assert_close(x.grad, linear.weight.sum(0).expand(3, -1))
    torch.testing.assert_close(linear.weight.grad, x.sum(0).expand(4, -1).detach())
    torch.testing.assert_close(linear.bias.grad, torch.full((4,), 3.0))


def test_packed_linear_under_bf16_autocast_takes_linears_bf16_route(monkeypatch) -> None:
    # Packed weights are fp32-only; under bf16 autocast a packed layer runs attnlab's linear(),
    # which on a CPU without fast bf16 products computes them by the fp32 kernel
    # (nn/linear.py), not PyTorch's slower bf16 kernel.
    import attnlab.nn.linear as linear_module

    monkeypatch.setattr(linear_module, "fast_bf16_matmul", lambda: False)
    calls = []
    apply = linear_module._Bf16Linear.apply
    monkeypatch.setattr(linear_module._Bf16Linear, "apply", lambda *a: calls.append(1) or apply(*a))
    layer = nn.Linear(6, 4)
    x = torch.randn(3, 6)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = PackedLinear(layer.weight, layer.bias)(x)
        want = F.linear(x, layer.weight, layer.bias)  # autocast's own bf16 product
    assert calls == [1] and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), want.float(), rtol=2**-7, atol=1e-3)


def test_packed_linears_patches_every_linear_and_restores_them() -> None:
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    x = torch.randn(4, 6)
    want = model(x)
    with torch.inference_mode(), packed_linears(model):
        assert all(isinstance(m.__dict__.get("forward"), PackedLinear) for m in model[::2])
        got = model(x)
        outer = model[0].__dict__["forward"]
        with packed_linears(model):  # nested: the outer packs stay, and stay after it
            assert model[0].__dict__["forward"] is outer
        assert model[0].__dict__["forward"] is outer
    assert all("forward" not in m.__dict__ for m in model)
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
    assert model(x).requires_grad  # training works again afterwards


@pytest.mark.parametrize("tie_output", [True, False])
def test_transformer_logits_and_beam_search_unchanged_by_packing(
    tie_output: bool, monkeypatch
) -> None:
    model = tiny_transformer(tie_output)
    src = torch.randint(3, 40, (3, 7))
    tgt = torch.randint(3, 40, (3, 5))
    with torch.inference_mode():
        want = model(src, tgt)["logits"]
        with model.packed():
            assert (model._tied_projection is not None) == tie_output
            got = model(src, tgt)["logits"]
    assert model._tied_projection is None
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

    # beam_search packs; the same search with packing switched off agrees.
    packed_out = beam_search(model, src, beam_size=3)
    monkeypatch.setattr(Transformer, "packed", lambda self: contextlib.nullcontext())
    assert beam_search(model, src, beam_size=3) == packed_out


def test_nested_packed_blocks_pack_once() -> None:
    model = tiny_transformer(tie_output=True)
    fc = model.decoder.layers[0].ffn.fc1
    with model.packed():
        outer, tied = fc.__dict__["forward"], model._tied_projection
        with model.packed():  # e.g. beam_search called inside a loop that packed already
            assert fc.__dict__["forward"] is outer and model._tied_projection is tied
        assert fc.__dict__["forward"] is outer  # the inner block leaves the outer one's packs
    assert "forward" not in fc.__dict__ and model._tied_projection is None
