"""Swap a plain model's modules for their fast twins, by class, and back.

A twin is a subclass of a plain module class that adds no parameters or buffers and computes
the same function (tested equal, values and gradients) by a faster route on some hardware.
Swapping sets ``module.__class__``: parameters, state-dict names and optimiser state are
untouched, and ``to_plain`` undoes it. Nothing else in the model changes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from attnlab.errors import AttnlabError

TRAINING, INFERENCE = "training", "inference"


@dataclass(frozen=True)
class Speedup:
    """One speed-up: a plain class, its twin, when it is used, and whether it helps on this host."""

    name: str  # short and unique, e.g. "linear", "dropout", "attention"
    plain: type[nn.Module]
    twin: type[nn.Module]
    uses: tuple[str, ...]  # TRAINING and/or INFERENCE
    applies: Callable[[], bool]  # whether the route helps here (CPU vendor, bf16 units, device)
    why: str  # one line: what it does differently


def registry() -> list[Speedup]:
    """Every module speed-up attnlab has, in the order they are applied."""
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


def swap(model: nn.Module, speedups: list[Speedup]) -> nn.Module:
    """Give every module whose class is exactly a speed-up's plain class that twin's class."""
    twins = {s.plain: s.twin for s in speedups}
    for module in model.modules():
        twin = twins.get(type(module))
        if twin is not None:
            module.__class__ = twin
    return model


def to_plain(model: nn.Module) -> nn.Module:
    """Undo every swap: each twin module gets its plain class back."""
    plains = {s.twin: s.plain for s in registry()}
    for module in model.modules():
        plain = plains.get(type(module))
        if plain is not None:
            module.__class__ = plain
    return model
