"""Shared benchmark helpers: the machine's measured matmul peak, timing, data loading, and the
pretraining step timed against HF's (a synthetic masked batch, the trainer's step)."""

from __future__ import annotations

import functools
import gzip
import os
import platform
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import TypeVar

import torch

from attnlab.fast.route import cpu_field

T = TypeVar("T")
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def layer_flops(tokens: int, rows: int, keys: int, d: int, d_ff: int) -> int:
    """Forward matmul FLOPs of one encoder layer over `tokens` positions, `rows` of them queried.

    Keys and values come from every position; the query, attention (each row over `keys`
    keys), W^O and feed-forward run at the queried rows only (all of them, or just those a
    loss reads, as attnlab's last layer does).
    """
    return 2 * tokens * 2 * d * d + 2 * rows * (2 * d * d + 2 * d * d_ff) + 4 * rows * keys * d


def matmul_peak_flops(dtype: torch.dtype = torch.float32, seconds: float = 1.0) -> float:
    """Best FLOP/s of large square matmuls at the current thread count (the utilisation yardstick).

    The fastest single call counts, so a moment of contention on a shared machine lowers the
    figure less than an average would (a low peak would inflate every utilisation against it).
    Two kernels are timed, ``torch.mm`` and, for fp32 where PyTorch has oneDNN, oneDNN's
    product on a weight packed once into its blocked layout, and the faster counts (oneDNN's
    was the faster on some hosts: bench/RESULTS.md).
    """
    onednn = torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )

    def fastest_call(product: Callable[[], object]) -> float:
        with torch.inference_mode():
            product()  # warm-up
            runs, fastest, start = 0, float("inf"), time.perf_counter()
            while time.perf_counter() - start < seconds / 6 or runs < 2:
                t0 = time.perf_counter()
                product()
                fastest = min(fastest, time.perf_counter() - t0)
                runs += 1
        return fastest

    best = 0.0
    for n in (1024, 2048, 3072):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        best = max(best, 2 * n**3 / fastest_call(functools.partial(torch.mm, a, b)))
        if dtype == torch.float32 and onednn:  # a b^T on b packed: the same FLOPs
            packed = torch.ops.mkldnn._reorder_linear_weight(b)
            product = functools.partial(
                torch.ops.mkldnn._linear_pointwise, a, packed, None, "none", [], ""
            )
            best = max(best, 2 * n**3 / fastest_call(product))
    return best


def peak_dtype(precision: str) -> torch.dtype:
    """The dtype whose matmul peak is the yardstick for a run in ``precision`` ("fp32"/"bf16").

    bf16 runs are measured against the bf16 peak where the CPU multiplies bf16 faster than
    fp32 (AMX; AMD's avx512_bf16: attnlab/fast/route.py), which is what both systems'
    products then run on (2,957 against 442 GFLOP/s on a 2-core Xeon with AMX); elsewhere
    attnlab computes bf16 products with the fp32 kernel (attnlab/fast/linear.py), so the fp32
    peak stays.
    """
    from attnlab.fast.route import fast_bf16_matmul

    return torch.bfloat16 if precision == "bf16" and fast_bf16_matmul() else torch.float32


def synthetic_batch(
    vocab_size: int, batch_size: int, seq_len: int, mask_prob: float = 0.15, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random token ids as a masked pretraining batch ([CLS]/[SEP] at the ends, 15% labelled)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab_size, (batch_size, seq_len), generator=g)
    ids[:, 0], ids[:, -1] = 2, 3
    labels = torch.full_like(ids, -100)
    chosen = torch.rand(batch_size, seq_len, generator=g) < mask_prob
    chosen[:, 0] = chosen[:, -1] = False
    labels[chosen] = ids[chosen]
    ids[chosen] = 4
    types = torch.zeros_like(ids)
    types[:, seq_len // 2 :] = 1
    return {
        "input_ids": ids,
        "token_type_ids": types,
        "mlm_labels": labels,
        "nsp_labels": torch.randint(0, 2, (batch_size,), generator=g),
    }


def training_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, precision: str = "fp32"
) -> Callable[[dict[str, torch.Tensor]], float]:
    """The trainer's step (forward, backward, clip to 1.0, AdamW step) as a function of a batch.

    With the trainer's speed-up if ATTNLAB_SPEEDUPS selects it (fast/training.py): glibc
    keeping freed memory. The model's twins are the caller's choice
    (``attnlab.fast.for_training``).
    """
    from attnlab.fast.swap import TRAINING, chosen
    from attnlab.fast.training import keep_freed_memory
    from attnlab.train.hooks import TrainerHooks

    if "keep_freed_memory" in {s.name for s in chosen(TRAINING)}:
        keep_freed_memory()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else nullcontext()
    hooks = TrainerHooks()

    def step(batch: dict[str, torch.Tensor]) -> float:
        with autocast:
            loss = model(**batch)["loss"]
        loss.backward()
        hooks.clipped_step(optimizer, model.parameters(), 1.0)
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def best_time(fn: Callable[[], T], repeats: int) -> tuple[float, T]:
    """Fastest wall time of fn over repeats, after one untimed warm-up call, and its result."""
    return best_times_alternating({"fn": fn}, repeats)["fn"]


def best_times_alternating(
    fns: dict[str, Callable[[], T]], repeats: int
) -> dict[str, tuple[float, T]]:
    """best_time of each fn, their timed calls alternating (a, b, a, b, ...): a drift in the
    machine's speed then slows both sides alike."""
    results = {name: fn() for name, fn in fns.items()}  # the untimed warm-up calls
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            results[name] = fn()
            times[name].append(time.perf_counter() - start)
    return {name: (min(times[name]), results[name]) for name in fns}


def machine() -> str:
    """One line describing where the numbers come from."""
    cpu = cpu_field("model name") or platform.processor() or platform.machine()
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )


def read_gz_lines(path: Path) -> list[str]:
    """Lines of a gzip UTF-8 file."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read().splitlines()


MALLOC_HELP = (
    "glibc malloc for every system in the run: 'keep' (attnlab's trainer setting, the default: "
    "freed memory kept for reuse, no fresh pages faulted in for each step's large temporaries) "
    "or 'default' (glibc as it comes)"
)


def set_malloc(choice: str) -> None:
    """Put this process (every system it times) under one glibc malloc setting.

    'keep' is what attnlab's jobs set (attnlab/fast/training.py: every request from the
    heap, trimmed only above 2 GB free), so memory freed by one step is reused by the next
    instead of being unmapped and faulted in, zeroed, again; HF's full-vocabulary MLM logits
    are such temporaries. 'default' leaves glibc as it comes and tells attnlab's trainer to
    leave it too (ATTNLAB_SPEEDUPS=-keep_freed_memory, inherited by child processes).
    """
    from attnlab.fast.swap import TRAINING, chosen
    from attnlab.fast.training import keep_freed_memory

    if choice == "default":
        os.environ["ATTNLAB_SPEEDUPS"] = "-keep_freed_memory"
        return
    if "keep_freed_memory" not in {s.name for s in chosen(TRAINING)}:
        return  # ATTNLAB_SPEEDUPS leaves it out (bench/speedup_ab.py)
    if not keep_freed_memory():
        raise SystemExit("--malloc keep: needs glibc (Linux)")
