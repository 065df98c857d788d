"""Swap a plain model's modules for their fast twins, by class, and back.

A twin is a subclass of a plain module class that adds no parameters or buffers and computes
the same function (tested equal, values and gradients) by a faster route on some hardware.
Swapping sets ``module.__class__``: parameters, state-dict names and optimiser state are
untouched, and ``to_plain`` undoes it.

Speed-ups that are not modules (the trainer's, fast/training.py) are listed the same way,
without a plain class or twin, so that one ``ATTNLAB_SPEEDUPS`` names them all.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import nn

from attnlab.errors import AttnlabError

TRAINING, INFERENCE = "training", "inference"


@dataclass(frozen=True)
class Speedup:
    """One speed-up: a plain class, its twin, when it is used, and whether it helps on this host."""

    name: str  # short and unique, e.g. "linear", "dropout", "attention"
    plain: type[nn.Module] | None  # None for a speed-up that is not a module (fast/training.py)
    twin: type[nn.Module] | None
    uses: tuple[str, ...]  # TRAINING and/or INFERENCE
    applies: Callable[[], bool]  # whether the route helps here (CPU vendor, bf16 units, device)
    why: str  # one line: what it does differently


def registry() -> list[Speedup]:
    """Every speed-up attnlab has, in the order they are applied."""
    from attnlab.fast import speedups  # the list lives beside the twins

    return list(speedups.SPEEDUPS)


def chosen(use: str, names: str | None = None) -> list[Speedup]:
    """The speed-ups for ``use`` that apply here and that ``names`` selects.

    ``names`` (default: the environment's ``ATTNLAB_SPEEDUPS``, else "all") is "all", "none",
    or a comma-separated list of names to use, or of ``-name`` to leave out.
    """
    spec = (names if names is not None else os.environ.get("ATTNLAB_SPEEDUPS", "all")).strip()
    known = {s.name for s in registry()}
    candidates = [s for s in registry() if use in s.uses and s.applies()]
    if spec in ("", "all"):
        return candidates
    if spec == "none":
        return []
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    unknown = sorted({p.lstrip("-") for p in parts} - known)
    if unknown:
        raise AttnlabError(
            f"unknown speed-up {', '.join(unknown)}: choose from {', '.join(sorted(known))}"
        )
    dropped = {p[1:] for p in parts if p.startswith("-")}
    kept = {p for p in parts if not p.startswith("-")}
    if kept and dropped:
        raise AttnlabError("name the speed-ups to use, or those to leave out with -, not both")
    if kept:
        return [s for s in candidates if s.name in kept]
    return [s for s in candidates if s.name not in dropped]


def _plain_class(cls: type) -> type:
    """The plain class of a twin class; any other class is its own."""
    for s in registry():
        if s.twin is cls and s.plain is not None:
            return s.plain
    return cls


def swap(model: nn.Module, speedups: list[Speedup]) -> nn.Module:
    """Give every module of a speed-up's plain class (or another twin of it) that twin's class."""
    twins = {s.plain: s.twin for s in speedups if s.plain is not None}
    for module in model.modules():
        twin = twins.get(_plain_class(type(module)))
        if twin is not None:
            module.__class__ = twin
    return model


def to_plain(model: nn.Module) -> nn.Module:
    """Undo every swap: each twin module gets its plain class back."""
    for module in model.modules():
        module.__class__ = _plain_class(type(module))
    return model


@contextmanager
def swapped(model: nn.Module, speedups: list[Speedup]) -> Iterator[nn.Module]:
    """The model with these twins inside the block, each module's own class again after."""
    before = {module: type(module) for module in model.modules()}
    swap(model, speedups)
    try:
        yield model
    finally:
        for module, cls in before.items():
            module.__class__ = cls
