"""Translation demo: train a small Transformer on the bundled German -> English sample (~2 minutes).

An ordinary `attnlab translate train` run (the bundled sample's defaults: a 2-layer,
d_model-128 Transformer, joint BPE, label smoothing 0.1, Adam with the inverse-square-root
warm-up, batches of 1024 tokens) followed by beam-search translations of sentences held out
of training and of new combinations of known words. The output directory (runs/demo-translate,
replaced on each demo) is a translation model: `attnlab translate --model runs/demo-translate`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from attnlab.metrics import corpus_bleu
from attnlab.tasks.translate import (
    TranslateOptions,
    load_translation_model,
    read_data,
    train_translation,
    translate_lines,
)

# Not in the sample as such: new combinations of its words and structures.
NEW_SENTENCES = [
    "Die Frau trinkt einen Tee im Garten.",
    "Meine Schwester kauft ein Auto.",
    "Der Hund schläft im Park.",
    "Zwei Männer tanzen am Strand.",
]


def main() -> None:
    """Train, then translate held-out and new sentences."""
    out = Path("runs/demo-translate")
    opts = TranslateOptions(
        out=out,
        steps=int(sys.argv[1]) if len(sys.argv) > 1 else None,  # None: the sample's 400
        average_last=3,  # the paper's checkpoint averaging (it averages the last 5)
        log_every=50,
        overwrite=True,  # the demo's own scratch directory
    )
    print(f"== Training on the bundled German->English sample for {opts.steps} steps")
    start = time.perf_counter()
    summary = train_translation(opts, say=lambda note: print(f"   {note}"))
    print(
        f"   {time.perf_counter() - start:.0f}s; final model = average of the checkpoints of "
        f"steps {summary.get('averaged_steps')}"
    )

    model, tokenizer = load_translation_model(out)
    _, held_out, _ = read_data(opts)  # the same pairs the run held out for validation
    sources, references = held_out.src[:8], held_out.tgt[:8]
    hyps = translate_lines(model, tokenizer, sources, beam=4)
    print("\n== Held-out sentences (never trained on): source / reference / attnlab, beam 4")
    for src, ref, hyp in zip(sources, references, hyps, strict=True):
        print(f"  {src}\n    ref: {ref}\n    out: {hyp}")
    bleu = corpus_bleu(translate_lines(model, tokenizer, held_out.src), held_out.tgt)
    print(f"\n   sacreBLEU on all {len(held_out)} held-out pairs: {bleu['text']}")

    print("\n== New combinations of known words")
    for src, hyp in zip(
        NEW_SENTENCES, translate_lines(model, tokenizer, NEW_SENTENCES), strict=True
    ):
        print(f"  {src}\n    out: {hyp}")
    print(f"\nModel, metrics.jsonl and loss.png in {out}/")


if __name__ == "__main__":
    main()
