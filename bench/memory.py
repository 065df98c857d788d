"""Resident memory sampled through a training run of given minutes (translate train, pretrain, ...).

Runs `attnlab ARGS...` (everything after `--`) as a child process and samples its resident
size (VmRSS of /proc/PID/status, the child's descendants too) every --every seconds for
--minutes; a run still going then is stopped with SIGTERM, which the trainer takes as an
interrupt (it saves a checkpoint and ends). One JSON row per sample on stdout, then a summary:
the resident size at 1 and 5 minutes, the peak after the first 5 minutes and its ratio to the
5-minute value (issue 37's bound: 1.3x), and the peak.

--env NAME=VALUE sets the child's environment, to compare allocator settings in one go:
`--env ATTNLAB_SPEEDUPS=-keep_freed_memory` (glibc's default trimming and mmap, see
src/attnlab/fast/training.py) or `--env MALLOC_ARENA_MAX=2` (fewer per-thread malloc arenas).

Usage:
  python bench/memory.py --minutes 30 --every 10 -- translate train --train SRC TGT \\
      --valid VSRC VTGT --out runs/mem --max-minutes 30 --overwrite
  python bench/memory.py --minutes 30 -- pretrain --corpus FILE --steps 100000 --out runs/m
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

MB = 1e6


def resident_bytes(pid: int) -> int:
    """VmRSS of pid and every process below it, in bytes (0 for a process that is gone)."""
    total = 0
    for member in [pid, *descendants(pid)]:
        try:
            status = Path(f"/proc/{member}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


def descendants(pid: int) -> list[int]:
    """The processes below pid (torchrun's workers, say), from /proc/PID/task/*/children."""
    found, pending = [], [pid]
    while pending:
        parent = pending.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            pending += children
    return found


def sample(command: list[str], env: dict[str, str], minutes: float, every: float) -> list[dict]:
    """Run command, printing and returning a row per sample: seconds and resident MB."""
    child = subprocess.Popen(command, env={**os.environ, **env}, stdout=subprocess.DEVNULL)
    started, rows = time.monotonic(), []
    try:
        while child.poll() is None:
            seconds = time.monotonic() - started
            if seconds >= minutes * 60:
                child.send_signal(signal.SIGTERM)  # the trainer checkpoints and ends
                child.wait(timeout=300)
                break
            row = {"seconds": round(seconds, 1), "resident_mb": resident_bytes(child.pid) / MB}
            rows.append(row)
            print(json.dumps(row), flush=True)
            time.sleep(every)
    finally:
        if child.poll() is None:
            child.kill()
    return rows


def summary(rows: list[dict]) -> dict:
    """Resident MB at 1 and 5 minutes, the peak after 5 minutes and its ratio, the peak."""

    def at(seconds: float) -> float | None:  # None for a run that ended before then
        before = [r["resident_mb"] for r in rows if r["seconds"] <= seconds]
        return before[-1] if before and rows[-1]["seconds"] >= seconds else None

    later = [r["resident_mb"] for r in rows if r["seconds"] > 300]
    five = at(300)
    peak_later = max(later) if later else None
    ratio = peak_later / five if peak_later and five else None
    return {
        "bench": "memory",
        "samples": len(rows),
        "seconds": rows[-1]["seconds"] if rows else 0.0,
        "resident_mb_1min": at(60),
        "resident_mb_5min": five,
        "peak_mb_after_5min": peak_later,
        "ratio_after_5min": round(ratio, 3) if ratio else None,
        "peak_mb": max((r["resident_mb"] for r in rows), default=None),
    }


def main() -> None:
    """Sample one run and print its rows and summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long to sample")
    parser.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then attnlab's arguments")
    args = parser.parse_args()
    attnlab = args.args[1:] if args.args[:1] == ["--"] else args.args
    if not attnlab:
        parser.error("give the attnlab command after --")
    env = dict(item.split("=", 1) for item in args.env)
    command = [sys.executable, "-m", "attnlab", *attnlab]
    print(json.dumps({"command": attnlab, "env": env}), flush=True)
    rows = sample(command, env, args.minutes, args.every)
    print(json.dumps({**summary(rows), "env": env}))


if __name__ == "__main__":
    main()
