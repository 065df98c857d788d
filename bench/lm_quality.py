"""Language-model quality on a time budget: `attnlab lm train` against HF `GPT2LMHeadModel`.

Both sides train the `gpt-char` shape (4 layers x 192, 6 heads, context 256, no dropout) on
the same characters for the same wall-clock minutes on the same threads, fp32, then score the
same held-out text (the corpus's last 10%, as nanoGPT splits shakespeare) by HF's
sliding-window method (window 256, stride 128):

- attnlab: the CLI, ``attnlab lm train --preset gpt-char --max-minutes M`` with its defaults
  (AdamW at the rate its width gets, 2e-3, betas (0.9, 0.99), weight decay 0.1, warm-up
  planned from the clock, linear decay, batch 32 or --batch-size, random windows);
- HF: ``GPT2LMHeadModel`` of the same config, the same optimizer settings (peak rate 2e-3
  too), the same random windows (attnlab's ``WindowBatches`` with the same seed), clipping at
  1.0, a cosine decay (``get_cosine_schedule_with_warmup``, 10% warm-up) over the steps that
  a 10-step timing probe says fit the minutes; training stops when the clock runs out.

The runs are one after the other, attnlab's first (its tokenizer gives both sides their ids).
Printed: steps, tokens/s and held-out loss (nats/char) of each, one JSON line at the end.

Usage: python bench/lm_quality.py [--corpus FILE] [--minutes 10] [--threads 2] [--out DIR]
       [--batch-size 32]
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

sys.path.insert(0, str(Path(__file__).parent))
from common import SHARED_DATA, machine
from lm import hf_step

from attnlab.tasks.lm import GPT_BETAS, GPT_EPS, HELD_OUT_SHARE, default_lr, load_lm, score_stream
from attnlab.text.token_stream import TokenStream, WindowBatches, held_out_split
from attnlab.train.optim import build_optimizer

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
    """Train hf on the windows until the clock runs out; cosine over the steps that fit."""
    from transformers import get_cosine_schedule_with_warmup

    optimizer = build_optimizer(hf, LR, 0.1, GPT_BETAS, GPT_EPS)
    data = iter(batches)

    def step() -> float:
        return hf_step(hf, optimizer, next(data))

    started = time.perf_counter()
    probe = copy_state(hf, optimizer)  # the probe's steps are undone: the run starts fresh
    for _ in range(10):
        step()
    step_s = (time.perf_counter() - started) / 10
    restore_state(hf, optimizer, probe)
    batches.step = 0
    data = iter(batches)
    steps = max(1, int(0.97 * minutes * 60 / step_s))
    schedule = get_cosine_schedule_with_warmup(optimizer, steps // 10, steps)
    started, done, loss = time.perf_counter(), 0, math.nan
    while done < steps and time.perf_counter() - started < minutes * 60:
        loss = step()
        schedule.step()
        done += 1
    seconds = time.perf_counter() - started
    return {"steps": done, "planned": steps, "train_loss": loss,
            "tokens_per_s": done * batches.batch_size * SEQ_LEN / seconds,
            "seconds": seconds}  # fmt: skip


def copy_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Deep copies of the model's and optimizer's states."""
    import copy

    return copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())


def restore_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: tuple[dict, dict]
) -> None:
    """Put back the states copy_state took."""
    model.load_state_dict(state[0])
    optimizer.load_state_dict(state[1])


def main() -> None:
    """Train both sides for --minutes, score the held-out text, print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path,
                        default=SHARED_DATA / "tinyshakespeare" / "input.txt.gz")  # fmt: skip
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, help="attnlab's run folder (default: a temporary one)")
    parser.add_argument("--batch-size", type=int, default=32, help="windows a step, both sides")
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
