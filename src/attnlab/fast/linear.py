"""The fast training twin of ``nn.Linear`` (y = x W^T + b): same math, CPU routes.

Training (``TrainingLinear``). On CPU, ``F.linear`` calls MKL's general matrix product. On AMD
processors with AVX-512 oneDNN's product (reached through ``torch.ops.mkldnn._linear_pointwise``)
was the faster one for the shapes of a BERT training step, and MKL everywhere else
(fast/route.py). So there, while gradients are on, the forward product and the gradient with
respect to the input go through oneDNN (``_TrainingLinear``; the weight's gradient dy^T x is one
``torch.mm``); elsewhere fp32 runs ``F.linear`` itself.

bf16 autocast on a CPU whose bf16 products are no faster than fp32 (fast/route.py:
fast_bf16_matmul) gets the same bf16 products from the fp32 kernel: inputs rounded to bf16,
products summed in fp32, the result rounded to bf16, as a bf16 kernel computes them; PyTorch's
own bf16 product is emulated there and the slower one. ``linear`` and ``matmul`` take that
route (``_Bf16Linear``, ``_Bf16MatMul``) and keep bf16 copies for the backward pass, as
autocast does.

The tied vocabulary projections (``FastMLMHead``, ``FastTransformer``, ``FastGPT``: the
"tied_projection" speed-up) multiply by an embedding table with ``F.linear``, which no
``nn.Linear`` twin sees; their twins route that product through ``linear`` too.

Anything else runs plain ``F.linear``: fp32 without gradients, CUDA tensors, other dtypes, bf16
autocast on CPUs with fast bf16 products, and code traced by ``torch.compile`` (which brings
its own kernels). Results and gradients equal ``F.linear``'s (under autocast, autocast's) to
float rounding (tests/test_linear.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx, once_differentiable

from attnlab.fast.route import fast_bf16_matmul, has_onednn, onednn_trains_faster
from attnlab.models.bert import BertMLMHead
from attnlab.models.gpt import GPT
from attnlab.models.seq2seq import Transformer

BF16 = torch.bfloat16


def _onednn(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x (..., in) @ weight (out, in)^T + bias, by oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _product(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x (..., in) @ weight (out, in)^T + bias, by this CPU's faster library (fast/route.py)."""
    if onednn_trains_faster() and has_onednn():
        return _onednn(x, weight, bias)
    return F.linear(x, weight, bias)


def _linear_grads(
    grad: Tensor, x: Tensor, weight: Tensor, needs: tuple[bool, ...]
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The gradients of x, weight and bias of x W^T + b that ``needs`` asks for (fp32 tensors)."""
    rows = grad.reshape(-1, grad.shape[-1])  # (tokens, out)
    grad_x = grad_weight = grad_bias = None
    if needs[0]:
        grad_x = _product(grad.contiguous(), weight.t(), None)  # dy W
    if needs[1]:
        grad_weight = rows.t() @ x.reshape(-1, x.shape[-1])  # dy^T x, contiguous (out, in)
    if needs[2]:  # False when there is no bias
        grad_bias = rows.new_ones(len(rows)) @ rows  # column sums as one product
    return grad_x, grad_weight, grad_bias


class _TrainingLinear(torch.autograd.Function):
    """F.linear with the forward product and the input's gradient by _product (oneDNN here)."""

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


def bf16_by_fp32(*tensors: Tensor) -> bool:
    """Whether products of these tensors take bf16 autocast's numbers from the fp32 kernel here.

    True under CPU autocast to bf16 on a CPU known to multiply bf16 no faster than fp32
    (fast/route.py), for CPU fp32 or bf16 tensors, outside ``torch.compile``.
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
    """y = x W^T + b; for CPU fp32 tensors that need gradients where oneDNN trains faster, through
    _TrainingLinear."""
    if bf16_by_fp32(x, weight, *([] if bias is None else [bias])):
        return _Bf16Linear.apply(x, weight, bias)
    if (
        onednn_trains_faster()
        and has_onednn()
        and torch.is_grad_enabled()
        and (weight.requires_grad or x.requires_grad)
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.dim() >= 2
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.is_contiguous()
        and (bias is None or bias.dtype == torch.float32)
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()
    ):
        return _TrainingLinear.apply(x.contiguous(), weight, bias)
    return F.linear(x, weight, bias)


class TrainingLinear(nn.Linear):
    """Twin of nn.Linear for training: computed by ``linear`` (CPU library, bf16 by fp32)."""

    def forward(self, x: Tensor) -> Tensor:
        """x (..., in) -> (..., out)."""
        return linear(x, self.weight, self.bias)


class FastMLMHead(BertMLMHead):
    """Twin of BertMLMHead: the tied vocabulary projection computed by ``linear``."""

    def forward(self, hidden: Tensor) -> Tensor:
        """(..., d_model) -> (..., vocab_size) logits."""
        h = self.norm(self.act(self.dense(hidden)))
        return linear(h, self.word_embeddings.weight, self.bias)


class FastTransformer(Transformer):
    """Twin of Transformer: a tied output projection computed by ``linear`` (an untied one is an
    nn.Linear with a twin of its own)."""

    def project(self, hidden: Tensor) -> Tensor:
        """Decoder output (..., d_model) -> logits (..., tgt_vocab_size)."""
        if self.output_proj is None:
            return linear(hidden, self.target_embedding.weight)
        return self.output_proj(hidden)


class FastGPT(GPT):
    """Twin of GPT: the LM head's product computed by ``linear``."""

    def project(self, hidden: Tensor) -> Tensor:
        """Final hidden states (..., d_model) -> next-token logits (..., vocab_size)."""
        return linear(hidden, self.output_weight())
