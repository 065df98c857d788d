"""Summed softmax cross-entropy over a large vocabulary (the masked-LM loss, BERT section 3.1).

``loss = sum_i logsumexp(z_i) - z_i[y_i]``, whose gradient is ``softmax(z_i) - onehot(y_i)``.
The logits of a pretraining step are a large tensor (bert-small: 598 masked rows x 30,522,
73 MB in fp32), and inside a step it is never in cache: each pass over it costs memory
traffic, not arithmetic (a softmax over it took 22.5 ms there, 7 ms timed alone). So the
forward pass keeps one number a row, the log-sum-exp, and the backward pass recomputes
``exp(z - lse)`` a block of rows at a time, turning it into the gradient while the block is
in cache and writing it once, in the logits' own dtype. Autograd's ``log_softmax`` +
``nll_loss``, or a softmax kept for the backward pass, writes and rereads whole (rows, vocab)
tensors instead, and bf16 logits (autocast) would first be widened to a whole fp32 copy.
The loss is exact where softmax(z)[y] underflows (a gap of hundreds): lse - z[y] is that gap.
Sums are in fp32 at least (fp64 logits stay fp64).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

_BLOCK_ELEMENTS = 1 << 18  # a block of rows in compute precision: 1 MB in fp32, cache-sized


class _SummedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, logits: Tensor, target: Tensor) -> Tensor:
        rows, vocab = logits.shape
        block = max(1, _BLOCK_ELEMENTS // max(vocab, 1))
        dtype = torch.promote_types(logits.dtype, torch.float32)  # fp32, or fp64 for fp64
        lse = logits.new_empty(rows, dtype=dtype)
        for start in range(0, rows, block):  # widened a block at a time (bf16), in cache
            torch.logsumexp(
                logits[start : start + block].to(dtype), -1, out=lse[start : start + block]
            )
        picked = logits.gather(1, target.unsqueeze(1)).squeeze(1).to(dtype)
        ctx.save_for_backward(logits, target, lse)
        ctx.block = block
        return (lse - picked).sum()

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        logits, target, lse = ctx.saved_tensors
        d_logits = torch.empty_like(logits)
        widen = lse.dtype != logits.dtype  # half-precision logits: computed in a wider block
        rows = min(ctx.block, len(logits))
        scratch = logits.new_empty((rows, logits.shape[1]), dtype=lse.dtype) if widen else None
        for start in range(0, len(logits), ctx.block):
            end = min(start + ctx.block, len(logits))
            out = d_logits[start:end]
            block = scratch[: end - start] if scratch is not None else out
            torch.sub(logits[start:end], lse[start:end, None], out=block)
            block.exp_()  # softmax of the block's rows
            block[torch.arange(end - start, device=block.device), target[start:end]] -= 1.0
            block.mul_(grad)
            if widen:
                out.copy_(block)
        return d_logits, None


def summed_cross_entropy(logits: Tensor, target: Tensor) -> Tensor:
    """sum over rows of -log softmax(logits)[target]: logits (rows, vocab), target (rows,).

    The loss is fp32 for half-precision logits, whose gradient comes back in their dtype.
    """
    return _SummedCrossEntropy.apply(logits, target)
