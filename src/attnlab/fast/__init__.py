"""Every speed-up of attnlab, in one place and opt-in: fast twins swapped in by class.

The model layer (``attnlab.nn``, ``attnlab.models``) is plain PyTorch and runs without this
package. The jobs (pretrain, distill, finetune, translate, embed) call ``for_training`` or
``for_inference`` on their models; the Python API's models stay plain unless asked.
"""

from __future__ import annotations

from torch import nn

from attnlab.fast.swap import INFERENCE, TRAINING, Speedup, chosen, registry, swap, to_plain


def for_training(model: nn.Module, names: str | None = None) -> nn.Module:
    """The model (same object) with the training twins that apply here swapped in."""
    return swap(model, chosen(TRAINING, names))


def for_inference(model: nn.Module, names: str | None = None) -> nn.Module:
    """The model (same object) with the inference twins that apply here swapped in."""
    return swap(model, chosen(INFERENCE, names))


__all__ = [
    "INFERENCE",
    "TRAINING",
    "Speedup",
    "chosen",
    "for_inference",
    "for_training",
    "registry",
    "swap",
    "to_plain",
]
