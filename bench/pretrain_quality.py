"""Pretraining quality in equal wall time: attnlab vs HF transformers' BertForPreTraining.

Both train bert-mini (MLM + NSP, seq 128, batch 32, AdamW lr 5e-4, warm-up 10%, linear decay)
for the same number of minutes on the same data through the same pipeline (vocabulary,
examples, dynamic masking, trainer, held-out set); only the model differs. Each first times a
few steps to size its schedule to the time budget, which is also a hard stop. The data
(--lang): the Chinese corpus (../shared/data/zh-corpus: reviews and headlines), English text
(tinyshakespeare + WikiText-2 valid, interleaved), or both interleaved; 400 documents drawn
across the corpus by a fixed seed are held out (the last 400 before 2026-12-02). The attnlab run also saves its model (HF layout) in OUT/model.

Usage: python bench/pretrain_quality.py --model attnlab|hf --lang zh|en|both --minutes 30 --out DIR
       [--threads 1]
Run the two side by side (one thread each) so they share the machine's conditions.
Plot finished runs: python bench/pretrain_quality.py plot IMAGE.png RUN_DIR...
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


def chinese_documents() -> list[list[str]]:
    """The Chinese corpus: reviews (a document each) and headlines in groups of five."""
    zh = documents(SHARED_DATA / "zh-corpus/reviews.txt.gz")
    headlines = [line[0] for line in documents(SHARED_DATA / "zh-corpus/news-headlines.txt.gz")]
    return zh + [headlines[i : i + 5] for i in range(0, len(headlines), 5)]


def english_documents() -> list[list[str]]:
    """English text: tinyshakespeare speeches and WikiText-2 valid paragraphs, interleaved."""
    from attnlab.text.sentences import split_sentences

    with gzip.open(SHARED_DATA / "tinyshakespeare/input.txt.gz", "rt", encoding="utf-8") as f:
        play = [block.splitlines() for block in f.read().split("\n\n") if block.strip()]
    with gzip.open(SHARED_DATA / "wikitext-2/wiki.valid.tokens.gz", "rt", encoding="utf-8") as f:
        wiki = [
            split_sentences(line.strip())
            for line in f
            if len(line.split()) > 10 and not line.strip().startswith("=")
        ]
    return interleave(play, wiki)


def interleave(many: list[list[str]], few: list[list[str]]) -> list[list[str]]:
    """Spread the documents of `few` evenly through `many`, so any tail holds both."""
    mixed, ratio = [], max(1, len(many) // len(few))
    for i, doc in enumerate(many):
        mixed.append(doc)
        if i % ratio == 0 and i // ratio < len(few):
            mixed.append(few[i // ratio])
    return mixed


def build_corpus(folder: Path, lang: str) -> Path:
    """The corpus file of one language (or both interleaved) in BERT's layout, written once."""
    path = folder / f"{lang}_corpus.txt"
    if path.exists():
        return path
    if lang == "zh":
        docs = chinese_documents()
    elif lang == "en":
        docs = english_documents()
    else:
        docs = interleave(chinese_documents(), english_documents())
    text = "\n\n".join("\n".join(s for s in doc if s.strip()) for doc in docs if doc)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # the two runs may build it at once
    tmp.write_text(text + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def shared_data(out: Path, lang: str, vocab_size: int, **options: object) -> tuple:
    """(PretrainOptions, corpus file, tokenizer) of a run in `out`; data and vocabulary shared.

    The corpus, its token cache and the WordPiece vocabulary (trained once, `vocab_size`) lie
    in out's parent, so that runs side by side (the two models here, the two settings of
    bench/pretrain_memory.py) read the same data. options: further PretrainOptions fields.
    """
    from attnlab.tasks.pretrain import PretrainOptions, run_tokenizer
    from attnlab.text.tokenizer import BertTokenizer

    data_dir = out.parent / f"data-{lang}"
    corpus = build_corpus(data_dir, lang)
    vocab_dir = data_dir / "vocab"
    opts = PretrainOptions(
        out=out, corpus=[corpus], vocab_size=vocab_size, eval_documents=400, eval_examples=512,
        cache_dir=data_dir / "cache", progress=False, **options,
    )  # fmt: skip
    if not (vocab_dir / "vocab.txt").exists():  # one vocabulary for every run beside it
        run_tokenizer(opts, [corpus]).save(vocab_dir)
    opts.tokenizer, opts.vocab_size = vocab_dir, None  # the vocabulary is now a given one
    return opts, corpus, BertTokenizer.from_dir(vocab_dir)


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


def plot_runs(runs: list[Path], image: Path) -> None:
    """Training loss and held-out MLM accuracy against training minutes, one line per run."""
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(10, 3.8))
    for run in runs:
        rows = [json.loads(line) for line in (run / "run/metrics.jsonl").open(encoding="utf-8")]
        train = [r for r in rows if not r.get("eval")]
        evals = [r for r in rows if r.get("eval")]
        steps, minutes = [r["step"] for r in train], [r["elapsed_s"] / 60 for r in train]
        label = run.name
        loss_ax.plot(minutes, [r["loss"] for r in train], label=label)
        acc_ax.plot(  # evaluation steps need not be logging steps: interpolate their time
            [float(np.interp(r["step"], steps, minutes)) for r in evals],
            [100 * r["eval_mlm_accuracy"] for r in evals],
            marker="o",
            label=label,
        )
    loss_ax.set_ylabel("training loss (MLM + NSP)")
    acc_ax.set_ylabel("held-out MLM accuracy (%)")
    for ax in (loss_ax, acc_ax):
        ax.set_xlabel("training time (minutes)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(image.stem)
    fig.tight_layout()
    fig.savefig(image, dpi=110)


def main() -> None:
    """Train one of the two models for the time budget and print its held-out metrics."""
    if sys.argv[1:2] == ["plot"]:  # plot IMAGE RUN_DIR...: curves of finished runs
        plot_runs([Path(run) for run in sys.argv[3:]], Path(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("attnlab", "hf"), required=True)
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--preset", default="bert-mini")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--lang", choices=("zh", "en", "both"), default="zh")
    parser.add_argument("--vocab-size", type=int, help="default 21128 (zh, both), 8192 (en)")
    args = parser.parse_args()
    vocab_size = args.vocab_size or (8192 if args.lang == "en" else 21128)
    torch.set_num_threads(args.threads)

    from attnlab.tasks.pretrain import build_model, prepare_data
    from attnlab.train import TrainConfig, Trainer

    opts, corpus, tokenizer = shared_data(
        args.out, args.lang, vocab_size, preset=args.preset, batch_size=args.batch_size,
        seq_len=args.seq_len,
    )  # fmt: skip
    job = prepare_data(opts, [corpus], tokenizer)
    torch.manual_seed(0)
    ours = build_model(opts, tokenizer)
    model = ours if args.model == "attnlab" else HFAdapter(ours.config)

    # Size the schedule to the budget from the pace of a short probe: the difference between
    # an 8-step and a 2-step run, after a first 2-step run that pays one-time costs (imports,
    # allocator warm-up). The budget itself is a hard stop.
    probe_model = (
        build_model(opts, tokenizer) if args.model == "attnlab" else HFAdapter(ours.config)
    )
    paces = []
    for steps in (2, 2, 8):
        probe = TrainConfig(
            out_dir=args.out / "probe", steps=steps, progress=False, save_every=0, overwrite=True
        )
        start = time.perf_counter()
        Trainer(probe_model, prepare_data(opts, [corpus], tokenizer).batches, probe).fit()
        paces.append(time.perf_counter() - start)
    per_step = max(1e-3, (paces[2] - paces[1]) / 6)
    steps = max(10, int(args.minutes * 60 / per_step))
    print(
        f"{args.model}: {per_step:.2f} s/step -> {steps} steps in {args.minutes} min",
        file=sys.stderr,
    )

    config = TrainConfig(
        out_dir=args.out / "run", steps=steps, lr=args.lr, warmup=steps // 10,
        log_every=max(1, steps // 100), eval_every=max(1, steps // 5), save_every=0,
        overwrite=True, progress=False, seed=0, max_seconds=args.minutes * 60,
    )  # fmt: skip
    started = time.perf_counter()
    summary = Trainer(model, job.batches, config, job.evaluate).fit()
    result = {
        "bench": "pretrain_quality",
        "model": args.model,
        "lang": args.lang,
        "machine": machine(),
        "preset": args.preset,
        "minutes": (time.perf_counter() - started) / 60,
        "steps": summary["step"],
        "planned_steps": steps,
        "tokens_per_s": summary["tokens_per_s"],
        **summary["eval"],
    }
    print(json.dumps(result))
    (args.out / "result.json").write_text(json.dumps(result, indent=2))
    if args.model == "attnlab":  # a checkpoint the fine-tuning benchmarks can start from
        from attnlab.interop.hf import save_bert

        save_bert(model.eval(), args.out / "model", tokenizer, overwrite=True)


if __name__ == "__main__":
    main()
