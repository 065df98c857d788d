"""attnlab.fast.linear: the training products and gradients equal F.linear's (the reference)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnlab.fast.linear as linear_module
import attnlab.fast.route as route_module
from attnlab.fast import swap, to_plain
from attnlab.fast.linear import TrainingLinear, _TrainingLinear, linear
from attnlab.fast.speedups import SPEEDUPS


@pytest.fixture(params=["onednn", "mkl"])
def route(request, monkeypatch):
    """Both libraries' route, on whatever CPU runs the tests (AMD takes oneDNN, others MKL)."""
    monkeypatch.setattr(linear_module, "onednn_trains_faster", lambda: request.param == "onednn")
    return request.param


def grads_of(fn, x, w, b, upstream):
    """Output and the gradients of x, w (and b) of fn(x, w, b) under a fixed upstream gradient."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, b) if t is not None]
    x_, w_, *rest = leaves
    out = fn(x_, w_, rest[0] if rest else None)
    out.backward(upstream)
    return [out.detach(), *[t.grad for t in leaves]]


@pytest.mark.parametrize("shape", [(7, 24), (3, 5, 24), (2, 3, 4, 24)])
@pytest.mark.parametrize("bias", [True, False])
def test_values_and_gradients_equal_f_linear(shape, bias, route):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    w = torch.randn(40, 24, generator=g)
    b = torch.randn(40, generator=g) if bias else None
    upstream = torch.randn(*shape[:-1], 40, generator=g)
    ours = grads_of(linear, x, w, b, upstream)
    reference = grads_of(F.linear, x, w, b, upstream)
    assert len(ours) == len(reference) == (4 if bias else 3)
    for a, r in zip(ours, reference, strict=True):
        assert a.shape == r.shape
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-4)


def test_only_the_gradients_asked_for():
    x = torch.randn(6, 8)
    w = torch.randn(4, 8, requires_grad=True)
    out = linear(x, w)  # x is data: no input gradient wanted
    out.sum().backward()
    torch.testing.assert_close(w.grad, torch.ones(6, 4).t() @ x)
    assert x.grad is None


def test_training_route_serves_cpu_fp32_and_nothing_else(monkeypatch):
    monkeypatch.setattr(linear_module, "onednn_trains_faster", lambda: True)
    calls = []
    apply = _TrainingLinear.apply
    monkeypatch.setattr(_TrainingLinear, "apply", lambda *a: calls.append(1) or apply(*a))
    x, w = torch.randn(3, 8), torch.randn(4, 8, requires_grad=True)
    linear(x, w)
    assert len(calls) == 1
    with torch.no_grad():  # inference: F.linear
        linear(x, w)
    linear(x, w.detach())  # nothing needs a gradient
    linear(x.double(), w.double())  # other dtypes: F.linear
    linear(x, w.t().contiguous().t())  # a non-contiguous weight: F.linear
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert linear(x, w).dtype == torch.bfloat16  # autocast keeps its own casts
    assert len(calls) == 1
    monkeypatch.setattr(linear_module, "onednn_trains_faster", lambda: False)
    linear(x, w)  # where MKL trains as fast, F.linear itself (which calls MKL)
    assert len(calls) == 1


def test_training_twin_is_a_drop_in_nn_linear(route):
    torch.manual_seed(0)
    plain = torch.nn.Linear(8, 5)
    ours = torch.nn.Linear(8, 5)
    ours.load_state_dict(plain.state_dict())
    swap(ours, [s for s in SPEEDUPS if s.name == "linear"])
    assert type(ours) is TrainingLinear and isinstance(ours, torch.nn.Linear)
    assert ours.state_dict().keys() == plain.state_dict().keys()
    x = torch.randn(2, 3, 8)
    for module in (plain, ours):
        module(x).square().sum().backward()
    torch.testing.assert_close(ours(x), plain(x))
    for a, b in zip(ours.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)
    assert type(to_plain(ours)) is torch.nn.Linear


def test_the_route_decides_which_library_runs(monkeypatch, route):
    calls = []
    onednn = linear_module._onednn
    monkeypatch.setattr(linear_module, "_onednn", lambda *a: calls.append(1) or onednn(*a))
    x, w = torch.randn(3, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    linear(x, w).sum().backward()  # forward and input gradient
    assert len(calls) == (2 if route == "onednn" else 0)


@pytest.mark.parametrize(
    "vendor, flags, onednn",
    [
        ("AuthenticAMD", "avx2 avx512f avx512_bf16", True),  # Zen 4: oneDNN measured faster
        ("AuthenticAMD", "avx2 fma", False),  # AVX2-only Zen: MKL measured faster
        ("GenuineIntel", "avx2 avx512f", False),
        ("", "", False),
    ],
)
def test_onednn_on_amd_with_avx512_only(monkeypatch, vendor, flags, onednn):
    monkeypatch.setattr(route_module, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(route_module, "cpu_field", lambda name: flags if name == "flags" else "")
    assert route_module.onednn_trains_faster.__wrapped__() is onednn  # uncached


# bf16 autocast on a CPU without fast bf16 products: the same bf16 products by the fp32
# kernel (fast/linear.py). The reference is autocast's own F.linear / matmul, PyTorch's bf16
# kernel, which computes bf16 products on any CPU (emulated where the instructions are missing).
BF16 = torch.bfloat16


@pytest.fixture
def bf16_by_fp32(monkeypatch):
    """This CPU taken for one without fast bf16 products, so the fp32-kernel route runs."""
    monkeypatch.setattr(linear_module, "fast_bf16_matmul", lambda: False)


def autocast_grads(fn, tensors, upstream):
    """Output and input gradients of fn(*tensors) under bf16 autocast."""
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    with torch.autocast("cpu", dtype=BF16):
        out = fn(*leaves)
    out.backward(upstream)
    return [out.detach(), *[t.grad for t in leaves]]


def assert_bf16_close(ours, reference):
    """Equal dtypes; values within one bf16 rounding of each other (sums in another order)."""
    assert ours.dtype == reference.dtype
    torch.testing.assert_close(ours.float(), reference.float(), rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("shape", [(7, 24), (3, 5, 24)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("x_dtype", [torch.float32, BF16])
def test_bf16_linear_by_fp32_equals_autocasts(shape, bias, x_dtype, bf16_by_fp32):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(*shape, generator=g).to(x_dtype)
    w, b = torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    upstream = torch.randn(*shape[:-1], 40, generator=g).to(BF16)
    tensors = [x, w, b] if bias else [x, w]
    calls = []
    apply = linear_module._Bf16Linear.apply
    with pytest.MonkeyPatch.context() as m:
        m.setattr(linear_module._Bf16Linear, "apply", lambda *a: calls.append(1) or apply(*a))
        ours = autocast_grads(lambda *t: linear(*t), tensors, upstream)
    assert calls == [1]
    reference = autocast_grads(lambda *t: F.linear(*t), tensors, upstream)
    assert ours[0].dtype == BF16
    for a, r in zip(ours, reference, strict=True):
        assert_bf16_close(a, r)


def test_bf16_route_rounds_inputs_to_bf16_as_autocast_does(bf16_by_fp32):
    # 1 + 2**-10 is 1 in bf16, so the product is exactly 0, not 2**-10 as in fp32
    x, w = torch.tensor([[1 + 2**-10, -1.0]]), torch.ones(1, 2)
    with torch.autocast("cpu", dtype=BF16):
        assert float(linear(x, w)) == 0.0
        assert float(F.linear(x, w)) == 0.0  # autocast's own bf16 product
    assert float(linear(x, w)) == 2**-10  # fp32 outside autocast


def test_bf16_matmul_by_fp32_equals_autocasts(bf16_by_fp32):
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(2, 3, 6, 16, generator=g), torch.randn(2, 3, 16, 5, generator=g).to(BF16)
    upstream = torch.randn(2, 3, 6, 5, generator=g).to(BF16)
    ours = autocast_grads(linear_module.matmul, [a, b], upstream)
    reference = autocast_grads(torch.matmul, [a, b], upstream)
    for x, r in zip(ours, reference, strict=True):
        assert_bf16_close(x, r)


def test_bf16_route_only_without_bf16_instructions_and_only_under_autocast(monkeypatch):
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    monkeypatch.setattr(linear_module, "fast_bf16_matmul", lambda: True)
    with torch.autocast("cpu", dtype=BF16):
        assert not linear_module.bf16_by_fp32(x, w)  # the CPU's own bf16 kernel
    monkeypatch.setattr(linear_module, "fast_bf16_matmul", lambda: None)
    with torch.autocast("cpu", dtype=BF16):
        assert not linear_module.bf16_by_fp32(x, w)  # unknown CPU: left to PyTorch
    monkeypatch.setattr(linear_module, "fast_bf16_matmul", lambda: False)
    assert not linear_module.bf16_by_fp32(x, w)  # no autocast: fp32 products
    with torch.autocast("cpu", dtype=BF16):
        assert linear_module.bf16_by_fp32(x, w)
        assert not linear_module.bf16_by_fp32(x.double(), w.double())


def _tied_models() -> dict[str, tuple[torch.nn.Module, torch.Tensor, object]]:
    """Small models whose vocabulary projection is tied to an embedding table (vocab 50, width
    16): each with its table and a function of the model giving its training loss."""
    from attnlab.config import BertConfig, GPTConfig, TransformerConfig
    from attnlab.models.bert import BertForPreTraining
    from attnlab.models.gpt import GPT
    from attnlab.models.seq2seq import Transformer

    torch.manual_seed(0)
    small = dict(d_model=16, n_heads=2, d_ff=32, max_positions=16, dropout=0.0)
    bert = BertForPreTraining(BertConfig(vocab_size=50, n_layers=1, **small))
    seq2seq = Transformer(TransformerConfig(src_vocab_size=50, tgt_vocab_size=50,
                                            n_encoder_layers=1, n_decoder_layers=1, **small))  # fmt: skip
    gpt = GPT(GPTConfig(vocab_size=50, n_layers=1, **small))
    ids = torch.randint(3, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    labels = torch.where(torch.arange(9) % 3 == 0, ids, -100)
    return {
        "bert": (bert, bert.bert.embeddings.word_embeddings.weight,
                 lambda m: m(ids, mlm_labels=labels, nsp_labels=torch.tensor([0, 1]))["loss"]),
        "transformer": (seq2seq, seq2seq.target_embedding.weight,
                        lambda m: m(ids, ids[:, :-1], ids[:, 1:])["loss"]),
        "gpt": (gpt, gpt.embed.weight, lambda m: m(ids[:, :-1], targets=ids[:, 1:]).loss),
    }  # fmt: skip


def _recording(weights: list[torch.Tensor]):
    """_Bf16Linear.apply, noting each weight it multiplies by."""
    apply = linear_module._Bf16Linear.apply
    return lambda x, w, b: weights.append(w) or apply(x, w, b)


@pytest.mark.parametrize("kind", ["bert", "transformer", "gpt"])
def test_tied_projection_twins_take_the_bf16_route_and_equal_the_plain_model(kind, bf16_by_fp32):
    # A tied vocabulary projection is an F.linear on an embedding table, which no nn.Linear twin
    # sees: its model's twin routes it through `linear`, the product autocast's bf16 kernel
    # computes slowly on CPUs without bf16 instructions. The same loss as plain, and a table
    # gradient as close to the fp32 one as plain autocast's (bf16 roundings in another order).
    model, table, loss_of = _tied_models()[kind]
    loss_of(model).backward()
    fp32_grad = table.grad.clone()
    model.zero_grad(set_to_none=True)
    results = []
    for twins in (False, True):
        if twins:
            swap(model, [s for s in SPEEDUPS if s.name == "tied_projection"])
        weights: list[torch.Tensor] = []
        with pytest.MonkeyPatch.context() as m:
            m.setattr(linear_module._Bf16Linear, "apply", _recording(weights))
            with torch.autocast("cpu", dtype=BF16):
                loss = loss_of(model)
        loss.backward()
        assert any(w is table for w in weights) == twins
        error = float((table.grad - fp32_grad).norm() / fp32_grad.norm())
        results.append((loss.detach().float(), error))
        model.zero_grad(set_to_none=True)
    to_plain(model)
    (plain_loss, plain_error), (twin_loss, twin_error) = results
    torch.testing.assert_close(twin_loss, plain_loss, rtol=2**-7, atol=1e-3)
    assert twin_error <= 1.25 * plain_error + 1e-3, (twin_error, plain_error)
