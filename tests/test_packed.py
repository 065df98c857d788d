"""The inference twins on pre-packed weights (attnlab.fast.linear): equal to F.linear and to the
plain modules, used only where they may be, and gone after the block; decoding with them
equals decoding without."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnlab import fast
from attnlab.config import TransformerConfig
from attnlab.decode import beam_search
from attnlab.fast.linear import PackedFeedForward, PackedLinear, can_pack
from attnlab.models.seq2seq import Transformer
from attnlab.nn.blocks import FeedForward

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_transformer(tie_output: bool) -> Transformer:
    """A seeded 2+2-layer Transformer over a 40-token vocabulary, in eval mode."""
    config = TransformerConfig(
        src_vocab_size=40, tgt_vocab_size=40, d_model=32, n_heads=4, d_ff=64,
        n_encoder_layers=2, n_decoder_layers=2, max_positions=32, tie_output=tie_output,
    )  # fmt: skip
    torch.manual_seed(0)
    return Transformer(config).eval()


def packed(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedLinear:
    """An nn.Linear holding these values, swapped for its packed inference twin."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    fast.for_inference(layer, "packed")
    assert type(layer) is PackedLinear
    return layer


def test_cpu_fp32_weights_are_packed_here() -> None:
    # The x86 CPU wheels of torch ship oneDNN: the fast path must really run in CI.
    weight = torch.randn(8, 4)
    assert can_pack(weight)
    layer = packed(weight)
    with torch.inference_mode():
        layer(torch.randn(2, 4))
    assert "_packed" in layer.__dict__
    assert not can_pack(weight.to(torch.bfloat16))


@pytest.mark.parametrize("shape", [(5, 48), (3, 7, 48), (1, 48)])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("relu", [False, True])
def test_packed_linear_equals_f_linear(shape: tuple[int, ...], with_bias: bool, relu: bool) -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(300, 48), torch.randn(300) if with_bias else None
    x = torch.randn(*shape)
    layer = packed(weight, bias)
    with torch.inference_mode():
        got = layer.product(x, relu=relu)
    want = F.linear(x, weight, bias)
    want = F.relu(want) if relu else want
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the plain path (gradients on) applies the same ReLU
    torch.testing.assert_close(layer.product(x, relu=relu).detach(), want.detach())


def test_packed_linear_falls_back_where_gradients_are_needed() -> None:
    linear = nn.Linear(6, 4)
    x = torch.randn(3, 6, requires_grad=True)
    fast.for_inference(linear, "packed")
    y = linear(x)
    y.sum().backward()  # the packed op has no backward: this must be the plain path
    torch.testing.assert_close(x.grad, linear.weight.sum(0).expand(3, -1))
    torch.testing.assert_close(linear.weight.grad, x.sum(0).expand(4, -1).detach())
    torch.testing.assert_close(linear.bias.grad, torch.full((4,), 3.0))


def test_the_pack_follows_the_weight() -> None:
    # Built on first use, rebuilt once the weight changes (a training step between evaluations).
    layer = packed(torch.randn(5, 3))
    x = torch.randn(2, 3)
    with torch.no_grad():
        layer(x)
        first = layer.__dict__["_packed"]
        layer(x)
        assert layer.__dict__["_packed"] is first
        layer.weight.mul_(2.0)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        assert layer.__dict__["_packed"] is not first


def test_packed_linear_under_bf16_autocast_takes_linears_bf16_route(monkeypatch) -> None:
    # Packed weights are fp32-only; under bf16 autocast a packed layer runs fast/linear.py's
    # linear(), which on a CPU without fast bf16 products computes them by the fp32 kernel,
    # not PyTorch's slower bf16 kernel.
    import attnlab.fast.linear as linear_module

    monkeypatch.setattr(linear_module, "fast_bf16_matmul", lambda: False)
    calls = []
    apply = linear_module._Bf16Linear.apply
    monkeypatch.setattr(linear_module._Bf16Linear, "apply", lambda *a: calls.append(1) or apply(*a))
    layer = nn.Linear(6, 4)
    x = torch.randn(3, 6)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = layer(x)  # autocast's own bf16 product
        y = fast.for_inference(layer, "packed")(x)
    assert calls == [1] and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), want.float(), rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_packed_feed_forward_equals_the_plain_one(activation: str) -> None:
    torch.manual_seed(0)
    ffn = FeedForward(16, 40, activation)
    x = torch.randn(2, 5, 16)
    with torch.inference_mode():
        want = ffn(x)
        fast.for_inference(ffn, "packed,packed_relu")
        assert type(ffn) is PackedFeedForward and type(ffn.fc1) is PackedLinear
        torch.testing.assert_close(ffn(x), want, rtol=1e-5, atol=1e-5)
    fast.to_plain(ffn)
    assert type(ffn) is FeedForward and "_packed" not in ffn.fc1.__dict__


def test_inference_twins_swap_every_linear_and_restore_them() -> None:
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    x = torch.randn(4, 6)
    want = model(x)
    with torch.inference_mode(), fast.inference_twins(model, "packed"):
        assert all(type(m) is PackedLinear for m in model[::2])
        got = model(x)
    assert all(type(m) is nn.Linear and "_packed" not in m.__dict__ for m in model[::2])
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
    assert model(x).requires_grad  # training works again afterwards


def test_inference_twins_give_training_twins_back() -> None:
    model = nn.Sequential(nn.Linear(6, 3))
    fast.for_training(model, "linear")
    trained = type(model[0])
    with fast.inference_twins(model, "packed"):
        assert type(model[0]) is PackedLinear
    assert type(model[0]) is trained


@pytest.mark.parametrize("tie_output", [True, False])
def test_transformer_logits_and_beam_search_unchanged_by_the_inference_twins(
    tie_output: bool,
) -> None:
    model = tiny_transformer(tie_output)
    src = torch.randint(3, 40, (3, 7))
    tgt = torch.randint(3, 40, (3, 5))
    with torch.inference_mode():
        want = model(src, tgt)["logits"]
        plain_out = beam_search(model, src, beam_size=3)
        with fast.inference_twins(model):
            got = model(src, tgt)["logits"]
            fast_out = beam_search(model, src, beam_size=3)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert fast_out == plain_out


def test_packs_do_not_outlive_an_inference_block() -> None:
    # A fused optimiser changes the weights without moving their version: a twin used in
    # training and inference alike (the tied projection) packs afresh in each block.
    from attnlab.config import BertConfig
    from attnlab.models.bert import BertForPreTraining

    torch.manual_seed(0)
    model = BertForPreTraining(
        BertConfig(vocab_size=40, d_model=16, n_layers=1, n_heads=2, d_ff=32)
    )
    fast.for_training(model, "tied_projection")
    head, h = model.mlm, torch.randn(3, 16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    for _ in range(2):
        with torch.no_grad():
            want = F.linear(
                head.norm(head.act(head.dense(h))), head.word_embeddings.weight, head.bias
            )
            with fast.inference_twins(model, "tied_projection"):
                torch.testing.assert_close(head(h), want, rtol=1e-5, atol=1e-5)
        head(h).square().sum().backward()
        optimizer.step()


def test_a_served_model_packs_once_for_every_job() -> None:
    # fast.for_serving: each job's own inference_twins keeps the packs (the weights are frozen).
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    x = torch.randn(4, 6)
    with torch.inference_mode():
        want = F.linear(
            F.relu(F.linear(x, model[0].weight, model[0].bias)), model[2].weight, model[2].bias
        )
        fast.for_serving(model, "packed")
        packs = []
        for _ in range(2):
            with fast.inference_twins(model, "packed"):
                torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
                packs.append(model[0].__dict__["_packed"][1])
    assert packs[0] is packs[1] and type(model[0]) is PackedLinear
    assert not any(p.requires_grad for p in model.parameters())
