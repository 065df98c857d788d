"""Summed softmax cross-entropy over a large vocabulary (the masked-LM loss, BERT section 3.1).

``loss = sum_i -log softmax(z_i)[y_i]``, whose gradient is ``softmax(z_i) - onehot(y_i)``.
Autograd's ``log_softmax`` + ``nll_loss`` gets there with two new (rows, vocab) tensors in
the backward pass: a zero-filled one for the NLL gradient and another for log_softmax's, and
an exponential of every logit in each direction. Here the forward pass keeps the
probabilities (a tensor of this function's own, never handed out), and the loss takes the
log of the labels' entries only; the backward pass turns the probabilities into the gradient
in place: minus one at each label, times the incoming gradient. So the exponentials are
computed once, not twice: forward and backward on bert-small's (598, 30,522) logits, a 70 MB
tensor, took 20.2 against 32.6 ms for ``F.cross_entropy`` (bench/step_parts.py, 2-core Xeon).
A label whose probability underflows float32's smallest normal number takes its loss from
``log_softmax`` of its row, exact as before.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx


class _SummedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, logits: Tensor, target: Tensor) -> Tensor:
        probs = torch.softmax(logits, dim=-1)  # (rows, vocab)
        ctx.save_for_backward(probs, target)
        ctx.spent = False
        picked = probs.gather(1, target.unsqueeze(1)).squeeze(1)
        tiny = picked < torch.finfo(picked.dtype).tiny  # log would lose precision, or be -inf
        if bool(tiny.any()):
            exact = torch.log_softmax(logits[tiny], dim=-1).gather(1, target[tiny].unsqueeze(1))
            return -(picked[~tiny].log().sum() + exact.sum())
        return -picked.log().sum()

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        if ctx.spent:  # its saved tensor became the first backward's gradient
            raise RuntimeError("summed_cross_entropy: backward through the same loss twice")
        ctx.spent = True
        d_logits, target = ctx.saved_tensors  # the probabilities, turned into the gradient
        d_logits[torch.arange(len(target), device=target.device), target] -= 1.0
        return d_logits.mul_(grad), None


def summed_cross_entropy(logits: Tensor, target: Tensor) -> Tensor:
    """sum over rows of -log softmax(logits)[target]: logits (rows, vocab) in fp32, target (rows,)."""
    return _SummedCrossEntropy.apply(logits, target)
