"""The quick run a new user makes: one epoch with attnlab's defaults against HF Trainer's defaults.

Both sides fine-tune all-MiniLM-L6-v2 for one epoch on the same small training sets and score
the same split:

- SST-2: the first 6,000 training sentences, dev accuracy;
- CoNLL-2003: the first 4,000 training sentences (document markers skipped), test entity F1
  (seqeval, at the first sub-token of each word).

attnlab: the CLI with only the required flags and ``--epochs 1`` (``attnlab finetune --task
classify|ner --model M --train F --dev F --epochs 1``; SST-2 also names its text column), then
``attnlab evaluate``: every other setting (learning rate, batch, warm-up, pooling) is the
run's default, which it prints. HF: what ``Trainer`` does with its defaults (AdamW lr 5e-5,
betas (0.9, 0.999), eps 1e-8, no weight decay, batch 8, shuffled, padded per batch, linear
decay to 0 with no warm-up, clipping at 1.0, fp32), written out as a loop because Trainer needs
the `accelerate` package, which attnlab does not install; ``AutoModelFor{Sequence,Token}
Classification`` (the [CLS] pooler; labels on each word's first sub-token).

Usage: python bench/finetune_quick.py [--only sst2 conll] [--threads 2] [--out runs/quick]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import SHARED_DATA, machine
from finetune_results import minilm

from attnlab.text.tasks import read_conll

SST2_TRAIN, CONLL_TRAIN = 6000, 4000
HF_LR, HF_BATCH = 5e-5, 8  # TrainingArguments' defaults


def conll_sentences(path: Path, limit: int | None = None) -> list[list[tuple[str, str]]]:
    """(word, tag) sentences of a CoNLL file, read as `attnlab finetune` reads it."""
    sentences = [list(zip(e.words, e.tags, strict=True)) for e in read_conll(path)]
    return sentences[:limit] if limit else sentences


def write_subsets(work: Path) -> dict[str, Path]:
    """The small training files both sides read."""
    work.mkdir(parents=True, exist_ok=True)
    sst = work / "sst2-6000.tsv"
    with gzip.open(SHARED_DATA / "sst2/train.tsv.gz", "rt", encoding="utf-8") as f:
        sst.write_text("".join(next(f) for _ in range(SST2_TRAIN + 1)), encoding="utf-8")
    conll = work / "conll-4000.txt"
    blocks = conll_sentences(SHARED_DATA / "conll2003/train.bio.txt.gz", CONLL_TRAIN)
    conll.write_text("".join("".join(f"{w} {t}\n" for w, t in s) + "\n" for s in blocks),
                     encoding="utf-8")  # fmt: skip
    return {"sst2": sst, "conll": conll}


def attnlab_run(task: str, train: Path, out: Path, threads: int) -> dict:
    """attnlab finetune (defaults, one epoch) and evaluate; the metrics, defaults and time."""
    if task == "sst2":
        args = ["--task", "classify", "--dev", str(SHARED_DATA / "sst2/dev.tsv.gz"),
                "--text-column", "sentence"]  # fmt: skip
        report = SHARED_DATA / "sst2/dev.tsv.gz"
    else:
        args = ["--task", "ner", "--dev", str(SHARED_DATA / "conll2003/valid.bio.txt.gz")]
        report = SHARED_DATA / "conll2003/test.bio.txt.gz"
    command = [sys.executable, "-m", "attnlab", "finetune", "--model", minilm(), "--train",
               str(train), *args, "--epochs", "1", "--out", str(out), "--threads", str(threads),
               "--no-progress", "--overwrite"]  # fmt: skip
    began = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - began
    settings = (
        "lr ",
        "batch_size ",
        "epochs ",
        "warmup_ratio ",
        "pooling ",
    )  # defaults.py Choice lines
    defaults = [line for line in done.stderr.splitlines() if line.startswith(settings)]
    evaluate = [sys.executable, "-m", "attnlab", "evaluate", "--model", str(out), "--data",
                str(report), "--threads", str(threads)]  # fmt: skip
    metrics = json.loads(
        subprocess.run(evaluate, capture_output=True, text=True, check=True).stdout
    )
    return {"metrics": metrics, "train_s": round(seconds, 1), "printed": defaults}


def hf_epoch(model: torch.nn.Module, batches: list[dict]) -> None:
    """One epoch as HF Trainer's defaults run it: AdamW 5e-5, linear decay, clip 1.0."""
    from transformers import get_linear_schedule_with_warmup

    optimizer = torch.optim.AdamW(model.parameters(), lr=HF_LR, weight_decay=0.0)
    schedule = get_linear_schedule_with_warmup(optimizer, 0, len(batches))
    model.train()
    for batch in batches:
        model(**batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)


def padded_batches(rows: list[dict], tokenizer, seed: int = 42) -> list[dict]:
    """Shuffled batches of HF_BATCH rows, padded to each batch's longest (labels with -100)."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    out = []
    for start in range(0, len(order), HF_BATCH):
        chunk = [rows[i] for i in order[start : start + HF_BATCH]]
        labels = [r.pop("labels") for r in chunk]
        batch = tokenizer.pad(chunk, return_tensors="pt")
        if isinstance(labels[0], list):
            width = batch["input_ids"].shape[1]
            batch["labels"] = torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])
        else:
            batch["labels"] = torch.tensor(labels)
        out.append(batch)
    return out


def hf_sst2(train: Path) -> dict:
    """HF: classify SST-2 (the [CLS] pooler), dev accuracy."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    def rows(path: Path, opener=open) -> list[tuple[str, int]]:
        with opener(path, "rt", encoding="utf-8") as f:
            lines = f.read().splitlines()[1:]
        return [(t.strip(), int(y)) for t, y in (line.rsplit("\t", 1) for line in lines)]

    tokenizer = AutoTokenizer.from_pretrained(minilm())
    torch.manual_seed(42)
    model = AutoModelForSequenceClassification.from_pretrained(minilm(), num_labels=2)
    encode = [{**tokenizer(t, truncation=True), "labels": y} for t, y in rows(train)]
    began = time.perf_counter()
    hf_epoch(model, padded_batches(encode, tokenizer))
    seconds = time.perf_counter() - began
    model.eval()
    dev = rows(SHARED_DATA / "sst2/dev.tsv.gz", gzip.open)
    right = 0
    with torch.no_grad():
        for start in range(0, len(dev), 64):
            chunk = dev[start : start + 64]
            inputs = tokenizer([t for t, _ in chunk], padding=True, truncation=True,
                               return_tensors="pt")  # fmt: skip
            guess = model(**inputs).logits.argmax(-1).tolist()
            right += sum(g == y for g, (_, y) in zip(guess, chunk, strict=True))
    return {"metrics": {"accuracy": right / len(dev)}, "train_s": round(seconds, 1)}


def hf_conll(train: Path) -> dict:
    """HF: token classification on CoNLL (first sub-token of each word), test entity F1."""
    from seqeval.metrics import f1_score
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    train_rows = conll_sentences(train)
    test_rows = conll_sentences(SHARED_DATA / "conll2003/test.bio.txt.gz")
    tags = sorted({t for s in train_rows for _, t in s})
    index = {t: i for i, t in enumerate(tags)}
    tokenizer = AutoTokenizer.from_pretrained(minilm())

    def encode(sentence: list[tuple[str, str]]) -> dict:
        enc = tokenizer([w for w, _ in sentence], is_split_into_words=True, truncation=True)
        words, labels, seen = enc.word_ids(), [], set()
        for w in words:
            labels.append(-100 if w is None or w in seen else index.get(sentence[w][1], 0))
            seen.add(w)
        return {**enc, "labels": labels}

    torch.manual_seed(42)
    model = AutoModelForTokenClassification.from_pretrained(minilm(), num_labels=len(tags))
    began = time.perf_counter()
    hf_epoch(model, padded_batches([encode(s) for s in train_rows], tokenizer))
    seconds = time.perf_counter() - began
    model.eval()
    truth, guess = [], []
    with torch.no_grad():
        for sentence in test_rows:
            enc = tokenizer([w for w, _ in sentence], is_split_into_words=True, truncation=True,
                            return_tensors="pt")  # fmt: skip
            best = model(**enc).logits[0].argmax(-1).tolist()
            first = {}
            for position, w in enumerate(enc.word_ids()):
                if w is not None and w not in first:
                    first[w] = tags[best[position]]
            truth.append([t for _, t in sentence])
            guess.append([first.get(i, "O") for i in range(len(sentence))])
    return {"metrics": {"f1": f1_score(truth, guess)}, "train_s": round(seconds, 1)}


def main() -> None:
    """Run the chosen tasks both ways; print a table and one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", default=["sst2", "conll"], choices=["sst2", "conll"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/quick"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(machine(), time.strftime("%Y-%m-%d %H:%M"), file=sys.stderr)
    files = write_subsets(args.out / "data")
    results = {}
    for task in args.only:
        ours = attnlab_run(task, files[task], args.out / task, args.threads)
        theirs = hf_sst2(files[task]) if task == "sst2" else hf_conll(files[task])
        results[task] = {"attnlab": ours, "hf": theirs}
        print(f"| {task} | attnlab {ours['metrics']} ({ours['train_s']} s) | "
              f"HF {theirs['metrics']} ({theirs['train_s']} s) |", file=sys.stderr)  # fmt: skip
        for line in ours["printed"]:
            print("   attnlab:", line, file=sys.stderr)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
