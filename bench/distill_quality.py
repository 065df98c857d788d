"""Distillation quality: a 2-layer student of a pretrained bert-mini, with and without the teacher.

Three runs of the command-line tools on the Chinese corpus (../shared/data/zh-corpus, built as
bench/pretrain_quality.py builds it):

1. the teacher: ``attnlab pretrain --preset bert-mini`` (MLM + NSP, seq 128, batch 32, lr 5e-4);
2. ``attnlab distill --student-layers 2``: the student starts from the teacher's layers 0 and 2
   and trains on DistilBERT's loss (5 KL at T = 2 + 2 MLM + 1 cosine, the defaults);
3. the same student and steps with ``--alpha-ce 0 --alpha-cos 0``: masked LM alone, no teacher
   signal (DistilBERT's ablation, Sanh et al. 2019 table 4).

2 and 3 run side by side, one thread each, so they share the machine's conditions. Every run
holds out the same 200 documents, drawn across the corpus by a fixed seed (the pretraining
CLI's held-out set; the last 200 before 2026-12-02; same vocabulary, examples and masks), and
the table reports held-out MLM accuracy, the student's fill-mask agreement with the teacher
(masked positions where both rank the same token first) and the mean KL(teacher || student) at
those positions, before and after. It ends with the encoder's
forward-pass speed (last hidden states, as fine-tuning and embedding use it; 64 x 128 tokens,
2 threads) of the teacher and the students.

Usage: python bench/distill_quality.py --out DIR [--teacher-steps 2500] [--steps 1000]
An existing run directory under DIR is reused, not retrained.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import best_time, machine
from pretrain_quality import build_corpus

ATTNLAB = [sys.executable, "-m", "attnlab"]
COMMON = ["--batch-size", "32", "--seq-len", "128", "--lr", "5e-4", "--seed", "0"]


def last_eval(run: Path) -> dict:
    """The last evaluation row of a run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").open(encoding="utf-8")]
    return [r for r in rows if r.get("eval")][-1]


def launch(args: list[str], log: Path, threads: int) -> subprocess.Popen:
    """Start one attnlab command, its stdout (the JSON summary) and stderr in log files."""
    return subprocess.Popen(
        [*ATTNLAB, *args, "--threads", str(threads)],
        stdout=log.with_suffix(".json").open("w"), stderr=log.open("w"),
    )  # fmt: skip


def wait(process: subprocess.Popen, what: str) -> None:
    """Wait for a command; stop with its name when it fails."""
    if process.wait() != 0:
        raise SystemExit(f"{what} failed (exit {process.returncode}): see its log")


def forward_speed(model_dir: Path, batch: int = 64, seq: int = 128) -> float:
    """Sequences per second of the encoder's forward pass (last hidden states): best of 5, 2 threads."""
    from attnlab.interop.hf import load_bert

    torch.set_num_threads(2)
    model = load_bert(model_dir)
    ids = torch.randint(1000, model.config.vocab_size, (batch, seq))
    with torch.inference_mode():
        seconds, _ = best_time(lambda: model(input_ids=ids), repeats=5)
    return batch / seconds


def main() -> None:
    """Train what is missing, then print the table as Markdown rows and JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--teacher-steps", type=int, default=2500)
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    corpus = str(build_corpus(args.out, "zh"))
    every = ["--eval-every", str(max(1, args.steps // 4)), "--save-every", str(args.steps)]

    teacher = args.out / "teacher"
    if not (teacher / "model.safetensors").exists():
        print(f"pretraining the teacher ({args.teacher_steps} steps)", file=sys.stderr)
        wait(launch(
            ["pretrain", "--preset", "bert-mini", "--corpus", corpus, "--out", str(teacher),
             "--steps", str(args.teacher_steps), "--vocab-size", "21128", "--eval-every", "500",
             "--save-every", "500", *COMMON],
            args.out / "teacher.log", threads=2,
        ), "the teacher's pretraining")  # fmt: skip
    students = {
        "distilled": [],
        "mlm_only": ["--alpha-ce", "0", "--alpha-cos", "0", "--alpha-mlm", "1"],
    }
    running = {}
    for name, extra in students.items():
        if not (args.out / name / "model.safetensors").exists():
            print(f"training student {name} ({args.steps} steps)", file=sys.stderr)
            running[name] = launch(
                ["distill", "--teacher", str(teacher), "--student-layers", "2",
                 "--corpus", corpus, "--out", str(args.out / name), "--steps", str(args.steps),
                 *every, *COMMON, *extra],
                args.out / f"{name}.log", threads=1,
            )  # fmt: skip
    for name, process in running.items():
        wait(process, f"student {name}")

    summaries = {
        name: json.loads((args.out / f"{name}.json").read_text().strip().splitlines()[-1])
        for name in students
    }
    rows = {
        "teacher": {
            "eval": last_eval(teacher),
            "parameters": summaries["distilled"]["teacher_parameters"],
            "speed": forward_speed(teacher),
        }
    }
    for name, summary in summaries.items():
        rows[name] = {
            "eval": last_eval(args.out / name),
            "agreement_before": summary["agreement_before"],
            "kl_before": summary["teacher_kl_before"],
            "parameters": summary["student_parameters"],
            "speed": forward_speed(args.out / name),
        }
    print(json.dumps({"machine": machine(), **rows}, default=str))
    print("| model | parameters | held-out MLM accuracy | agreement with teacher (start -> end) "
          "| KL to the teacher, nats (start -> end) | encoder sequences/s |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, row in rows.items():
        agree = kl = "—"
        if name != "teacher":
            end = row["eval"]
            agree = (f"{100 * row['agreement_before']:.1f}% -> "
                     f"{100 * end['eval_fill_mask_agreement']:.1f}%")  # fmt: skip
            kl = f"{row['kl_before']:.3f} -> {end['eval_teacher_kl']:.3f}"
        print(f"| {name} | {row['parameters']:,} | {100 * row['eval']['eval_mlm_accuracy']:.2f}% "
              f"| {agree} | {kl} | {row['speed']:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
