"""The fast twin of the summed KL divergence (nn/loss.py): the same numbers, a block of rows at a time.

Distillation's soft-target term, the KL divergence between a teacher's and a student's
softened distributions (Hinton et al. 2015), over a large (rows, vocabulary) pair of logits
that is never in cache inside a step. ``F.kl_div`` of two ``log_softmax``es writes and rereads
whole (rows, vocab) tensors; here each block of rows has its two log-softmaxes computed in
cache, and between the passes the loss keeps one KL a row: less peak memory, and under bf16
autocast less time too. The twin serves CPU tensors outside ``torch.compile``; elsewhere the
plain module computes.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from attnlab.nn.loss import SummedKLDivergence, check_kl_inputs

_BLOCK_ELEMENTS = 1 << 18  # a block of rows in compute precision: 1 MB in fp32, cache-sized


def _block_rows(vocab: int) -> int:
    """Rows of a block: _BLOCK_ELEMENTS values of a vocabulary-wide row, at least one row."""
    return max(1, _BLOCK_ELEMENTS // max(vocab, 1))


def _widened(*tensors: Tensor) -> torch.dtype:
    """The dtype a loss computes in: the tensors' own, at least fp32 (fp64 stays fp64)."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _log_softmax_blocks(
    student: Tensor, teacher: Tensor, temperature: float
) -> Iterator[tuple[slice, Tensor, Tensor]]:
    """Yield (rows, log q, log p): a block's log_softmax(x / T) of student and teacher logits.

    Both are computed in fp32 at least, in two block-sized buffers that each block reuses.
    """
    rows, vocab = student.shape
    block = _block_rows(vocab)
    dtype = _widened(student, teacher)
    scaled, log_q, log_p = (
        student.new_empty((min(block, rows), vocab), dtype=dtype) for _ in range(3)
    )
    for start in range(0, rows, block):
        part = slice(start, min(start + block, rows))
        n = part.stop - start
        for logits, out in ((student, log_q), (teacher, log_p)):
            torch.div(logits[part].to(dtype), temperature, out=scaled[:n])  # in fp32 (bf16)
            torch.log_softmax(scaled[:n], -1, out=out[:n])
        yield part, log_q[:n], log_p[:n]


class _SummedKLDivergence(torch.autograd.Function):
    # Each block's two log-softmaxes are computed in cache and recomputed in the backward
    # pass; between the passes the loss keeps one number a row, its KL.
    @staticmethod
    def forward(ctx: FunctionCtx, student: Tensor, teacher: Tensor, temperature: float) -> Tensor:
        kl = student.new_empty(len(student), dtype=_widened(student, teacher))
        for part, log_q, log_p in _log_softmax_blocks(student, teacher, temperature):
            diff = log_q.neg_().add_(log_p)  # log p - log q
            torch.linalg.vecdot(log_p.exp_(), diff, out=kl[part])  # sum of p (log p - log q)
        ctx.save_for_backward(student, teacher, kl)
        ctx.temperature = temperature
        return kl.sum()

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        student, teacher, kl = ctx.saved_tensors
        needs_student, needs_teacher = ctx.needs_input_grad[:2]
        scale = grad / ctx.temperature  # the logits enter divided by T
        d_student = torch.empty_like(student) if needs_student else None
        d_teacher = torch.empty_like(teacher) if needs_teacher else None
        for part, log_q, log_p in _log_softmax_blocks(student, teacher, ctx.temperature):
            if needs_teacher:  # p (log p - log q - KL): the row's KL moved by the teacher's logits
                diff = (log_p - log_q).sub_(kl[part, None])
                d_teacher[part] = diff.mul_(log_p.exp()).mul_(scale)
            if needs_student:  # q - p
                d_student[part] = log_q.exp_().sub_(log_p.exp_()).mul_(scale)
        return d_student, d_teacher, None


def summed_kl_divergence(student: Tensor, teacher: Tensor, temperature: float = 1.0) -> Tensor:
    """sum over rows of KL(softmax(teacher / T) || softmax(student / T)): logits (rows, vocab).

    Distillation's soft-target term (Hinton et al. 2015) without the whole (rows, vocab)
    log-softmaxes, products and their gradients that ``F.kl_div`` of two ``log_softmax`` writes
    and rereads; half-precision logits are widened a block at a time and get their gradients
    in their own dtype. Values and gradients are F.kl_div's (log_target=True) of the two.
    """
    check_kl_inputs(student, teacher)
    return _SummedKLDivergence.apply(student, teacher, temperature)


def _served(*tensors: Tensor) -> bool:
    """Whether the blocked losses compute these logits: CPU tensors, outside torch.compile."""
    return all(t.device.type == "cpu" for t in tensors) and not torch.compiler.is_compiling()


class BlockedKLDivergence(SummedKLDivergence):
    """Twin of SummedKLDivergence: both log-softmaxes a block of rows at a time, in cache."""

    def forward(self, student: Tensor, teacher: Tensor, temperature: float = 1.0) -> Tensor:
        """A 0-d loss; gradients reach the student's (and a teacher's that needs them) logits."""
        if _served(student, teacher):
            return summed_kl_divergence(student, teacher, temperature)
        return super().forward(student, teacher, temperature)
