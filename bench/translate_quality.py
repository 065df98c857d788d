"""Translation quality in bounded time: Multi30k de→en (and Tatoeba zh→en), scored by sacreBLEU.

Runs ``attnlab translate train`` for at most --minutes on this machine, then scores the final
model (the average of the last checkpoints) on the test set with beam 4 (``attnlab translate
score``: detokenized, cased sacreBLEU, signature printed), and plots validation BLEU against
training time from the run's metrics.jsonl. ``--run DIR`` only scores and plots a finished run.

Tatoeba zh→en has no split: ``--pair tatoeba`` fixes one (see ``tatoeba_split``): after a
seeded shuffle of the 29,155 pairs, the first 1,000 are the test set, the next 1,000 the
validation set, the rest training data; the files are written beside the run, in
<run>-data/.

Usage:
    python bench/translate_quality.py --pair multi30k --minutes 60 --out runs/m30k
    python bench/translate_quality.py --pair tatoeba --minutes 30 --out runs/zh-en
    python bench/translate_quality.py --pair multi30k --run runs/m30k
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from common import SHARED_DATA, machine, read_gz_lines

MULTI30K = SHARED_DATA / "multi30k"
TATOEBA = SHARED_DATA / "tatoeba-cmn-eng"


def tatoeba_split(out: Path, seed: int = 0) -> dict[str, tuple[Path, Path]]:
    """Write the fixed zh→en split of the Tatoeba pairs into out: {split: (zh file, en file)}."""
    pairs = []
    for line in read_gz_lines(TATOEBA / "cmn.txt.gz"):
        fields = line.split("\t")
        if len(fields) >= 2 and fields[0].strip() and fields[1].strip():
            pairs.append((fields[1].strip(), fields[0].strip()))  # the file is English first
    random.Random(seed).shuffle(pairs)
    parts = {"test": pairs[:1000], "valid": pairs[1000:2000], "train": pairs[2000:]}
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, rows in parts.items():
        zh, en = out / f"{name}.zh", out / f"{name}.en"
        zh.write_text("".join(z + "\n" for z, _ in rows), encoding="utf-8")
        en.write_text("".join(e + "\n" for _, e in rows), encoding="utf-8")
        files[name] = (zh, en)
    return files


def data_files(pair: str, out: Path) -> dict[str, tuple[Path, Path]]:
    """Source/target files of each split for a language pair."""
    if pair == "multi30k":
        return {
            name: (MULTI30K / f"{stem}.de.gz", MULTI30K / f"{stem}.en.gz")
            for name, stem in (("train", "train"), ("valid", "val"), ("test", "test_2016_flickr"))
        }
    return tatoeba_split(out)


def attnlab(*args: object) -> str:
    """Run the attnlab CLI of this checkout; its stdout."""
    command = [sys.executable, "-m", "attnlab", *map(str, args)]
    return subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout


def plot_bleu(run: Path, image: Path) -> list[tuple[float, float]]:
    """Plot validation BLEU against training minutes; the (minutes, BLEU) points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in (run / "metrics.jsonl").open(encoding="utf-8")]
    elapsed = {r["step"]: r["elapsed_s"] for r in rows if not r.get("eval")}
    points = [
        (elapsed[r["step"]] / 60, r["valid_bleu"])
        for r in rows
        if r.get("eval") and "valid_bleu" in r and r["step"] in elapsed
    ]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([m for m, _ in points], [b for _, b in points], marker="o")
    ax.set_xlabel("training time (minutes)")
    ax.set_ylabel("validation BLEU (greedy)")
    ax.set_title(run.name)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(image, dpi=120)
    return points


def main() -> None:
    """Train (unless --run), score on the test set with beam 4, plot validation BLEU."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=("multi30k", "tatoeba"), default="multi30k")
    parser.add_argument("--minutes", type=float, default=60)
    parser.add_argument("--out", type=Path, help="run directory to create")
    parser.add_argument("--run", type=Path, help="score and plot this finished run instead")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument(
        "--train-args",
        default="--preset transformer-small --max-tokens 2048 --lr 7e-4 --warmup 400 "
        "--eval-every 300 --save-every 150 --keep-last 5 --average-last 5 --vocab-size 8000",
        help="extra `translate train` options",
    )
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)  # so machine() reports the threads the runs use
    run = args.run or args.out
    if run is None:
        parser.error("give --out (train) or --run (score a finished run)")
    files = data_files(args.pair, run.parent / f"{run.name}-data")  # beside the run, not in it
    if args.run is None:
        (src, tgt), (vsrc, vtgt) = files["train"], files["valid"]
        attnlab(
            "translate", "train", "--train", src, tgt, "--valid", vsrc, vtgt, "--out", run,
            "--max-minutes", args.minutes, "--threads", args.threads, "--no-progress",
            *args.train_args.split(),
        )  # fmt: skip
    test_src, test_ref = files["test"]
    if test_src.suffix == ".gz":  # translate score reads plain files
        for path in (test_src, test_ref):
            plain = run / path.name.removesuffix(".gz")
            plain.write_text("\n".join(read_gz_lines(path)) + "\n", encoding="utf-8")
        test_src, test_ref = run / test_src.name[:-3], run / test_ref.name[:-3]
    scored = attnlab(
        "translate", "score", "--model", run, "--src", test_src, "--ref", test_ref,
        "--beam", args.beam, "--threads", args.threads,
    )  # fmt: skip
    score = json.loads(scored)
    points = plot_bleu(run, run / "valid_bleu.png")
    print(json.dumps({"machine": machine(), "run": str(run), "test": score, "valid_bleu": points}))


if __name__ == "__main__":
    main()
