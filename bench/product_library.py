"""Training products by oneDNN against MKL (fast/linear.py's route), whole pretraining steps.

attnlab picks the library for its fp32 training products by CPU vendor and flags
(``onednn_trains_faster``), not by a timing. This runs bench/pretrain.py's attnlab step in a
fresh process per run with the route forced each way, alternating (oneDNN, MKL, oneDNN, MKL, ...),
and prints each run's tokens/s and the median of each side, so the rule can be checked on a
new host.

Usage: python bench/product_library.py [--preset bert-base] [--batch-size 8] [--steps 4]
       [--rounds 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import machine

PRETRAIN = os.path.join(os.path.dirname(__file__), "pretrain.py")
# Run in the child: force the route, then bench/pretrain.py's attnlab side alone.
CHILD = """
import runpy, sys
import attnlab.fast.linear as linear
linear.onednn_trains_faster = lambda: sys.argv[1] == "onednn"
sys.argv = [sys.argv[2], *sys.argv[3:], "--only", "attnlab"]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def one_run(route: str, args: argparse.Namespace) -> float:
    """tokens/s of one bench/pretrain.py attnlab run with the products on `route`."""
    flags = ["--preset", args.preset, "--batch-size", str(args.batch_size), "--seq-len", "128"]
    flags += ["--steps", str(args.steps), "--threads", str(args.threads)]
    done = subprocess.run(
        [sys.executable, "-c", CHILD, route, PRETRAIN, *flags],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    seconds = json.loads(done.stdout.strip().splitlines()[-1])["seconds"]
    return args.batch_size * 128 / seconds


def main() -> None:
    """Alternate the two routes and print every run and each side's median."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bert-base")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(f"{machine()}; runs at {args.threads} threads", flush=True)
    runs: dict[str, list[float]] = {"onednn": [], "mkl": []}
    for _ in range(args.rounds):
        for route in runs:
            runs[route].append(one_run(route, args))
            print(f"{route:7s} {runs[route][-1]:8.1f} tokens/s", flush=True)
    medians = {route: statistics.median(values) for route, values in runs.items()}
    print(json.dumps({"bench": "product_library", **vars(args), "runs": runs, "median": medians}))


if __name__ == "__main__":
    main()
