"""The one seam through which an opt-in speed-up changes how the trainer trains.

The trainer itself is plain PyTorch: ``clip_grad_norm_`` then ``optimizer.step()``, no
process-wide settings, the user's model left as it is. A job that wants more passes an object
of a subclass (fast/training.py: TrainingSpeedups) as ``Trainer(..., speedups=...)``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from attnlab.train.trainer import Trainer


class TrainerHooks:
    """What a trainer lets a speed-up change; this base changes nothing."""

    def running(self, trainer: Trainer) -> contextlib.AbstractContextManager[None]:
        """A context entered around fit()'s training loop (model built, device and DDP known)."""
        return contextlib.nullcontext()

    def after_step(self, trainer: Trainer) -> None:
        """Called after every optimiser step (and its logging, evaluation and checkpoint)."""

    def clipped_step(
        self, optimizer: torch.optim.Optimizer, parameters: Iterable[Tensor], max_norm: float
    ) -> Tensor:
        """optimizer.step() on gradients clipped to a total 2-norm of max_norm; the norm before."""
        with_grads = [p for p in parameters if p.grad is not None]
        if not with_grads:
            optimizer.step()
            return torch.tensor(0.0)
        total = torch.nn.utils.get_total_norm([p.grad for p in with_grads])
        # Within the bound torch scales every gradient by exactly 1; on CPU, where asking costs
        # no device sync, that pass over all gradients is skipped (NaN norms still scale).
        within = total.device.type == "cpu" and bool(total + 1e-6 <= max_norm)
        if max_norm < math.inf and not within:
            torch.nn.utils.clip_grads_with_norm_(with_grads, max_norm, total)
        optimizer.step()
        return total
