"""Summed softmax cross-entropy over a large vocabulary (the masked-LM loss, BERT section 3.1).

``loss = sum_i -log softmax(z_i)[y_i]``, whose gradient is ``softmax(z_i) - onehot(y_i)``.
Autograd's ``log_softmax`` + ``nll_loss`` gets there with two new (rows, vocab) tensors in
the backward pass: a zero-filled one for the NLL gradient and another for log_softmax's. Here
the forward pass keeps its log-probabilities (a tensor of this function's own, never handed
out) and the backward pass turns them into that gradient in place: exp, minus one at each
label, times the incoming gradient. At bert-small that tensor is 576 x 30,522 floats (70 MB).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx


class _SummedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, logits: Tensor, target: Tensor) -> Tensor:
        logp = torch.log_softmax(logits, dim=-1)  # (rows, vocab)
        ctx.save_for_backward(logp, target)
        ctx.spent = False
        return -logp.gather(1, target.unsqueeze(1)).sum()

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        if ctx.spent:  # its saved tensor became the first backward's gradient
            raise RuntimeError("summed_cross_entropy: backward through the same loss twice")
        ctx.spent = True
        logp, target = ctx.saved_tensors
        d_logits = logp.exp_()  # softmax, in place
        d_logits[torch.arange(len(target), device=target.device), target] -= 1.0
        return d_logits.mul_(grad), None


def summed_cross_entropy(logits: Tensor, target: Tensor) -> Tensor:
    """sum over rows of -log softmax(logits)[target]: logits (rows, vocab) in fp32, target (rows,)."""
    return _SummedCrossEntropy.apply(logits, target)
