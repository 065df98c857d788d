"""The trainer's speed-up that is not a module: freed memory kept by glibc.

``TrainingSpeedups`` hands it to the trainer (train/hooks.py), on unless ``ATTNLAB_SPEEDUPS``
leaves "keep_freed_memory" out. glibc serves requests above its mmap threshold with fresh
mappings and returns them when freed, and trims freed memory at the top of its heap. A training
step allocates and frees the same large buffers every step (feed-forward activations and their
gradients, the MLM logits, the word-embedding gradient), so every step faults those pages in
again, each one zeroed by the kernel. With ``mallopt`` set here freed memory stays in the heap
for the next step. Held for good, that memory grows: temporaries differ in size from step to
step (translation batches, evaluation's decoding), so freed blocks are split and the heap grows
around them. So once a ``RELEASE_SECONDS`` the trainer hands the free pages back
(``malloc_trim``): a few page faults a minute instead of a step's worth each step.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import platform
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from attnlab.fast.route import fast_bf16_matmul
from attnlab.fast.swap import TRAINING, Speedup, chosen
from attnlab.train.hooks import TrainerHooks

if TYPE_CHECKING:
    from attnlab.train.trainer import Trainer


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's malloc.h


def _glibc() -> bool:
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@functools.cache
def keep_freed_memory() -> bool:
    """Make glibc malloc reuse freed memory (no per-step page faults); True where it is in effect.

    For the whole process, once; False off glibc.
    """
    if not _glibc():
        return False
    libc = ctypes.CDLL(None)
    # Every request from the heap (glibc still maps memory when the heap cannot grow), and the
    # heap trimmed only when more than 2 GB (mallopt takes a C int) lie free at its top.
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def release_freed_memory() -> None:
    """Hand glibc malloc's free pages (in every arena, not only the heap's top) back to the system."""
    if _glibc():
        ctypes.CDLL(None).malloc_trim(0)


TRAINER_SPEEDUPS = [
    Speedup(
        "keep_freed_memory", None, None, (TRAINING,), _glibc,
        "glibc malloc keeps freed memory for the next step, handed back once a minute (glibc only)",
    ),
]  # fmt: skip


class TrainingSpeedups(TrainerHooks):
    """The trainer's speed-ups that ``names`` (default: ATTNLAB_SPEEDUPS) selects and apply here."""

    RELEASE_SECONDS = 60.0  # how often kept freed memory goes back (keep_freed_memory above)

    def __init__(self, names: str | None = None) -> None:
        self.names = {s.name for s in chosen(TRAINING, names)}
        self.released_at = time.monotonic()

    @contextlib.contextmanager
    def running(self, trainer: Trainer) -> Iterator[None]:
        """Around fit()'s loop: malloc settings, a note on bf16."""
        if "keep_freed_memory" in self.names:
            keep_freed_memory()
            self.released_at = time.monotonic()
        on_cpu = trainer.device.type == "cpu"
        if trainer.config.precision == "bf16" and on_cpu and trainer.is_main:
            _note_bf16()
        yield

    def after_step(self, trainer: Trainer) -> None:
        """Once a RELEASE_SECONDS, give the memory malloc keeps for the next step back."""
        if "keep_freed_memory" in self.names and self._release_due():
            release_freed_memory()
            self.released_at = time.monotonic()

    def _release_due(self) -> bool:
        return time.monotonic() - self.released_at >= self.RELEASE_SECONDS


def _note_bf16() -> None:
    if fast_bf16_matmul() is False:  # fast/linear.py: bf16_by_fp32
        print(
            "note: this CPU multiplies bf16 no faster than fp32 (it has no AMX, nor AMD's "
            "avx512_bf16): --precision bf16 computes its bf16 products with the fp32 "
            "kernel here, so it is no faster than fp32",
            file=sys.stderr,
        )
