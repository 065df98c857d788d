"""Keep glibc malloc from handing a training step's large temporaries back to the kernel.

glibc serves requests above its mmap threshold (at most 32 MB) with fresh mappings and returns
them when freed, and trims freed memory at the top of its heap. A training step allocates and
frees the same large buffers every step (bert-small at batch 32: the 4,096 x 2,048 feed-forward
activations and their gradients, 33.5 MB each; the MLM logits; the word-embedding gradient),
so every step faults those pages in again, each one zeroed by the kernel. With the setting here
freed memory stays in the heap for the next step: `attnlab bench pretrain --preset bert-small
--batch-size 32` ran 17% faster with it on a 2-core AVX-512 host (bench/RESULTS.md). The
process holds on to its peak memory instead; ``ATTNLAB_MALLOC=default`` leaves glibc as it is.

What it holds is more than one step's peak: the temporaries differ in size and order from step
to step (the masked rows of each batch among them), so freed blocks are split and the heap
grows around them, fast at first and slowly after (bert-mini, batch 32 x 128: resident 1.3 GB
at step 50, 1.95-2.46 GB at step 1,150 in three runs, with 0.27 GB in use between steps).
Handing the free pages back every minute (malloc_trim) kept it at 1.0-1.8 GB but cost 1.5-2.4%
of the speed, so the trainer does not (bench/pretrain_memory.py, bench/RESULTS.md).
"""

from __future__ import annotations

import ctypes
import os
import platform

from attnlab.errors import AttnlabError

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's malloc.h
_applied = False


def keep_freed_memory() -> bool:
    """Make glibc malloc reuse freed memory (no per-step page faults); True where it is in effect.

    False off glibc, or when the environment sets ``ATTNLAB_MALLOC=default``.
    """
    global _applied
    if _applied:
        return True
    setting = os.environ.get("ATTNLAB_MALLOC", "keep")
    if setting not in ("keep", "default"):
        raise AttnlabError(f"ATTNLAB_MALLOC must be 'keep' or 'default', got {setting!r}")
    if setting == "default":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    # Every request from the heap (glibc still maps memory when the heap cannot grow), and the
    # heap trimmed only when more than 2 GB (mallopt takes a C int) lie free at its top.
    _applied = bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    )
    return _applied
