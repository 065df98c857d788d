"""Running a model in evaluation mode for a while, then handing it back as it was."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """The model in evaluation mode (no dropout) inside the block, in the caller's mode after."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)
