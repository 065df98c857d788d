"""Speed and peak memory of a DistilBERT training step (attnlab distill's model and step).

A random teacher of --preset and its student of every other layer (``student_from_teacher``,
as ``attnlab distill --student-layers N/2``) take the trainer's step (forward, backward, clip,
AdamW), with the training twins swapped in as the distill job does (``ATTNLAB_SPEEDUPS``
selects them), on one synthetic masked batch (15% of positions, as ``bench/pretrain.py``). Prints one
JSON line: seconds a step (mean of --steps after 2 warm-up steps), tokens/s, the last loss and
the process's peak resident memory. To compare two versions of attnlab, run this alternately
in fresh processes under each tree (``PYTHONPATH=<tree>/src``); the host's noise is larger
than most single differences.

Usage: python bench/distill_step.py [--preset bert-small] [--batch-size 32] [--seq-len 128]
       [--steps 8] [--precision fp32|bf16] [--threads T]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, synthetic_batch, training_step


def main() -> None:
    """Time the steps and print the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bert-small")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from attnlab.config import BertConfig
    from attnlab.fast import for_training
    from attnlab.models.bert import BertForPreTraining
    from attnlab.tasks.distill import DistillationModel, student_from_teacher
    from attnlab.train.optim import build_optimizer

    torch.manual_seed(0)
    config = BertConfig.preset(args.preset)
    teacher = BertForPreTraining(config)
    student = student_from_teacher(teacher, config.n_layers // 2, None)
    model = for_training(DistillationModel(teacher, student).train())  # as the distill job
    step = training_step(model, build_optimizer(model.student, lr=1e-4), args.precision)
    batch = synthetic_batch(config.vocab_size, args.batch_size, args.seq_len)
    del batch["nsp_labels"]  # the student has no sentence head
    step(batch)
    step(batch)
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step(batch)
    seconds = (time.perf_counter() - start) / args.steps
    print(machine(), file=sys.stderr)
    print(json.dumps({
        "bench": "distill_step", "preset": args.preset, "batch_size": args.batch_size,
        "seq_len": args.seq_len, "precision": args.precision, "threads": args.threads,
        "steps": args.steps, "seconds_per_step": round(seconds, 4),
        "tokens_per_s": round(args.batch_size * args.seq_len / seconds, 1),
        "loss": loss,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
