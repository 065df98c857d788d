"""Fast twins of ``nn.Linear`` (y = x W^T + b) and of the ReLU feed-forward: same math, CPU routes.

Training (``TrainingLinear``). On CPU, ``F.linear`` calls MKL's general matrix product. On AMD
processors with AVX-512 oneDNN's product (reached through ``torch.ops.mkldnn._linear_pointwise``,
the op packed inference uses) was the faster one for the shapes of a BERT training step, and
MKL everywhere else (fast/route.py). So while gradients are on, the forward product and the
gradient with respect to the input go through that library; the weight's gradient (dy^T x) is
one ``torch.mm`` everywhere, a contiguous (out, in) tensor of its own (where F.linear's
autograd gives the transpose of an (in, out) one), so a tied embedding table can take the
lookups' rows in place (fast/training.py).

bf16 autocast on a CPU whose bf16 products are no faster than fp32 (fast/route.py:
fast_bf16_matmul) gets the same bf16 products from the fp32 kernel: inputs rounded to bf16,
products summed in fp32, the result rounded to bf16, as a bf16 kernel computes them; PyTorch's
own bf16 product is emulated there and the slower one. ``linear`` and ``matmul`` take that
route (``_Bf16Linear``, ``_Bf16MatMul``) and keep bf16 copies for the backward pass, as
autocast does.

Inference (``PackedLinear``). ``nn.Linear`` rearranges ("packs") the weight into the kernel's
blocked layout on every call. While the weight does not change oneDNN can pack it once
(``torch.ops.mkldnn._reorder_linear_weight``) and every later call skips that work, as
PyTorch's inductor ("freezing") and Intel's extension do for inference. The pack is built on
first use and kept until the next swap (fast/swap.py), or rebuilt sooner where the weight's
version shows a change. ``PackedFeedForward`` also applies the ReLU of
a ReLU feed-forward as the first product is written.

Tied vocabulary projections (``FastMLMHead``, ``FastTransformer``) take both routes on the
embedding table, through the handle the kept embedding gradients give it (fast/training.py:
tied_weight), so that the projection's dense gradient takes the lookups' rows in place.

Anything else runs plain ``F.linear``: CUDA tensors, dtypes other than fp32, bf16 autocast on
CPUs with fast bf16 products, and code traced by ``torch.compile`` (which brings its own
kernels). Results and gradients equal ``F.linear``'s (under autocast, autocast's) to float
rounding (tests/test_linear.py, tests/test_packed.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx, once_differentiable

from attnlab.fast.route import fast_bf16_matmul, has_onednn, onednn_trains_faster
from attnlab.fast.training import tied_weight
from attnlab.models.bert import BertMLMHead
from attnlab.models.seq2seq import Transformer
from attnlab.nn.blocks import FeedForward

BF16 = torch.bfloat16


def can_pack(weight: Tensor) -> bool:
    """Whether weight (out, in) can go to oneDNN here: fp32, on CPU, oneDNN built in."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and has_onednn()


def _onednn(x: Tensor, weight: Tensor, bias: Tensor | None, post: str = "none") -> Tensor:
    """x (..., in) @ weight (out, in, or packed)^T + bias, by oneDNN; post "relu" fuses a ReLU."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, post, [], "")


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
    """F.linear whose weight gradient is a contiguous tensor of its own, products by _product."""

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
    """y = x W^T + b; for CPU fp32 tensors that need gradients, through _TrainingLinear."""
    if bf16_by_fp32(x, weight, *([] if bias is None else [bias])):
        return _Bf16Linear.apply(x, weight, bias)
    if (
        torch.is_grad_enabled()
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


PACKED = "_packed"  # a twin's attribute: (the weight's version and address, its pack)


def packed_linear(
    owner: nn.Module, x: Tensor, weight: Tensor, bias: Tensor | None = None, relu: bool = False
) -> Tensor:
    """x W^T + b (ReLU'd as it is written when relu=True) on W packed once, the pack kept on owner.

    The packed product serves CPU fp32 inference; anything else (training, bf16 autocast, CUDA)
    runs ``linear``, which picks its route.
    """
    usable = (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and can_pack(weight)
        and not torch.is_grad_enabled()
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()
    )
    if not usable:
        # A training forward: the weights are about to change, and an optimizer may change
        # them without moving their version (fused AdamW), so a pack kept now would go stale.
        owner.__dict__.pop(PACKED, None)
        y = linear(x, weight, bias)
        return F.relu(y) if relu else y
    return _onednn(x, _pack(owner, weight), bias, "relu" if relu else "none")


def _pack(owner: nn.Module, weight: Tensor) -> Tensor:
    """weight packed for oneDNN, kept on owner: built on first use, again if its version moved."""
    key = (weight._version, weight.data_ptr())
    cached = owner.__dict__.get(PACKED)
    if cached is None or cached[0] != key:
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        cached = owner.__dict__[PACKED] = (key, packed)
    return cached[1]


class PackedLinear(nn.Linear):
    """Twin of nn.Linear for inference: the fp32 weight packed once for oneDNN (module docstring)."""

    fast_state = (PACKED,)  # dropped at every swap (fast/swap.py)

    def forward(self, x: Tensor) -> Tensor:
        """x (..., in) -> (..., out)."""
        return packed_linear(self, x, self.weight, self.bias)

    def product(self, x: Tensor, relu: bool = False) -> Tensor:
        """x (..., in) -> (..., out), with ReLU applied as it is written when relu=True."""
        return packed_linear(self, x, self.weight, self.bias, relu)


class PackedFeedForward(FeedForward):
    """Twin of FeedForward for inference: a ReLU network's first product writes relu(x W1 + b1)."""

    def forward(self, x: Tensor) -> Tensor:
        """(batch, seq, d_model) -> (batch, seq, d_model)."""
        if self.act is F.relu and isinstance(self.fc1, PackedLinear):
            return self.fc2(self.fc1.product(x, relu=True))
        return super().forward(x)


class FastMLMHead(BertMLMHead):
    """Twin of BertMLMHead: the tied vocabulary projection by ``linear`` (training) or packed
    (inference), on the handle the kept embedding gradients give the tied table."""

    fast_state = (PACKED,)

    def forward(self, hidden: Tensor) -> Tensor:
        """(..., d_model) -> (..., vocab_size) logits."""
        h = self.norm(self.act(self.dense(hidden)))
        return packed_linear(self, h, tied_weight(self.word_embeddings), self.bias)


class FastTransformer(Transformer):
    """Twin of Transformer: its tied output projection as FastMLMHead's (an untied one is an
    nn.Linear with twins of its own)."""

    fast_state = (PACKED,)

    def project(self, hidden: Tensor) -> Tensor:
        """Decoder output (..., d_model) -> logits (..., tgt_vocab_size)."""
        if self.output_proj is None:
            return packed_linear(self, hidden, tied_weight(self.target_embedding))
        return self.output_proj(hidden)
