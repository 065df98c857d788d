"""Pretraining quality in equal wall time: attnlab vs HF transformers' BertForPreTraining.

Both train bert-mini (MLM + NSP, seq 128, batch 32, AdamW lr 5e-4, warm-up 10%, linear decay)
for the same number of minutes on the same data through the same pipeline (vocabulary,
examples, dynamic masking, trainer, held-out set); only the model differs. Each first times a
few steps to size its schedule to the time budget. The data: the Chinese corpus
(../shared/data/zh-corpus) and English text (tinyshakespeare + WikiText-2 valid), documents
interleaved so the fixed held-out tail (the last 400 documents) holds both languages.

Usage: python bench/pretrain_quality.py --model attnlab|hf --minutes 30 --out DIR [--threads 1]
Run the two side by side (one thread each) so they share the machine's conditions.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import Tensor, nn

from attnlab.config import BertConfig

sys.path.insert(0, os.path.dirname(__file__))
from common import SHARED_DATA, machine


def documents(path: Path) -> list[list[str]]:
    """Blank-line separated documents of a gzip file (a line each when there are none)."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        text = f.read()
    if "\n\n" in text:
        return [d.strip().splitlines() for d in text.split("\n\n") if d.strip()]
    return [[line] for line in text.splitlines() if line.strip()]


def build_corpus(folder: Path) -> Path:
    """One interleaved zh + en corpus file in BERT's layout (written once, then reused)."""
    path = folder / "zh_en_corpus.txt"
    if path.exists():
        return path
    from attnlab.text.pretraining import split_sentences

    zh = documents(SHARED_DATA / "zh-corpus/reviews.txt.gz")
    headlines = [line[0] for line in documents(SHARED_DATA / "zh-corpus/news-headlines.txt.gz")]
    zh += [headlines[i : i + 5] for i in range(0, len(headlines), 5)]  # headline "documents"
    with gzip.open(SHARED_DATA / "tinyshakespeare/input.txt.gz", "rt", encoding="utf-8") as f:
        play = [block.splitlines() for block in f.read().split("\n\n") if block.strip()]
    with gzip.open(SHARED_DATA / "wikitext-2/wiki.valid.tokens.gz", "rt", encoding="utf-8") as f:
        wiki = [
            split_sentences(line.strip())
            for line in f
            if len(line.split()) > 10 and not line.strip().startswith("=")
        ]
    en = play + wiki
    mixed, ratio = [], max(1, len(zh) // len(en))
    for i, doc in enumerate(zh):
        mixed.append(doc)
        if i % ratio == 0 and i // ratio < len(en):
            mixed.append(en[i // ratio])
    text = "\n\n".join("\n".join(s for s in doc if s.strip()) for doc in mixed if doc)
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n", encoding="utf-8")
    return path


class HFAdapter(nn.Module):
    """HF BertForPreTraining behind attnlab's batch keys and outputs (full-vocabulary logits)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        from transformers import BertConfig as HFConfig
        from transformers import BertForPreTraining as HFPreTraining

        from attnlab.interop.hf import config_to_hf

        self.config = config
        self.hf = HFPreTraining(HFConfig(**config_to_hf(config)))

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        token_type_ids: Tensor,
        mlm_labels: Tensor,
        nsp_labels: Tensor | None = None,
        mlm_normalizer: Tensor | None = None,
    ) -> dict[str, Tensor]:
        """HF's forward and loss (mean over masked tokens), in attnlab's output names."""
        out = self.hf(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            labels=mlm_labels,
            next_sentence_label=nsp_labels,
        )
        masked = mlm_labels != -100
        logits = out.prediction_logits[masked]
        mlm_loss = torch.nn.functional.cross_entropy(logits.float(), mlm_labels[masked])
        nsp_loss = torch.nn.functional.cross_entropy(out.seq_relationship_logits, nsp_labels)
        return {
            "loss": out.loss,
            "mlm_loss": mlm_loss.detach(),
            "nsp_loss": nsp_loss.detach(),
            "mlm_logits": logits,
            "nsp_logits": out.seq_relationship_logits,
        }


def main() -> None:
    """Train one of the two models for the time budget and print its held-out metrics."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("attnlab", "hf"), required=True)
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--preset", default="bert-mini")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=5e-4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from attnlab.tasks.pretrain import PretrainOptions, build_model, prepare_data, run_tokenizer
    from attnlab.text.tokenizer import BertTokenizer
    from attnlab.train import TrainConfig, Trainer

    data_dir = args.out.parent / "data"
    corpus = build_corpus(data_dir)
    vocab_dir = data_dir / "vocab"
    opts = PretrainOptions(
        out=args.out, corpus=[corpus], preset=args.preset, batch_size=args.batch_size,
        seq_len=args.seq_len, vocab_size=21128, eval_documents=400, eval_examples=512,
        cache_dir=data_dir / "cache", progress=False,
    )  # fmt: skip
    if not (vocab_dir / "vocab.txt").exists():  # one vocabulary for both models
        run_tokenizer(opts, [corpus]).save(vocab_dir)
    opts.tokenizer = vocab_dir
    tokenizer = BertTokenizer.from_dir(vocab_dir)
    job = prepare_data(opts, [corpus], tokenizer)
    torch.manual_seed(0)
    ours = build_model(opts, tokenizer)
    model = ours if args.model == "attnlab" else HFAdapter(ours.config)

    # Size the schedule to the budget: time a few steps of this model first.
    probe = TrainConfig(
        out_dir=args.out / "probe", steps=6, progress=False, save_every=0, overwrite=True
    )
    probe_model = (
        build_model(opts, tokenizer) if args.model == "attnlab" else HFAdapter(ours.config)
    )
    start = time.perf_counter()
    Trainer(probe_model, prepare_data(opts, [corpus], tokenizer).batches, probe).fit()
    per_step = (time.perf_counter() - start) / 6
    steps = max(10, int(args.minutes * 60 / per_step))
    print(
        f"{args.model}: {per_step:.2f} s/step -> {steps} steps in {args.minutes} min",
        file=sys.stderr,
    )

    config = TrainConfig(
        out_dir=args.out / "run", steps=steps, lr=args.lr, warmup=steps // 10,
        log_every=max(1, steps // 100), eval_every=max(1, steps // 5), save_every=0,
        overwrite=True, progress=False, seed=0,
    )  # fmt: skip
    started = time.perf_counter()
    summary = Trainer(model, job.batches, config, job.evaluate).fit()
    result = {
        "bench": "pretrain_quality",
        "model": args.model,
        "machine": machine(),
        "preset": args.preset,
        "minutes": (time.perf_counter() - started) / 60,
        "steps": steps,
        "tokens_per_s": summary["tokens_per_s"],
        **summary["eval"],
    }
    print(json.dumps(result))
    (args.out / "result.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
