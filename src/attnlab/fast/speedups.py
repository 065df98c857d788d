"""The list of module speed-ups (fast/swap.py: Speedup), one entry per twin."""

from __future__ import annotations

from attnlab.fast.swap import Speedup

SPEEDUPS: list[Speedup] = []
