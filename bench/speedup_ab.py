"""Leave-one-out A/B of attnlab's speed-ups on a benchmark, in alternating fresh processes.

Each run is a fresh process of the benchmark command given after ``--``, with
``ATTNLAB_SPEEDUPS`` set to ``all`` (A) or to ``-NAME`` (B: every speed-up but NAME). Each
round runs A, then each B in turn, with A again after every two Bs, and the order of the Bs
reversed every other round, so a drift in the machine's speed falls on both sides. A speed-up's
gain is the ratio of its B runs' median to the median of all A runs (time: B / A, so 1.10
means 10% faster with it); its memory gain is the same ratio of the runs' peak resident memory
(read from the finished child's rusage, so the benchmark needs no help to report it). On a
machine shared with other work, --pause-niced stops the niced processes during each run.

Usage:
  python bench/speedup_ab.py --speedups attention,dropout --rounds 3 --metric seconds -- \
      python bench/pretrain.py --preset bert-small --threads 2 --steps 8 --only attnlab
--metric is a dotted path into the last JSON line the benchmark prints (e.g.
``results.attnlab.seconds``, or ``attnlab.0.sentences_per_s`` for a list's first item); a name with "seconds" in it is a time (lower is better),
anything else a rate (higher is better).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time


def niced_others() -> list[int]:
    """Processes of other users of this machine that run at a lowered priority (nice >= 10)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()  # noqa: SIM115
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[16]) >= 10:  # the nice value, field 19 of stat
            pids.append(int(entry))
    return pids


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    """Send sig to each pid that still exists."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def run_once(
    command: list[str], speedups: str, metric: str, pause_niced: bool
) -> tuple[float, float]:
    """One fresh process of the benchmark: (its metric, its peak resident memory in MiB).

    pause_niced: stop the machine's niced processes (other work) while the benchmark runs.
    """
    env = {**os.environ, "ATTNLAB_SPEEDUPS": speedups}
    paused = niced_others() if pause_niced else []
    signal_all(paused, signal.SIGSTOP)
    try:
        child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None
        output = child.stdout.read()
        _, status, usage = os.wait4(child.pid, 0)
    finally:
        signal_all(paused, signal.SIGCONT)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"{' '.join(command)} with ATTNLAB_SPEEDUPS={speedups} failed")
    value: object = json.loads(output.strip().splitlines()[-1])
    for key in metric.split("."):  # a number picks a list's item
        value = value[int(key)] if isinstance(value, list) else value[key]  # type: ignore[index]
    return float(value), usage.ru_maxrss / 1024  # Linux reports KiB


def round_order(names: list[str], round_index: int) -> list[str]:
    """One round's runs: "all" first and again after every two leave-one-out runs."""
    names = names if round_index % 2 == 0 else names[::-1]
    order = ["all"]
    for i, name in enumerate(names):
        order.append(f"-{name}")
        if i % 2 == 1 or i == len(names) - 1:
            order.append("all")
    return order


def summarise(runs: dict[str, list[tuple[float, float]]], is_time: bool) -> list[dict]:
    """Each speed-up's median gain in the metric and in peak memory against the "all" runs."""
    base = statistics.median(v for v, _ in runs["all"])
    base_mem = statistics.median(m for _, m in runs["all"])
    rows = []
    for setting, values in runs.items():
        if setting == "all":
            continue
        value = statistics.median(v for v, _ in values)
        memory = statistics.median(m for _, m in values)
        gains = [(v / base if is_time else base / v) for v, _ in values]
        rows.append({
            "speedup": setting.removeprefix("-"), "gain": value / base if is_time else base / value,
            "gain_min": min(gains), "gain_max": max(gains), "memory_gain": memory / base_mem,
            "peak_mib_without": memory, "runs": len(values),
        })  # fmt: skip
    return sorted(rows, key=lambda row: -row["gain"])


def main() -> None:
    """Run the rounds, print a table on stderr and a JSON line on stdout."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speedups", required=True, help="comma-separated names to leave out")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--metric", default="seconds")
    parser.add_argument(
        "--pause-niced", type=float, metavar="GAP_S",
        help="pause the machine's niced processes during each run, letting them go on for "
             "GAP_S seconds between runs (a shared machine)",
    )  # fmt: skip
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the benchmark command")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    names = args.speedups.split(",")
    is_time = "seconds" in args.metric.split(".")[-1]
    runs: dict[str, list[tuple[float, float]]] = {"all": [], **{f"-{n}": [] for n in names}}
    start = time.perf_counter()
    for r in range(args.rounds):
        for setting in round_order(names, r):
            value, memory = run_once(command, setting, args.metric, args.pause_niced is not None)
            time.sleep(args.pause_niced or 0.0)
            runs[setting].append((value, memory))
            print(f"round {r + 1} {setting:20s} {value:10.4f} {memory:8.0f} MiB", file=sys.stderr)
    rows = summarise(runs, is_time)
    all_values = [v for v, _ in runs["all"]]
    print(f"all: median {statistics.median(all_values):.4f}, spread {min(all_values):.4f}.."
          f"{max(all_values):.4f}; {time.perf_counter() - start:.0f} s", file=sys.stderr)  # fmt: skip
    print(f"{'speed-up':18s} {'gain':>6s} {'min':>6s} {'max':>6s} {'memory':>7s}", file=sys.stderr)
    for row in rows:
        print(f"{row['speedup']:18s} {row['gain']:6.3f} {row['gain_min']:6.3f} "
              f"{row['gain_max']:6.3f} {row['memory_gain']:7.3f}", file=sys.stderr)  # fmt: skip
    print(json.dumps({"command": command, "metric": args.metric, "all": runs["all"],
                      "runs": runs, "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
