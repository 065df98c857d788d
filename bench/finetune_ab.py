"""A/B of attnlab's fine-tuning step between two source trees, in alternating processes.

Each run is a fresh process that fine-tunes all-MiniLM-L6-v2 on a seeded SST-2 subset with
the recipe of bench/finetune.py (batch 32, max length 128, lr 3e-5, 2 threads by default)
and times its trainer from the first logged step to the last (so start-up and the first 10
steps are not counted). Runs alternate A, B, A, B, ... so a drift in the machine's speed
falls on both sides; the loss and gradient norm of each run are printed too, so a change
meant to keep the numbers shows that it did. The model runs with the speed-ups the
fine-tuning job uses (``ATTNLAB_SPEEDUPS`` selects them; ``--one-run`` alone is the child
that bench/speedup_ab.py times).

Usage: python bench/finetune_ab.py --a SRC_DIR --b SRC_DIR [--pairs 4] [--sentences 2240]
       [--threads 2]
(SRC_DIR is a checkout's src/, e.g. of a `git worktree add` of the older commit.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def one_run(sentences: int, threads: int) -> dict:
    """Fine-tune in this process (whichever attnlab it imports); seconds, last loss and norm."""
    import torch

    sys.path.insert(0, str(HERE))
    from finetune import BATCH, MAX_LENGTH, WARMUP, minilm_dir, read_sst2

    from attnlab import fast
    from attnlab.tasks.finetune import FinetuneOptions, prepare
    from attnlab.train.trainer import Trainer

    torch.set_num_threads(threads)
    train = read_sst2("train", sentences)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "train.tsv"
        rows = "".join(f"{text}\t{label}\n" for text, label in train)
        data.write_text("sentence\tlabel\n" + rows, encoding="utf-8")
        opts = FinetuneOptions(
            task="classify", model=Path(minilm_dir()), train=data, out=Path(tmp) / "out",
            epochs=1, batch_size=BATCH, lr=3e-5, max_length=MAX_LENGTH, warmup_ratio=WARMUP,
            text_column="sentence", save_every=0, progress=False, log_every=10, pooling="cls",
        )  # fmt: skip
        run = prepare(opts)
        model, speedups = fast.for_training(run.model), fast.TrainingSpeedups()  # as the job
        trainer = Trainer(model, run.batches, run.train_config, speedups=speedups)
        trainer.fit()
        logged = trainer.log.rows
    return {
        "seconds": logged[-1]["elapsed_s"] - logged[0]["elapsed_s"],
        "loss": logged[-1]["loss"],
        "grad_norm": logged[-1]["grad_norm"],
    }


def main() -> None:
    """Alternate runs of the two trees; print each run and the mean seconds of each side."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", type=Path, help="src/ directory of side A")
    parser.add_argument("--b", type=Path, help="src/ directory of side B")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--sentences", type=int, default=2240, help="70 steps of 32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--one-run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_run:
        print(json.dumps(one_run(args.sentences, args.threads)))
        return
    if args.a is None or args.b is None:  # not required of the --one-run children
        parser.error("give both --a and --b")
    seconds: dict[str, list[float]] = {"A": [], "B": []}
    for pair in range(args.pairs):
        for side, src in (("A", args.a), ("B", args.b)):
            command = [sys.executable, __file__, "--one-run", "--sentences", str(args.sentences),
                       "--threads", str(args.threads)]  # fmt: skip
            env = {**os.environ, "PYTHONPATH": str(src.resolve())}
            out = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            seconds[side].append(result["seconds"])
            print(f"pair {pair + 1} {side}: {result['seconds']:.2f} s, loss {result['loss']:.6f}, "
                  f"grad norm {result['grad_norm']:.6f}", flush=True)  # fmt: skip
    a, b = statistics.mean(seconds["A"]), statistics.mean(seconds["B"])
    faster = sum(x > y for x, y in zip(seconds["A"], seconds["B"], strict=True))
    print(f"mean A {a:.2f} s, B {b:.2f} s: B takes {b / a:.3f}x A's time "
          f"(B faster in {faster} of {args.pairs} pairs)")  # fmt: skip


if __name__ == "__main__":
    main()
