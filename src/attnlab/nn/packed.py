"""Linear layers on pre-packed weights for CPU inference (a speed trick; same math).

``nn.Linear`` on CPU calls a general matrix product that rearranges ("packs") the weight
into the kernel's blocked layout on every call. At inference the weight does not change, so
oneDNN can pack it once (``torch.ops.mkldnn._reorder_linear_weight``) and every later call
skips that work: the small, many-call products of a decoding step (a few hundred rows) ran
1.1-1.7x faster in a micro-benchmark on the 2-core benchmark machine (vocabulary projection
128 x 256 -> 8,000: 121-143 -> 202-212 GFLOP/s; bench/RESULTS.md). This is what PyTorch's own inductor
("freezing") and Intel's extension do for inference. The packed results equal
``F.linear``'s to float rounding (tests/test_packed.py).

Only fp32 weights on a CPU with oneDNN are packed, and only while gradients are off and
autocast is not on; anything else runs nn/linear.py's ``linear`` (``F.linear``, or under bf16
autocast on a CPU that multiplies bf16 no faster than fp32 its bf16 products by the fp32
kernel).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def can_pack(weight: Tensor) -> bool:
    """Whether weight (out, in) can be packed here: fp32, on CPU, oneDNN built in."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinear:
    """y = x W^T + b with W packed once for oneDNN; falls back to F.linear where packing cannot serve."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias  # the parameters themselves: the plain path trains
        self.packed = (
            torch.ops.mkldnn._reorder_linear_weight(weight.detach()) if can_pack(weight) else None
        )

    def __call__(self, x: Tensor, relu: bool = False) -> Tensor:
        """x (..., in) -> (..., out); relu=True applies ReLU to the output (fused by oneDNN)."""
        usable = (
            self.packed is not None
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and not torch.is_grad_enabled()
            and not torch.is_autocast_enabled("cpu")
        )
        if not usable:  # e.g. bf16 autocast: linear() picks its route (nn/linear.py)
            from attnlab.nn.linear import linear  # here: nn/linear.py imports this module

            y = linear(x, self.weight, self.bias)
            return F.relu(y) if relu else y
        post = "relu" if relu else "none"
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, post, [], "")


@contextmanager
def packed_linears(model: nn.Module) -> Iterator[None]:
    """Within the block, every nn.Linear of model runs on its packed weight.

    Packs once on entry (the weights must not change inside the block) and restores the
    modules on exit. Inside another such block it leaves the enclosing block's packs alone.
    """
    linears = [
        m for m in model.modules() if isinstance(m, nn.Linear) and "forward" not in m.__dict__
    ]
    try:
        for module in linears:
            module.forward = PackedLinear(module.weight, module.bias)  # instance attribute
        yield
    finally:
        for module in linears:
            module.__dict__.pop("forward", None)  # back to nn.Linear.forward
