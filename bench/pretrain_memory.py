"""Resident memory through a pretraining run, and what handing freed memory back would change.

The trainer keeps freed memory in glibc's heap (fast/training.py: keep_freed_memory). This
runs the pretraining recipe's data, model and trainer (bert-mini on the Chinese corpus of
bench/pretrain_quality.py, batch 32 x 128, no evaluation or checkpoints) and prints one JSON
row every --log-every steps: the process's resident size and glibc's heap figures
(mallinfo2: the heap's size, what is in use, what lies free). --release-every S also hands
the heap's free pages back to the kernel (glibc's malloc_trim) between steps once S seconds
have passed; the trainer does not.

Usage: python bench/pretrain_memory.py --out DIR [--steps 1000] [--release-every never|60]
       [--threads 1] [--preset bert-mini] [--lang zh|en] [--max-predictions N]
Run two settings side by side (one thread each) to compare them under the same conditions;
the rows' tokens/s are in DIR/run/metrics.jsonl.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import machine
from pretrain_quality import shared_data


class MallInfo2(ctypes.Structure):
    """glibc's struct mallinfo2 (malloc.h), sizes in bytes."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]  # fmt: skip


def memory_row() -> dict[str, float]:
    """Resident size and the heap's size / in use / free, in MB."""
    page = os.sysconf("SC_PAGE_SIZE")
    resident = int(Path("/proc/self/statm").read_text().split()[1]) * page
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    heap = libc.mallinfo2()
    mb = 1e6
    return {
        "resident_mb": round(resident / mb, 1),
        "heap_mb": round(heap.arena / mb, 1),
        "in_use_mb": round(heap.uordblks / mb, 1),
        "free_mb": round(heap.fordblks / mb, 1),
        "mapped_mb": round(heap.hblkhd / mb, 1),
    }


def main() -> None:
    """Train for --steps and print a memory row every --log-every steps."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--release-every", default="never", help="seconds, or 'never'")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--preset", default="bert-mini")
    parser.add_argument("--lang", choices=("zh", "en"), default="zh")
    parser.add_argument("--max-predictions", type=int, help="masked tokens per sequence at most")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from attnlab.tasks.pretrain import build_model, prepare_data
    from attnlab.train import TrainConfig, Trainer

    release = math.inf if args.release_every == "never" else float(args.release_every)
    opts, corpus, tokenizer = shared_data(
        args.out, args.lang, 21128 if args.lang == "zh" else 8192, preset=args.preset,
        batch_size=32, seq_len=128, max_predictions=args.max_predictions,
    )  # fmt: skip
    job = prepare_data(opts, [corpus], tokenizer)
    torch.manual_seed(0)
    model = build_model(opts, tokenizer)
    config = TrainConfig(
        out_dir=args.out / "run", steps=args.steps, lr=5e-4, warmup=args.steps // 10,
        log_every=args.log_every, save_every=0, overwrite=True, progress=False, seed=0,
    )  # fmt: skip
    print(json.dumps({"bench": "pretrain_memory", "machine": machine(), **vars(args)}, default=str))
    Trainer(model, MemoryProbe(job.batches, args.log_every, release), config).fit()


class MemoryProbe:
    """A BatchSource that passes the recipe's batches on, printing a memory row every N steps.

    Between steps (before it hands over a batch) it also calls malloc_trim once `release`
    seconds have passed since the last call.
    """

    def __init__(self, batches: object, every: int, release: float) -> None:
        self.batches, self.every, self.release = batches, every, release
        self.started = self.released = time.perf_counter()

    def __iter__(self):
        libc = ctypes.CDLL(None)
        for step, batch in enumerate(self.batches):
            if time.perf_counter() - self.released >= self.release:
                libc.malloc_trim(ctypes.c_size_t(0))
                self.released = time.perf_counter()
            if step and step % self.every == 0:  # the steps before this batch are done
                minutes = round((time.perf_counter() - self.started) / 60, 2)
                print(json.dumps({"step": step, "minutes": minutes, **memory_row()}), flush=True)
            yield batch

    def state_dict(self) -> dict:
        """The recipe's position."""
        return self.batches.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Go back to a position of the recipe's."""
        self.batches.load_state_dict(state)

    def set_rank(self, rank: int, world_size: int) -> None:
        """Take this rank's share."""
        self.batches.set_rank(rank, world_size)


if __name__ == "__main__":
    main()
