"""Pretraining step speed: attnlab BertForPreTraining against HF transformers', side by side.

Same config (a preset), batch, sequence length, masking rate (15%), optimizer (AdamW, lr 1e-4,
weight decay 0.01, the fused kernel as HF's Trainer and attnlab use), threads and precision
(fp32 against fp32, bf16 autocast against bf16 autocast), synthetic token ids. HF runs a second
time with torch's default (foreach) AdamW kernel, as a hand-written loop gets. Prints tokens/s,
the ratios, and each one's model FLOPs utilisation against the measured matmul peak (fp32;
for bf16 runs the bf16 one where the CPU multiplies bf16 faster, bench/common.py: peak_dtype),
counting only the FLOPs the model must do (forward + backward = 3x forward, with the MLM
vocabulary projection on masked positions only, and the last layer's queries, output
projection and feed-forward at the masked positions and [CLS] only: no loss reads the others).
It also prints the utilisation with the last layer counted at every position. The peak is
measured before and after the runs; the higher one is the yardstick.

With bf16 on a CPU that multiplies bf16 no faster than fp32 (no AMX, nor AMD's avx512_bf16;
attnlab/fast/route.py), attnlab computes autocast's bf16 products with the fp32 kernel
(attnlab/fast/linear.py: same numbers up to the order of the sums) while HF runs PyTorch's bf16
kernels: emulated without avx512_bf16 (about 5x slower than fp32), with Intel's avx512_bf16
about 1.5x slower; the script says so when that is the case, since the ratio then measures
that choice.

The systems run ``--rounds`` times (default 2), interleaved (HF, HF foreach, attnlab, then
the reverse order, ...), and each one's fastest round counts: this shared machine's speed
drifts by several percent over minutes, and one pass in a fixed order can hand the drift to
one side.

Both systems run under one allocator setting: ``--malloc keep`` (the default, and what
attnlab's trainer sets: glibc keeps freed memory, so no fresh pages are faulted in for each
step's large temporaries; attnlab/fast/training.py: keep_freed_memory) or ``--malloc
default`` (glibc as it comes). Each system runs in a fresh process of its own: glibc raises
its thresholds after the first large blocks are freed, so a system timed after another in the
same process would run under an allocator the first one had tuned.

Usage: python bench/pretrain.py [--preset bert-small] [--batch-size 32] [--seq-len 128]
       [--steps 10] [--precision fp32|bf16] [--threads T] [--malloc keep|default] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import nullcontext

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import (
    MALLOC_HELP,
    layer_flops,
    machine,
    matmul_peak_flops,
    peak_dtype,
    set_malloc,
    synthetic_batch,
    training_step,
)

MASK_RATE = 0.15


def step_flops(config, batch: int, seq: int, masked: int, kept: int | None = None) -> float:
    """Training FLOPs of one step (3x forward), MLM projection on masked positions only.

    With ``kept`` (masked positions plus [CLS]) the last layer counts only what those rows
    need: keys and values at every position, the rest at the kept rows alone.
    """
    d, f, n, v = config.d_model, config.d_ff, config.n_layers, config.vocab_size
    tokens = batch * seq
    every = layer_flops(tokens, tokens, seq, d, f)
    last = every if kept is None else layer_flops(tokens, kept, seq, d, f)
    encoder = (n - 1) * every + last
    heads = 2 * masked * (d * d + d * v) + 2 * batch * (d * d + 2 * d)
    return 3 * (encoder + heads)


def time_steps(step, steps: int) -> float:
    """Seconds per step over `steps` steps after two warm-up steps."""
    step()
    step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def attnlab_step(config, data, precision: str):
    """attnlab's training step (the trainer's: forward, backward, clip, AdamW) on one batch.

    The model runs with its training speed-ups swapped in, as the pretraining job runs it.
    """
    from attnlab.fast import for_training
    from attnlab.models.bert import BertForPreTraining
    from attnlab.train.optim import build_optimizer

    model = for_training(BertForPreTraining(config).train())
    step = training_step(model, build_optimizer(model, lr=1e-4, weight_decay=0.01), precision)
    return lambda: step(data)


def hf_step(config, data, precision: str, fused: bool = True):
    """HF transformers' BertForPreTraining with AdamW (fused kernel or torch's default) and clip 1.0."""
    from transformers import BertConfig as HFConfig
    from transformers import BertForPreTraining as HFPreTraining

    from attnlab.interop.hf import config_to_hf

    model = HFPreTraining(HFConfig(**config_to_hf(config))).train()
    # fused: HF Trainer's default kernel on torch >= 2.8 (run_mlm.py), and attnlab's; without it,
    # torch's default (foreach) AdamW of a hand-written loop (run_mlm_no_trainer.py).
    kernel = {"fused": True} if fused else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, **kernel)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else nullcontext()

    def step() -> None:
        with autocast:
            loss = model(
                input_ids=data["input_ids"], token_type_ids=data["token_type_ids"],
                labels=data["mlm_labels"], next_sentence_label=data["nsp_labels"],
            ).loss  # fmt: skip
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


SYSTEMS = {  # name -> builder of its step function (config, data, precision)
    "hf": lambda *a: hf_step(*a, fused=True),
    "hf_foreach": lambda *a: hf_step(*a, fused=False),
    "attnlab": attnlab_step,
}


def must_do_flops(config, data, batch_size: int, seq_len: int) -> tuple[float, float]:
    """A step's FLOPs as the model must do them, and with the last layer at every position."""
    masked_positions = data["mlm_labels"] != -100
    masked = int(masked_positions.sum())
    kept = int((masked_positions | (torch.arange(seq_len) == 0)).sum())
    # "must do": the last layer at the masked positions and [CLS] only (what attnlab runs);
    # the dense count takes that layer at every position, as both counts once did.
    flops = step_flops(config, batch_size, seq_len, masked, kept)
    return flops, step_flops(config, batch_size, seq_len, masked)


def system_row(name: str, tokens: int, rounds: list[float], work: float, dense_work: float) -> dict:
    """One system's figures (printed too): tokens/s and utilisation of its fastest round.

    ``rounds``: its seconds per step in each round; ``work`` and ``dense_work``: a step's
    FLOPs over the matmul peak (seconds at the peak).
    """
    seconds = min(rounds)
    mfu, dense_mfu = work / seconds, dense_work / seconds
    each = [round(tokens / s) for s in rounds]
    print(
        f"{name:10s} {tokens / seconds:9.0f} tokens/s  MFU {mfu:6.1%} "
        f"(last layer counted at every position: {dense_mfu:6.1%}); rounds {each}",
        file=sys.stderr,
    )
    return {
        "tokens_per_s": tokens / seconds, "mfu": mfu, "mfu_dense_last": dense_mfu,
        "rounds_tokens_per_s": each,
    }  # fmt: skip


def time_in_child(name: str) -> float:
    """Seconds per step of one system, timed by this script in a fresh process (--only)."""
    child = subprocess.run(
        [sys.executable, __file__, *sys.argv[1:], "--only", name],
        check=True, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    return json.loads(child.stdout.strip().splitlines()[-1])["seconds"]


def parse_args() -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bert-small")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--malloc", choices=("keep", "default"), default="keep", help=MALLOC_HELP)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved runs; best counts")
    parser.add_argument("--only", choices=tuple(SYSTEMS), help=argparse.SUPPRESS)  # a child
    return parser.parse_args()


def interleaved_rounds(n_rounds: int) -> dict[str, list[float]]:
    """Seconds per step of each system in each round, the order reversed every other round."""
    rounds: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    for r in range(n_rounds):
        for name in SYSTEMS if r % 2 == 0 else reversed(SYSTEMS):
            rounds[name].append(time_in_child(name))
    return rounds


def main() -> None:
    """Time both and print one table row and a JSON line."""
    args = parse_args()
    torch.set_num_threads(args.threads)
    set_malloc(args.malloc)
    torch.manual_seed(0)

    from attnlab.config import BertConfig
    from attnlab.fast.route import fast_bf16_matmul

    config = BertConfig.preset(args.preset)
    data = synthetic_batch(config.vocab_size, args.batch_size, args.seq_len, MASK_RATE)
    if args.only is not None:
        step = SYSTEMS[args.only](config, data, args.precision)
        print(json.dumps({"seconds": time_steps(step, args.steps)}))
        return
    flops, dense_flops = must_do_flops(config, data, args.batch_size, args.seq_len)
    yardstick = peak_dtype(args.precision)
    kind = "bf16" if yardstick == torch.bfloat16 else "fp32"
    peak = matmul_peak_flops(yardstick)
    tokens = args.batch_size * args.seq_len
    print(f"machine: {machine()}; {kind} matmul peak {peak / 1e9:.1f} GFLOP/s", file=sys.stderr)
    if args.precision == "bf16" and fast_bf16_matmul() is False:
        print(
            "note: bf16 products are no faster than fp32 here: attnlab's run on the fp32 "
            "kernel, HF's on PyTorch's slower bf16 kernel",
            file=sys.stderr,
        )
    rounds = interleaved_rounds(args.rounds)
    # The peak again after the runs: the higher of the two is the yardstick.
    after = matmul_peak_flops(yardstick)
    print(f"{kind} matmul peak after the runs {after / 1e9:.1f} GFLOP/s", file=sys.stderr)
    peak = max(peak, after)
    result = {
        name: system_row(name, tokens, each, flops / peak, dense_flops / peak)
        for name, each in rounds.items()
    }
    ours = result["attnlab"]["tokens_per_s"]
    ratio = ours / result["hf"]["tokens_per_s"]
    ratio_foreach = ours / result["hf_foreach"]["tokens_per_s"]
    print(
        f"ratio attnlab / hf (fused AdamW): {ratio:.2f}x; / hf (foreach AdamW): {ratio_foreach:.2f}x",
        file=sys.stderr,
    )
    print(
        json.dumps(
            {
                "bench": "pretrain",
                "preset": args.preset,
                "batch_size": args.batch_size,
                "seq_len": args.seq_len,
                "precision": args.precision,
                "threads": args.threads,
                "malloc": args.malloc,
                "peak_gflops": peak / 1e9,
                "peak_dtype": kind,
                "ratio": ratio,
                "ratio_vs_foreach": ratio_foreach,
                **result,
            }
        )
    )


if __name__ == "__main__":
    main()
