"""Every speed-up of attnlab, in one place and opt-in: fast twins swapped in by class.

The model layer (``attnlab.nn``, ``attnlab.models``) is plain PyTorch and runs without this
package. The jobs (pretrain, distill, finetune, translate, embed) call ``for_training`` or
``for_inference`` on their models, and give the trainer ``TrainingSpeedups``; the Python API's
models stay plain unless asked. ``ATTNLAB_SPEEDUPS`` picks speed-ups by name (fast/swap.py:
chosen); ``attnlab info --speedups`` lists them and the route taken here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from attnlab.fast.route import describe_route, route_line
from attnlab.fast.swap import (
    INFERENCE,
    TRAINING,
    Speedup,
    chosen,
    registry,
    swap,
    swapped,
    to_plain,
)
from attnlab.fast.training import TrainingSpeedups


def for_training(model: nn.Module, names: str | None = None) -> nn.Module:
    """The model (same object) with the training twins that apply here swapped in."""
    return swap(model, chosen(TRAINING, names))


def for_inference(model: nn.Module, names: str | None = None) -> nn.Module:
    """The model (same object) with the inference twins that apply here swapped in."""
    return swap(model, chosen(INFERENCE, names))


def for_serving(model: nn.Module, names: str | None = None) -> nn.Module:
    """The model (same object) frozen (no parameter needs a gradient), its inference twins in."""
    model.requires_grad_(False)
    return swap(model, chosen(INFERENCE, names))


@contextmanager
def inference_twins(model: nn.Module, names: str | None = None) -> Iterator[nn.Module]:
    """The model with its inference twins inside the block (an evaluation during training),
    its own classes (training twins, say) after."""
    with swapped(model, chosen(INFERENCE, names)):
        yield model


def report(names: str | None = None) -> str:
    """The route taken here, then each speed-up: its uses, whether it applies here and is
    chosen (``names``, default ATTNLAB_SPEEDUPS), and what it does."""
    picked = {s.name for use in (TRAINING, INFERENCE) for s in chosen(use, names)}
    rows = [route_line(), "", f"{'speed-up':18} {'used for':20} {'here':5} {'chosen':7} what"]
    for s in registry():
        here = "yes" if s.applies() else "no"
        used = "+".join(s.uses)
        rows.append(
            f"{s.name:18} {used:20} {here:5} {'yes' if s.name in picked else 'no':7} {s.why}"
        )
    return "\n".join(rows)


__all__ = [
    "INFERENCE",
    "TRAINING",
    "Speedup",
    "TrainingSpeedups",
    "chosen",
    "describe_route",
    "for_inference",
    "for_serving",
    "for_training",
    "inference_twins",
    "registry",
    "report",
    "route_line",
    "swap",
    "to_plain",
]
