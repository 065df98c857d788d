"""Language-model demo: a character-level GPT (`gpt-char`) trained for 2 minutes on bundled text.

An ordinary `attnlab lm train` run on the bundled pretraining sample (everyday Chinese and
English), its last 10% held out: samples from the untrained model first (random characters),
then from the trained one, with the held-out loss and perplexity = exp(loss). The output
directory (runs/demo-lm, replaced on each demo) is a GPT model folder:
`attnlab generate --model runs/demo-lm "今天"`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from attnlab.tasks.lm import GPT, LMOptions, generate_texts, load_lm, model_config, train_lm
from attnlab.tasks.pretrain import bundled_corpus
from attnlab.text.lm_tokenizer import train_char

PROMPTS = ["今天", "The "]


def show(title: str, model: GPT, tokenizer) -> None:
    """Print one sampled continuation of each prompt."""
    print(f"\n== {title}")
    samples = generate_texts(model, tokenizer, PROMPTS, max_new_tokens=60, temperature=0.8,
                             top_k=20, seed=0)  # fmt: skip
    for prompt, completion in samples:
        print(f"  {prompt}|{completion}".replace("\n", " / "))


def main() -> None:
    """Sample, train for the given minutes (default 2), sample again."""
    minutes = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    out = Path("runs/demo-lm")
    opts = LMOptions(out=out, corpus=[bundled_corpus()], max_minutes=minutes, seq_len=64,
                     batch_size=16, eval_every=100, log_every=20, overwrite=True)  # fmt: skip
    tokenizer = train_char(opts.corpus)
    torch.manual_seed(0)
    show(
        "Untrained gpt-char (random weights)", GPT(model_config(opts, tokenizer)).eval(), tokenizer
    )

    print(f"\n== Training gpt-char on {opts.corpus[0].name} for {minutes:g} minutes")
    start = time.perf_counter()
    summary = train_lm(opts, say=lambda note: print(f"   {note}"))
    held_out = summary["eval"]
    print(f"   {time.perf_counter() - start:.0f}s, {summary['step']} steps; held-out loss "
          f"{held_out['valid_loss']:.3f} nats/char, perplexity {held_out['valid_ppl']:.1f}")  # fmt: skip

    model, tokenizer = load_lm(out)
    show("Trained gpt-char", model, tokenizer)
    print(f"\n   try: attnlab generate --model {out} '今天' --max-new-tokens 100")


if __name__ == "__main__":
    main()
