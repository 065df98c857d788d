"""Language-model speed: attnlab's GPT against HF `GPT2LMHeadModel`, same config and weights.

``train``: training tokens/s. Both models have one config (a GPTConfig preset, the vocabulary
of --vocab-size) and the same weights (attnlab's, written in GPT-2's layout and read by HF's
``from_pretrained``), the same batches (random windows of --seq-len tokens), the same
optimizer (fused AdamW, betas (0.9, 0.99), weight decay 0.1 on matrices and embeddings),
clipping at 1.0, fp32, --threads threads. attnlab runs as `attnlab lm train` does: its
training twins swapped in (attnlab.fast) and the trainer's step (bench/common.py:
training_step); HF's step is the plain loop with the same loss (mean next-token cross-entropy
of the logits). Timed: the best of --repeats rounds of --steps steps, after a warm-up round, the
two sides' rounds alternating.

``generate``: generation tokens/s, sampling --new-tokens tokens (temperature 1) for batches of
1 and 8 one-token prompts, the best of --repeats rounds that alternate between the two sides.
The end-of-text token is never emitted (random weights would end rows at random), so both make
exactly the same number of tokens, and both get the all-ones attention mask of a batch without
padding. attnlab runs as `attnlab generate` does (its inference twins, the decoding twin among
them; KV cache); HF's ``generate(do_sample=True)``.

The quality figure on a time budget (issue 39 item 7c) is `bench/lm_quality.py`: `attnlab lm
train --max-minutes` against HF for the same minutes, both scored on the held-out 10%.

``train --ceiling`` also profiles each side's step (torch.profiler) and prints the time spent
in the kernels both sides run alike (products, fused attention, fused AdamW): HF's step time
over its own time in them is the most any implementation of the same kernels could gain.
``generate --ceiling`` profiles one more run of each side and prints the best round's wall time
over its time in the products and the fused attention: the same bound for sampling.

Usage: python bench/lm.py train [--preset gpt-char] [--batch-size 32] [--seq-len 256] [--ceiling]
       python bench/lm.py generate [--preset gpt-char] [--new-tokens 256] [--ceiling]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import best_times_alternating, machine, training_step

from attnlab import fast
from attnlab.config import GPTConfig
from attnlab.interop.gpt2 import save_gpt
from attnlab.models.gpt import GPT
from attnlab.tasks.lm import GPT_BETAS, GPT_EPS, NextTokenLoss
from attnlab.train.optim import build_optimizer


def twin_models(preset: str, vocab_size: int, seq_len: int) -> tuple[GPT, torch.nn.Module]:
    """attnlab's GPT (no dropout) and HF's GPT2LMHeadModel with the same weights."""
    from transformers import GPT2LMHeadModel

    config = GPTConfig.preset(preset, vocab_size=vocab_size, dropout=0.0, attention_dropout=0.0,
                              max_positions=max(seq_len + 1, 256))  # fmt: skip
    torch.manual_seed(0)
    ours = GPT(config)
    with tempfile.TemporaryDirectory() as folder:
        save_gpt(ours, Path(folder) / "gpt", require_hf=True)
        hf = GPT2LMHeadModel.from_pretrained(str(Path(folder) / "gpt"))
    return ours, hf


def batches(
    vocab_size: int, batch_size: int, seq_len: int, n: int
) -> list[dict[str, torch.Tensor]]:
    """n batches of random windows: input_ids and next-token targets."""
    generator = torch.Generator().manual_seed(1)
    rows = torch.randint(0, vocab_size, (n, batch_size, seq_len + 1), generator=generator)
    return [{"input_ids": r[:, :-1], "targets": r[:, 1:]} for r in rows]


def hf_step(hf: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict) -> float:
    """One plain training step of an HF causal LM: mean next-token cross-entropy, clip at 1."""
    logits = hf(input_ids=batch["input_ids"]).logits
    loss = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def bench_train(args: argparse.Namespace) -> None:
    """Training tokens/s of both models on the same batches."""
    ours, hf = twin_models(args.preset, args.vocab_size, args.seq_len)
    data = batches(args.vocab_size, args.batch_size, args.seq_len, args.steps)
    model = fast.for_training(NextTokenLoss(ours.train()))
    optimizer = build_optimizer(model, 1e-3, 0.1, GPT_BETAS, GPT_EPS)
    step = training_step(model, optimizer)
    hf.train()
    hf_optimizer = build_optimizer(hf, 1e-3, 0.1, GPT_BETAS, GPT_EPS)

    tokens = args.steps * args.batch_size * args.seq_len
    steps = {"attnlab": step, "HF": lambda b: hf_step(hf, hf_optimizer, b)}
    rounds = {name: (lambda s=one_step: [s(b) for b in data]) for name, one_step in steps.items()}
    timed = best_times_alternating(rounds, args.repeats)
    for name, one_step in steps.items():
        seconds = timed[name][0]
        print(
            f"{name:8} train {tokens / seconds:10.0f} tokens/s ({seconds / args.steps:.3f} s/step)"
        )
        if args.ceiling:
            print_kernel_share(name, one_step, data)


# The kernels any implementation of the step runs as HF does: the products, PyTorch's fused
# attention (forward and backward) and the fused AdamW step.
SHARED_KERNELS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_fused_adamw_",
                  "aten::_scaled_dot_product_flash_attention_for_cpu",
                  "aten::_scaled_dot_product_flash_attention_for_cpu_backward")  # fmt: skip


def kernel_seconds(run: Callable[[], object]) -> tuple[float, float]:
    """(seconds in every profiled op, seconds in SHARED_KERNELS) of one call of run."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / 1e6
    return total, sum(e.self_cpu_time_total for e in events if e.key in SHARED_KERNELS) / 1e6


def print_kernel_share(name: str, step: Callable[[dict], float], data: list[dict]) -> None:
    """Seconds a step spends in SHARED_KERNELS under torch.profiler, of the step's total.

    For HF's step, total / shared is the speed-up a step with no other cost would have over it:
    the ceiling of any implementation running the same kernels.
    """
    total, shared = kernel_seconds(lambda: [step(batch) for batch in data])
    total, shared = total / len(data), shared / len(data)
    print(f"{name:8} profiled {total:.3f} s/step, {shared:.3f} in the shared kernels "
          f"({shared / total:.0%}; total / shared {total / shared:.2f}x)")  # fmt: skip


def bench_generate(args: argparse.Namespace) -> None:
    """Sampling tokens/s of both models, batch 1 and 8."""
    from attnlab.decode.sampling import generate

    ours, hf = twin_models(args.preset, args.vocab_size, args.new_tokens)
    ours.eval()
    hf.eval()
    results: dict[str, dict[str, float]] = {}
    for batch_size in (1, 8):
        prompt = torch.zeros((batch_size, 1), dtype=torch.long)

        def run_ours(prompt: torch.Tensor = prompt) -> torch.Tensor:
            with fast.inference_twins(ours):
                return generate(ours, prompt, args.new_tokens, attention_mask=torch.ones_like(prompt),
                                generator=torch.Generator().manual_seed(0))  # fmt: skip

        def run_hf(prompt: torch.Tensor = prompt) -> torch.Tensor:
            return hf.generate(prompt, do_sample=True, max_new_tokens=args.new_tokens,
                               min_new_tokens=args.new_tokens, top_k=0, eos_token_id=None,
                               pad_token_id=0, attention_mask=torch.ones_like(prompt))  # fmt: skip

        runs = {"attnlab": run_ours} if args.only else {"attnlab": run_ours, "HF": run_hf}
        timed = best_times_alternating(runs, args.repeats)
        for name, run in runs.items():
            seconds, out = timed[name]
            assert out.shape == (batch_size, 1 + args.new_tokens), out.shape
            rate = batch_size * args.new_tokens / seconds
            results.setdefault(name, {})[f"batch_{batch_size}"] = rate
            print(f"{name:8} generate batch {batch_size}: {rate:8.0f} tokens/s")
            if args.ceiling:  # the wall time of the best round over its time in the kernels
                shared = kernel_seconds(run)[1]
                print(f"{name:8} {shared / seconds:.0%} of the time in the shared kernels "
                      f"(wall / shared {seconds / shared:.2f}x)")  # fmt: skip
    print(json.dumps({"bench": "generate", "preset": args.preset, "tokens_per_s": results}))


def main() -> None:
    """Parse the mode and its options, set the threads, run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("train", "generate"))
    parser.add_argument("--preset", default="gpt-char")
    parser.add_argument("--vocab-size", type=int, default=65, help="65: shakespeare's characters")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5, help="steps per timed round")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", choices=("attnlab",),
                        help="generate: time attnlab alone (bench/speedup_ab.py)")  # fmt: skip
    parser.add_argument("--ceiling", action="store_true",
                        help="also profile the time spent in the shared kernels")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(machine(), f"| {args.mode} {args.preset} fp32", time.strftime("%Y-%m-%d %H:%M"))
    bench_train(args) if args.mode == "train" else bench_generate(args)


if __name__ == "__main__":
    main()
