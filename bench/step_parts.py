"""Memory-bound parts of a bert-small training step and of distillation's, attnlab's and plain.

- distillation's KL term forward and backward on two (598, 30,522) logits at T = 2:
  ``fast/loss.py: summed_kl_divergence`` against ``F.kl_div`` of two ``log_softmax``es
  (what ``attnlab distill`` computed before);
- a bias gradient, the column sums of a (4,096, 2,048) output gradient: ``ones @ rows``
  (fast/linear.py) against ``rows.sum(0)``.

Each timed alone, median of ``--repeats``; the two results of each pair are compared too.

Usage: python bench/step_parts.py [--threads T] [--repeats 15]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import machine


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median milliseconds of fn() after two warm-up calls."""
    fn()
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    """Print one line per part and a JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from attnlab.fast.training import keep_freed_memory

    keep_freed_memory()
    torch.manual_seed(0)
    print(f"machine: {machine()}", file=sys.stderr)
    results = {
        **loss_parts(args.repeats),
        "bias_gradient": bias_gradient(args.repeats),
    }
    for name, r in results.items():
        extra = {k: f"{v:.1e}" for k, v in r.items() if not k.endswith("_ms")}
        print(
            f"{name:14s} attnlab {r['attnlab_ms']:6.2f} ms, plain {r['plain_ms']:6.2f} ms; {extra}",
            file=sys.stderr,
        )
    print(json.dumps({"bench": "step_parts", "threads": args.threads, **results}))


def loss_parts(repeats: int) -> dict[str, dict[str, float]]:
    """Distillation's KL term, forward and backward, attnlab's and plain."""
    from attnlab.fast.loss import summed_kl_divergence

    results = {}
    logits = torch.randn(598, 30522) * 3
    teacher = torch.randn(598, 30522) * 3

    def plain_kl(z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        log_q, log_p = F.log_softmax(z / 2.0, -1), F.log_softmax(t / 2.0, -1)
        return F.kl_div(log_q, log_p, reduction="sum", log_target=True)

    def blocked_kl(z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return summed_kl_divergence(z, t, 2.0)

    def kl_step(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        z = logits.clone().requires_grad_()  # the student's fresh decoder output
        loss = fn(z, teacher)
        loss.backward()
        return loss.detach()

    ours, theirs = kl_step(blocked_kl), kl_step(plain_kl)
    results["distill_kl"] = {
        "attnlab_ms": median_ms(lambda: kl_step(blocked_kl), repeats),
        "plain_ms": median_ms(lambda: kl_step(plain_kl), repeats),
        "relative_difference": float((ours - theirs).abs() / theirs.abs()),
    }
    return results


def bias_gradient(repeats: int) -> dict[str, float]:
    """Column sums of an output gradient: ``ones @ rows`` against ``rows.sum(0)``."""
    rows = torch.randn(4096, 2048)
    ones = rows.new_ones(len(rows))
    return {
        "attnlab_ms": median_ms(lambda: ones @ rows, repeats),
        "plain_ms": median_ms(lambda: rows.sum(0), repeats),
        "relative_difference": float(((ones @ rows) - rows.sum(0)).norm() / rows.sum(0).norm()),
    }


if __name__ == "__main__":
    main()
