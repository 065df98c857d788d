"""bf16 autocast products: PyTorch's own kernel against attnlab's `linear` (fast/linear.py), side by side.

For bert-small's training products (4,096 tokens; the feed-forward, fused QKV and MLM-decoder
shapes) it times one linear layer's forward and backward under CPU bf16 autocast, once with
``F.linear`` (PyTorch's bf16 kernel: emulated on a CPU without avx512_bf16/AMX) and once with
attnlab's ``linear`` (where that kernel is slow, the fp32 one on bf16-rounded inputs:
``bf16_by_fp32``), and
attnlab's fp32 ``linear`` for reference; median of ``--repeats`` after one warm-up. It also
prints how far apart the two bf16 outputs are: the share of elements that differ (sums taken
in another order can round to the neighbouring bf16 value) and the largest difference
relative to the largest output.

Usage: python bench/bf16_products.py [--threads T] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import machine

SHAPES = {  # name -> (rows, in, out)
    "feed-forward in (4096 x 512 -> 2048)": (4096, 512, 2048),
    "fused QKV (4096 x 512 -> 1536)": (4096, 512, 1536),
    "MLM decoder (598 x 512 -> 30522)": (598, 512, 30522),
}


def seconds(
    fn, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, bf16: bool, repeats: int
) -> float:
    """Median seconds of fn's forward and backward (under bf16 autocast when bf16)."""

    def once() -> float:
        xs, ws, bs = (t.detach().requires_grad_() for t in (x, w, b))
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = fn(xs, ws, bs)
        out.float().sum().backward()
        return time.perf_counter() - start

    once()
    return statistics.median(once() for _ in range(repeats))


def main() -> None:
    """Print one line per shape and a JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from attnlab.fast.linear import bf16_by_fp32, linear
    from attnlab.fast.route import fast_bf16_matmul
    from attnlab.fast.training import keep_freed_memory

    keep_freed_memory()
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        route = bf16_by_fp32(torch.empty(1))
    print(
        f"machine: {machine()}; bf16 products faster than fp32: {fast_bf16_matmul()}; "
        f"attnlab's bf16 products by the fp32 kernel: {route}",
        file=sys.stderr,
    )
    results = {}
    for name, (rows, d_in, d_out) in SHAPES.items():
        x, w, b = torch.randn(rows, d_in), torch.randn(d_out, d_in) * 0.05, torch.randn(d_out)
        timed = {
            "torch_bf16": seconds(F.linear, x, w, b, True, args.repeats),
            "attnlab_bf16": seconds(linear, x, w, b, True, args.repeats),
            "attnlab_fp32": seconds(linear, x, w, b, False, args.repeats),
        }
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            theirs, ours = F.linear(x, w, b).float(), linear(x, w, b).float()
        differ = float((ours != theirs).float().mean())
        largest = float((ours - theirs).abs().max() / theirs.abs().max())
        results[name] = {
            **{k: round(v * 1e3, 2) for k, v in timed.items()},
            "share_differing": differ,
            "max_difference_vs_largest": largest,
        }
        print(
            f"{name:38s} forward+backward: torch bf16 {timed['torch_bf16'] * 1e3:7.1f} ms, "
            f"attnlab bf16 {timed['attnlab_bf16'] * 1e3:6.1f} ms, "
            f"attnlab fp32 {timed['attnlab_fp32'] * 1e3:6.1f} ms; outputs differ in {differ:.2%}, "
            f"by at most {largest:.1e} of the largest",
            file=sys.stderr,
        )
    print(json.dumps({"bench": "bf16_products", "threads": args.threads, "ms": results}))


if __name__ == "__main__":
    main()
