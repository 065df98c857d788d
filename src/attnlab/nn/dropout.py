"""Dropout (Srivastava et al. 2014; the Transformer's P_drop, Vaswani et al. 2017 section 5.4).

Training zeroes each element with probability p and scales the rest by 1 / (1 - p), so the
expected output equals the input; evaluation passes the input through.

On CPU the mask is made more cheaply than PyTorch's ``F.dropout``, whose ``bernoulli_`` draws
one random number per element (measured about 12-14 ns an element here, the largest non-matmul
cost of a BERT pretraining step). Here each 64-bit random draw gives four 16-bit uniform
integers, and an element is dropped when its integer falls among the lowest
``round(p * 2**16)`` of the 65,536 values. So the drop rate is p rounded to a multiple of
2**-16 (0.1 becomes 0.100006), and the survivors are scaled by the reciprocal of the rounded
keep rate, which keeps the expectation exact. Other devices call ``F.dropout``, already one
fused kernel there.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx

_LEVELS = 1 << 16  # values of one 16-bit random integer


def drop_mask(shape: torch.Size | tuple[int, ...], p: float, device: torch.device) -> Tensor:
    """Boolean mask of ``shape``, True (dropped) with probability round(p * 2**16) / 2**16."""
    n = math.prod(shape)
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=device)
    words.random_(-(1 << 63), None)  # every 64-bit pattern equally likely
    uniform = words.view(torch.int16)[:n].view(shape)  # four 16-bit integers per draw
    return uniform < round(p * _LEVELS) - _LEVELS // 2


class _MaskedScale(torch.autograd.Function):
    """y = x with the masked elements zeroed, times scale; the gradient is masked the same way."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, drop: Tensor, scale: float) -> Tensor:
        ctx.save_for_backward(drop)
        ctx.scale = scale
        return torch.where(drop, 0.0, x).mul_(scale)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, None, None]:
        (drop,) = ctx.saved_tensors
        return torch.where(drop, 0.0, grad).mul_(ctx.scale), None, None


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """Inverted dropout of x with drop probability p (identity when not training or p == 0)."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or p >= 1.0:
        return F.dropout(x, p, training=True)
    dropped = round(p * _LEVELS)
    if dropped == 0:
        return x
    if dropped == _LEVELS:
        return x * 0.0
    return _MaskedScale.apply(x, drop_mask(x.shape, p, x.device), _LEVELS / (_LEVELS - dropped))


class Dropout(nn.Dropout):
    """``nn.Dropout`` (same attribute ``p``, same state dict) with the cheaper CPU mask above."""

    def forward(self, x: Tensor) -> Tensor:
        """x -> x with elements dropped and the rest rescaled (training), or x (evaluation)."""
        return dropout(x, self.p, self.training)
