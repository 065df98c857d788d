"""Losses over a large vocabulary: the masked-LM cross-entropy (BERT 3.1), distillation's KL.

Both are sums over rows, computed in fp32 at least (fp64 logits stay fp64), so that the
caller divides by the count it wants (the masked tokens of a whole step, say). Each is a
module so that the jobs can swap in a twin that computes the same numbers with less memory
traffic (fast/loss.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.errors import AttnlabError


def _widened(logits: Tensor) -> Tensor:
    """The logits in fp32 at least (fp64 stays fp64)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


class SummedCrossEntropy(nn.Module):
    """sum over rows of -log softmax(logits)[target]: logits (rows, vocab), target (rows,)."""

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        """A 0-d loss, fp32 for half-precision logits (whose gradient comes back in their dtype)."""
        return F.cross_entropy(_widened(logits), target, reduction="sum")


class SummedKLDivergence(nn.Module):
    """sum over rows of KL(softmax(teacher / T) || softmax(student / T)): logits (rows, vocab).

    Distillation's soft-target term (Hinton et al. 2015, section 2), before its T^2 factor.
    """

    def forward(self, student: Tensor, teacher: Tensor, temperature: float = 1.0) -> Tensor:
        """A 0-d loss; gradients reach the student's (and a teacher's that needs them) logits."""
        check_kl_inputs(student, teacher)
        log_q = F.log_softmax(_widened(student) / temperature, dim=-1)
        log_p = F.log_softmax(_widened(teacher) / temperature, dim=-1)
        return F.kl_div(log_q, log_p, reduction="sum", log_target=True)


def check_kl_inputs(student: Tensor, teacher: Tensor) -> None:
    """Refuse logits that are not both (rows, vocab) of one shape."""
    if student.dim() != 2 or student.shape != teacher.shape:
        raise AttnlabError(
            f"student and teacher logits must both be (rows, vocab), got "
            f"{tuple(student.shape)} and {tuple(teacher.shape)}"
        )
