"""``linear`` and ``Linear``: y = x W^T + b, in training on CPU fp32 by the faster library (same math).

On CPU, ``F.linear`` and ``torch.mm`` call MKL's general matrix product. On AMD processors
with AVX-512 (a Zen 4 host) oneDNN's product (the library PyTorch ships for its CPU
convolutions, reached through the same ``torch.ops.mkldnn._linear_pointwise`` op that packed
inference uses, nn/packed.py) was 1.1-1.2x faster for the shapes of a BERT training step, and
a whole bert-small step 5-8% faster; on an Intel Xeon MKL was the faster one, by 1-4%
(bert-small) and 8-11% (bert-base) a step, and on an AMD EPYC with AVX2 only MKL was too,
by 9% (bert-small) and 20% (bert-base) a step (bench/product_library.py, bench/RESULTS.md).
So while gradients are on, the forward product and the gradient with respect to the input go
through oneDNN on AMD with AVX-512 and MKL elsewhere; the weight's gradient (dy^T x) is
``torch.mm`` everywhere, which oneDNN did not beat. The choice follows the CPU's vendor and
flags, not a timing, so every run on a machine computes the same floats (resume is bit-exact).

bf16 autocast on a CPU whose bf16 products are no faster than fp32 (no AMX, nor AMD's
avx512_bf16; attnlab/cpu.py: fast_bf16_matmul) gets the same bf16 products from the fp32
kernel: inputs rounded to bf16, products summed in fp32, the result rounded to bf16, as a bf16
kernel computes them. PyTorch's bf16 product is the slower one there: one bert-small
feed-forward layer (4,096 x 512 -> 2,048), forward and backward, took 440 ms under bf16
autocast against 112 ms this way and 97 ms in fp32 on a Xeon without avx512_bf16 (emulated),
and 183 against 119 ms (fp32 119 ms) on one with it (bench/bf16_products.py, 2-core Xeons,
2026-12-01 and 12-04). ``linear`` and ``matmul`` take that
route (``_Bf16Linear``, ``_Bf16MatMul``), in training and inference alike, and keep bf16
copies for the backward pass, as autocast does.

Anything else runs plain ``F.linear``: fp32 inference (packed_linears serves that), weights or
inputs that are not CPU fp32, bf16 autocast on CPUs with fast bf16 products, and code traced by
``torch.compile`` (which brings its own kernels). Results and gradients equal ``F.linear``'s
(under autocast, autocast's) to float rounding (tests/test_linear.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx, once_differentiable

from attnlab.cpu import cpu_field, cpu_vendor, fast_bf16_matmul
from attnlab.nn.packed import can_pack


@functools.cache
def onednn_trains_faster() -> bool:
    """Whether training products take oneDNN here: on AMD CPUs with AVX-512, where it beat MKL."""
    # On an AVX2-only Zen MKL was the faster one (bench/product_library.py: 1.09-1.20x a step).
    return cpu_vendor() == "AuthenticAMD" and "avx512f" in cpu_field("flags").split()


def _onednn(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x (..., in) @ weight (out, in)^T + bias, by oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _product(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x (..., in) @ weight (out, in)^T + bias, by this CPU's faster library (module docstring)."""
    return _onednn(x, weight, bias) if onednn_trains_faster() else F.linear(x, weight, bias)


class _TrainingLinear(torch.autograd.Function):
    """F.linear whose weight gradient is a contiguous tensor of its own, products by _product.

    The weight gradient comes out as one (out, in) product, where F.linear's autograd gives
    the transpose of an (in, out) one: a tied embedding table then takes the lookups' rows in
    place instead of being copied whole (tied_weight, train/grads.py).
    """

    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """x (..., in) -> (..., out)."""
        ctx.save_for_backward(x, weight)
        return _product(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor | None, ...]:
        """Gradients of x, weight and bias from the output's gradient."""
        x, weight = ctx.saved_tensors
        return _linear_grads(grad, x, weight, ctx.needs_input_grad)


def _linear_grads(
    grad: Tensor, x: Tensor, weight: Tensor, needs: tuple[bool, ...]
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The gradients of x, weight and bias of x W^T + b that ``needs`` asks for (fp32 tensors)."""
    rows = grad.reshape(-1, grad.shape[-1])  # (tokens, out)
    grad_x = grad_weight = grad_bias = None
    if needs[0]:
        grad_x = _product(grad.contiguous(), weight.t(), None)  # dy W
    if needs[1]:
        grad_weight = rows.t() @ x.reshape(-1, x.shape[-1])  # dy^T x
    if needs[2]:  # False when there is no bias
        grad_bias = rows.new_ones(len(rows)) @ rows  # column sums (bench/step_parts.py)
    return grad_x, grad_weight, grad_bias


BF16 = torch.bfloat16


def bf16_by_fp32(*tensors: Tensor) -> bool:
    """Whether products of these tensors take bf16 autocast's numbers from the fp32 kernel here.

    True under CPU autocast to bf16 on a CPU known to multiply bf16 no faster than fp32
    (attnlab/cpu.py), for CPU fp32 or bf16 tensors, outside ``torch.compile``.
    """
    return (
        torch.is_autocast_enabled("cpu")
        and torch.get_autocast_dtype("cpu") == BF16
        and all(t.device.type == "cpu" and t.dtype in (torch.float32, BF16) for t in tensors)
        and fast_bf16_matmul() is False
        and not torch.compiler.is_compiling()
    )


def _up(x: Tensor) -> Tensor:
    """x rounded to bf16, as fp32 (exactly the bf16 values)."""
    return x.to(BF16).float()


def _down(grad: Tensor, like: torch.dtype) -> Tensor:
    """A gradient computed in fp32, rounded to bf16 (a bf16 kernel's output), in dtype ``like``."""
    return grad.to(BF16).to(like)


class _Bf16Linear(torch.autograd.Function):
    """F.linear under bf16 autocast, computed by the fp32 kernel (module docstring)."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """x (..., in) -> (..., out) in bf16."""
        with torch.autocast("cpu", enabled=False):
            xb, wb = x.to(BF16), weight.to(BF16)
            ctx.save_for_backward(xb, wb)
            ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
            return F.linear(xb.float(), wb.float(), None if bias is None else _up(bias)).to(BF16)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor | None, ...]:
        """Gradients of x, weight and bias, each the bf16 product's, in its input's dtype."""
        xb, wb = ctx.saved_tensors
        needs = ctx.needs_input_grad
        with torch.autocast("cpu", enabled=False):
            x = xb.float() if needs[1] else xb  # read only for the weight's gradient
            weight = wb.float() if needs[0] else wb  # read only for the input's gradient
            grads = _linear_grads(grad.float(), x, weight, needs)
        return tuple(
            None if g is None else _down(g, dtype)
            for g, dtype in zip(grads, ctx.dtypes, strict=True)
        )


class _Bf16MatMul(torch.autograd.Function):
    """a @ b under bf16 autocast (same batch dimensions), computed by the fp32 kernel."""

    @staticmethod
    def forward(ctx: FunctionCtx, a: Tensor, b: Tensor) -> Tensor:
        """(..., m, k) @ (..., k, n) -> (..., m, n) in bf16."""
        with torch.autocast("cpu", enabled=False):
            ab, bb = a.to(BF16), b.to(BF16)
            ctx.save_for_backward(ab, bb)
            ctx.dtypes = (a.dtype, b.dtype)
            return torch.matmul(ab.float(), bb.float()).to(BF16)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """Gradients of a and b, each the bf16 product's, in its input's dtype."""
        ab, bb = ctx.saved_tensors
        with torch.autocast("cpu", enabled=False):
            g = grad.float()
            grad_a = grad_b = None
            if ctx.needs_input_grad[0]:
                grad_a = _down(g @ bb.float().transpose(-2, -1), ctx.dtypes[0])
            if ctx.needs_input_grad[1]:
                grad_b = _down(ab.float().transpose(-2, -1) @ g, ctx.dtypes[1])
        return grad_a, grad_b


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """torch.matmul(a, b); under bf16 autocast where bf16_by_fp32, by _Bf16MatMul."""
    if a.dim() >= 2 and a.shape[:-2] == b.shape[:-2] and bf16_by_fp32(a, b):
        return _Bf16MatMul.apply(a, b)
    return torch.matmul(a, b)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """y = x W^T + b; for CPU fp32 tensors that need gradients, through _TrainingLinear."""
    if bf16_by_fp32(x, weight, *([] if bias is None else [bias])):
        return _Bf16Linear.apply(x, weight, bias)
    if (
        torch.is_grad_enabled()
        and (weight.requires_grad or x.requires_grad)
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.dim() >= 2
        and can_pack(weight)
        and weight.is_contiguous()
        and (bias is None or bias.dtype == torch.float32)
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()
    ):
        return _TrainingLinear.apply(x.contiguous(), weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state-dict names) computed by `linear`."""

    def forward(self, x: Tensor) -> Tensor:
        """x (..., in) -> (..., out)."""
        return linear(x, self.weight, self.bias)


class _TiedWeight(torch.autograd.Function):
    """An embedding table, unchanged, as a tied output projection's weight (see tied_weight)."""

    @staticmethod
    def forward(ctx: FunctionCtx, weight: Tensor) -> Tensor:
        """The weight itself (a view)."""
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> Tensor:
        """The gradient as it is (the tensor itself, so it can be added into)."""
        return grad


def tied_weight(weight: Tensor) -> Tensor:
    """weight, for a tied output projection; call it before the embedding lookups of a step.

    Autograd runs backward nodes in reverse order of creation and sums two gradients of one
    weight as they arrive: a dense one arriving second takes a sparse one in place, while a
    sparse one arriving second makes an out-of-place sum, a copy of the whole vocabulary table
    (about 4% of a bert-base pretraining step here). Made before the lookups, this node passes
    the projection's dense gradient on after the lookups' sparse rows (train/grads.py).
    """
    return _TiedWeight.apply(weight)
