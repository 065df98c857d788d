"""A cheaper CPU dropout mask: ``FastDropout``, twin of ``nn.Dropout``, and the attention twin's
dropout on the attention weights.

PyTorch's ``F.dropout`` on CPU draws one random number per element with ``bernoulli_``, the
largest cost of a training step after the products. Here each 64-bit random draw gives four
16-bit uniform integers, and an element is dropped when its integer falls among the lowest
``round(p * 2**16)`` of the 65,536 values. So the drop rate is p rounded to a multiple of
2**-16 (0.1 becomes 0.100006), and the survivors are scaled by the reciprocal of the rounded
keep rate, which keeps the expectation exact. Other devices call ``F.dropout``, already one
fused kernel there.

The 64-bit draws come from numpy's PCG64DXSM, seeded from PyTorch's default generator (one
seed per mask): so ``torch.manual_seed`` fixes the masks and a checkpoint's RNG state restores
them (resume stays bit-exact). The masked product ``h * keep * scale`` is one ``addcmul``,
one pass over the data (``_MaskedScale``).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx

_LEVELS = 1 << 16  # values of one 16-bit random integer


def _threshold(p: float) -> int:
    # int16 values below this are the lowest round(p * 2**16) of the 65,536
    return round(p * _LEVELS) - _LEVELS // 2


def keep_mask(shape: torch.Size | tuple[int, ...], p: float, device: torch.device) -> Tensor:
    """uint8 mask of ``shape``: 1 (kept) with probability 1 - round(p * 2**16) / 2**16, else 0."""
    n = math.prod(shape)
    seed = int(torch.empty((), dtype=torch.int64).random_())  # advances torch's generator
    words = np.random.PCG64DXSM(seed).random_raw((n + 3) // 4)  # four 16-bit integers each
    keep = words.view(np.int16)[:n] >= _threshold(p)
    return torch.from_numpy(keep).view(torch.uint8).view(shape).to(device)


class _MaskedScale(torch.autograd.Function):
    """y = h * keep * scale in one pass (keep is 0/1); h's gradient is masked the same way.

    One ``addcmul`` into a 0-d zero reads h and the 1-byte mask and writes y, where ``where``
    then ``mul_`` pass over the data twice. A dropped element is h * 0, so an infinite or NaN
    input gives NaN there.
    """

    @staticmethod
    def forward(ctx: FunctionCtx, h: Tensor, keep: Tensor, scale: float) -> Tensor:
        """h * keep * scale."""
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return torch.addcmul(h.new_zeros(()), h, keep, value=scale)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, None, None]:
        """The gradient to h, masked and scaled."""
        (keep,) = ctx.saved_tensors
        return torch.addcmul(grad.new_zeros(()), grad, keep, value=ctx.scale), None, None


def has_keep_mask(p: float) -> bool:
    """Whether dropout at rate p draws a mask here: p rounded to 2**-16 is neither 0 nor 1."""
    return 0 < round(p * _LEVELS) < _LEVELS


def dropout_scale(p: float) -> float:
    """The survivors' factor: 1 / keep rate, the keep rate being 1 - p rounded to 2**-16."""
    return _LEVELS / (_LEVELS - round(p * _LEVELS))


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """Inverted dropout of x with drop probability p (identity when not training or p == 0)."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or p >= 1.0 or torch.compiler.is_compiling():
        return F.dropout(x, p, training=True)
    if has_keep_mask(p):
        return _MaskedScale.apply(x, keep_mask(x.shape, p, x.device), dropout_scale(p))
    return x if round(p * _LEVELS) == 0 else x * 0.0  # p within 2**-17 of 0 or of 1


class FastDropout(nn.Dropout):
    """Twin of nn.Dropout (same attribute ``p``, no state) with the cheaper CPU mask above."""

    def forward(self, x: Tensor) -> Tensor:
        """x -> x with elements dropped and the rest rescaled (training), or x (evaluation)."""
        return dropout(x, self.p, self.training)
