"""Language-model quality on a time budget: `attnlab lm train` against HF `GPT2LMHeadModel`.

Both sides train the `gpt-char` shape (4 layers x 192, 6 heads, context 256, no dropout) on
the same characters for the same wall-clock minutes on the same threads, fp32, then score the
same held-out text (the corpus's last 10%, as nanoGPT splits shakespeare) by HF's
sliding-window method (window 256, stride 128):

- attnlab: the CLI, ``attnlab lm train --preset gpt-char --max-minutes M`` with its defaults
  (AdamW at the rate its width gets, 2e-3, betas (0.9, 0.99), weight decay 0.1, a warm-up of
  10% and a linear decay to 0 over the steps the trainer plans from its step rate as it goes,
  its default batch or --batch-size, random windows);
- HF: ``GPT2LMHeadModel`` of the same config, the same optimizer settings (peak rate 2e-3
  too), the same random windows (attnlab's ``WindowBatches`` with the same seed), clipping at
  1.0, HF's cosine decay with a 10% warm-up (``get_cosine_schedule_with_warmup``'s factor)
  over the steps the clock allows, planned by the rules of attnlab's trainer (every 10 steps,
  at 90% of the step rate so far, the decay re-planned from the factor in force); it stops
  there, or when the clock runs out.

The runs are one after the other, attnlab's first (its tokenizer gives both sides their ids).
Printed: steps, tokens/s and held-out loss (nats/char) of each, one JSON line at the end.

Usage: python bench/lm_quality.py [--corpus FILE] [--minutes 10] [--threads 2] [--out DIR]
       [--batch-size B]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

sys.path.insert(0, str(Path(__file__).parent))
from common import SHARED_DATA, machine
from lm import hf_step

from attnlab.tasks.lm import (
    GPT_BETAS,
    GPT_EPS,
    HELD_OUT_SHARE,
    MOST_WARMUP,
    TIMED_STEPS,
    WARMUP_SHARE,
    LMOptions,
    default_lr,
    load_lm,
    score_stream,
)
from attnlab.text.token_stream import TokenStream, WindowBatches, held_out_split
from attnlab.train.optim import build_optimizer, planned_warmup
from attnlab.train.trainer import PLAN_EVERY, PLAN_RATE_SHARE, steps_within

SEQ_LEN, STRIDE = 256, 128
LR = default_lr(192)  # the peak rate attnlab's lm train gives gpt-char's width


def train_attnlab(
    corpus: Path, out: Path, minutes: float, threads: int, batch_size: int
) -> dict[str, Any]:
    """`attnlab lm train` with the preset's defaults, a batch size and a time limit; its summary."""
    command = [sys.executable, "-m", "attnlab", "lm", "train", "--corpus", str(corpus),
               "--out", str(out), "--preset", "gpt-char", "--max-minutes", str(minutes),
               "--batch-size", str(batch_size), "--threads", str(threads), "--no-progress",
               "--overwrite"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


class HFAsGPT(torch.nn.Module):
    """An HF GPT2LMHeadModel seen as attnlab's GPT by score_stream: .config.max_positions, .logits."""

    def __init__(self, hf: torch.nn.Module) -> None:
        super().__init__()
        self.hf = hf
        self.config = SimpleNamespace(max_positions=hf.config.n_positions)

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        """input_ids (batch, seq) -> .logits (batch, seq, vocab)."""
        return SimpleNamespace(logits=self.hf(input_ids=input_ids).logits)


def hf_model(vocab_size: int) -> torch.nn.Module:
    """GPT2LMHeadModel of gpt-char's shape: 4 layers x 192, 6 heads, context 256, no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab_size, n_positions=SEQ_LEN, n_embd=192, n_layer=4,
                        n_head=6, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=None, eos_token_id=None)  # fmt: skip
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def train_hf(hf: torch.nn.Module, batches: WindowBatches, minutes: float) -> dict[str, Any]:
    """Train hf on the windows for the minutes: HF's cosine decay over the steps the clock
    allows, planned by the rules of attnlab's trainer (Trainer._plan_schedule)."""
    optimizer = build_optimizer(hf, LR, 0.1, GPT_BETAS, GPT_EPS)
    plan = HFPlan()
    schedule = LambdaLR(optimizer, plan.factor)
    data, budget = iter(batches), minutes * 60
    started, done, loss = time.perf_counter(), 0, math.nan
    while done < plan.total and time.perf_counter() - started < budget:
        loss = hf_step(hf, optimizer, next(data))
        schedule.step()
        done += 1
        if done % PLAN_EVERY == 0:
            elapsed = time.perf_counter() - started
            rate = PLAN_RATE_SHARE * done / elapsed
            plan.update(done, steps_within(TIMED_STEPS, done, elapsed, budget, rate))
            for group in optimizer.param_groups:  # the next step's rate, by the new plan
                group["lr"] = LR * plan.factor(done)
    seconds = time.perf_counter() - started
    return {"steps": done, "planned": plan.total, "train_loss": loss,
            "tokens_per_s": done * batches.batch_size * SEQ_LEN / seconds,
            "seconds": seconds}  # fmt: skip


class HFPlan:
    """HF's get_cosine_schedule_with_warmup factor, its warm-up and end planned as attnlab's
    trainer plans its linear decay: while warming up, a warm-up of 10% of the steps the clock
    allows; after it, half a cosine from the factor in force to 0 at the new end (no jump)."""

    def __init__(self) -> None:
        self.warmup, self.total = MOST_WARMUP, TIMED_STEPS
        self.start, self.start_factor = 0, 1.0  # where the cosine in force starts, and at what

    def update(self, step: int, total: int) -> None:
        """Plan the run to end at total, at step."""
        if step < self.warmup:
            self.warmup = planned_warmup(total, WARMUP_SHARE, MOST_WARMUP)
            self.start, self.total = self.warmup, total
        else:
            self.start, self.start_factor, self.total = step, self.factor(step), total

    def factor(self, step: int) -> float:
        """The learning-rate factor at step."""
        if step < self.warmup:
            return step / max(1, self.warmup)
        start = max(self.start, self.warmup)
        progress = min(1.0, (step - start) / max(1, self.total - start))
        return self.start_factor * 0.5 * (1.0 + math.cos(math.pi * progress))


def main() -> None:
    """Train both sides for --minutes, score the held-out text, print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path,
                        default=SHARED_DATA / "tinyshakespeare" / "input.txt.gz")  # fmt: skip
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, help="attnlab's run folder (default: a temporary one)")
    parser.add_argument("--batch-size", type=int, default=LMOptions.batch_size,
                        help="windows a step, both sides (default: lm train's)")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(machine(), f"| gpt-char, {args.minutes:g} min each", time.strftime("%Y-%m-%d %H:%M"))
    with tempfile.TemporaryDirectory() as scratch:
        out = args.out or Path(scratch) / "attnlab"
        ours = train_attnlab(args.corpus, out, args.minutes, args.threads, args.batch_size)
        model, tokenizer = load_lm(out)
        stream = TokenStream.build([args.corpus], tokenizer, Path(scratch) / "cache").tokens
        train, held = held_out_split(stream, HELD_OUT_SHARE)
        ours["held_out"] = score_stream(model, held.tolist(), STRIDE, SEQ_LEN)
        print(f"attnlab  {ours['step']} steps, held-out loss {ours['held_out']['loss']:.4f}")
        hf = hf_model(model.config.vocab_size).train()
        theirs = train_hf(hf, WindowBatches(train, SEQ_LEN, args.batch_size, seed=0), args.minutes)
        theirs["held_out"] = score_stream(HFAsGPT(hf.eval()), held.tolist(), STRIDE, SEQ_LEN)
        print(f"HF       {theirs['steps']} steps ({theirs['tokens_per_s']:.0f} tokens/s), "
              f"held-out loss {theirs['held_out']['loss']:.4f}")  # fmt: skip
    print(json.dumps({"attnlab": ours, "hf": theirs}))


if __name__ == "__main__":
    main()
