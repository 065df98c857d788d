"""The dropout twin on a fine-tuning step, in one process: FastDropout against nn.Dropout.

all-MiniLM-L6-v2 with a classification head, the fine-tuning job's training twins, fused AdamW,
clipping at 1.0, batches of 32 SST-2 training sentences. The model's dropout modules switch
class between plain ``nn.Dropout`` and ``FastDropout`` every pass over the batches, so a drift
in the machine's speed falls on both; the first pass warms up and is not counted. Printed: each
batch's median step time plain / twin, their median, and the summed medians of both.

Usage: python bench/dropout_step.py [--batches 8] [--passes 14] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from finetune import minilm_dir, read_sst2

from attnlab import fast
from attnlab.interop.hf import load_task_model
from attnlab.text.parallel import pad_batch
from attnlab.text.tokenizer import BertTokenizer
from attnlab.train.hooks import TrainerHooks
from attnlab.train.optim import build_optimizer


def sst2_batches(tokenizer: BertTokenizer, count: int) -> list[tuple[torch.Tensor, ...]]:
    """count batches of 32 SST-2 training sentences: ids and mask padded to the batch, labels."""
    rows = read_sst2("train", 32 * count)
    batches = []
    for start in range(0, len(rows), 32):
        chunk = rows[start : start + 32]
        ids = pad_batch([tokenizer.encode(text).ids[:128] for text, _ in chunk], tokenizer.pad_id)
        mask = (ids != tokenizer.pad_id).long()
        batches.append((ids, mask, torch.tensor([label for _, label in chunk])))
    return batches


def main() -> None:
    """Alternate the two dropout classes pass by pass; print the per-batch ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--passes", type=int, default=14)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, _ = load_task_model(minilm_dir(), "classify", num_labels=2)
    model = fast.for_training(model).train()
    optimizer = build_optimizer(model, 3e-5, 0.01, fused=True)
    batches = sst2_batches(BertTokenizer.from_dir(minilm_dir()), args.batches)
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    times: dict[str, dict[int, list[float]]] = {
        "twin": defaultdict(list),
        "plain": defaultdict(list),
    }
    for done in range(args.passes):
        kind = "twin" if done % 2 == 0 else "plain"
        for module in dropouts:
            if kind == "twin":
                fast.for_training(module, "dropout")
            else:
                fast.to_plain(module)
        for index, (ids, mask, labels) in enumerate(batches):
            started = time.perf_counter()
            model(ids, attention_mask=mask, labels=labels)["loss"].backward()
            TrainerHooks().clipped_step(optimizer, model.parameters(), 1.0)
            optimizer.zero_grad(set_to_none=True)
            if done >= 2:  # the first pass of each kind warms up
                times[kind][index].append(time.perf_counter() - started)
    medians = {k: [statistics.median(v[i]) for i in range(len(batches))] for k, v in times.items()}
    ratios = [p / t for p, t in zip(medians["plain"], medians["twin"], strict=True)]
    print(f"{len(dropouts)} dropout modules; plain / twin per batch:",
          " ".join(f"{r:.3f}" for r in ratios))  # fmt: skip
    print(f"median {statistics.median(ratios):.3f}; summed medians twin "
          f"{sum(medians['twin']):.3f} s, plain {sum(medians['plain']):.3f} s "
          f"({sum(medians['plain']) / sum(medians['twin']):.3f})")  # fmt: skip


if __name__ == "__main__":
    main()
