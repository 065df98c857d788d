"""Contextual embeddings (the design notes' 苹果 in 吃苹果 / 苹果手机, "bank" in river bank /
bank loan): the same word in two contexts, the cosine of its two vectors after each layer.

A static embedding gives one vector per word whatever its context; BERT's layers mix in the
context, so the cosine falls from near 1 at the embeddings (only the positions differ) as the
layers go up. A word of several sub-tokens is the mean of their vectors.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.errors import AttnlabError

# The notes' examples: a Chinese character pair and an English homonym.
DEFAULT_EXAMPLES = (
    ("苹果", "我喜欢吃苹果。", "我买了一部苹果手机。"),
    ("bank", "We sat on the river bank.", "I took a loan from the bank."),
)


@dataclass
class ContextPair:
    """One word in two contexts and its cosine after the embeddings and each layer."""

    word: str
    contexts: tuple[str, str]
    cosines: list[float]  # n_layers + 1: the embeddings' output, then each layer's


def _span(tokens: list[str], piece: list[str], word: str, context: str) -> slice:
    """Where the word's tokens first stand in a context's tokens."""
    for start in range(len(tokens) - len(piece) + 1):
        if tokens[start : start + len(piece)] == piece:
            return slice(start, start + len(piece))
    raise AttnlabError(f"{word!r} is not among the tokens of {context!r} ({' '.join(tokens)})")


def word_vectors(bert: nn.Module, tokenizer: Any, word: str, context: str) -> Tensor:
    """(n_layers + 1, d_model): the mean of the word's token vectors after each layer."""
    piece = tokenizer.tokenize(word)
    if not piece:
        raise AttnlabError(f"{word!r} has no tokens")
    if "[UNK]" in piece:
        raise AttnlabError(f"the model's vocabulary lacks part of {word!r}: it reads as [UNK]")
    encoding = tokenizer.encode(context, max_length=bert.config.max_positions)
    tokens = tokenizer.convert_ids_to_tokens(encoding.ids)
    span = _span(tokens, piece, word, context)
    with torch.inference_mode():
        out = bert(torch.tensor([encoding.ids]), output_hidden_states=True)
    return torch.stack([h[0, span].mean(0) for h in out.hidden_states]).float()


def contextual_similarity(
    model: nn.Module, tokenizer: Any, word: str, context_a: str, context_b: str
) -> ContextPair:
    """The cosine of word's vectors in the two contexts, after the embeddings and each layer."""
    from attnlab.inspect.maps import _bert_of

    bert = _bert_of(model)
    if bert is None:
        raise AttnlabError(f"{type(model).__name__} is not a BERT model: contextual needs one")
    bert.eval()
    a = word_vectors(bert, tokenizer, word, context_a)
    b = word_vectors(bert, tokenizer, word, context_b)
    return ContextPair(word, (context_a, context_b), F.cosine_similarity(a, b, dim=-1).tolist())


def plot_contextual(pairs: list[ContextPair], title: str, out: Path) -> None:
    """One line per word: cosine against layer (0 = the embeddings)."""
    from attnlab.inspect.heatmap import _figure, _save

    fig, axes = _figure(1, 1, cell=5.0)
    ax = axes[0][0]
    for pair in pairs:
        label = f"{pair.word}: {pair.contexts[0]} / {pair.contexts[1]}"
        ax.plot(range(len(pair.cosines)), pair.cosines, marker="o", label=label)
    ax.set(title=title, xlabel="layer (0 = embeddings)", ylabel="cosine of the two vectors")
    ax.set_ylim(min(0.0, *(min(p.cosines) for p in pairs)), 1.02)
    ax.legend(fontsize=7, loc="lower left")
    _save(fig, out)


def contextual_plot(
    model_dir: str | Path, examples: list[tuple[str, str, str]] | None, out: Path
) -> dict[str, Any]:
    """Load a BERT, measure each (word, context A, context B), draw them; returns a summary.

    Without examples, the notes' two; one whose word the vocabulary lacks is skipped then
    (an English model has no 苹), and named in the summary.
    """
    from attnlab.inspect.maps import load_attention_model

    model, tokenizer = load_attention_model(model_dir)
    chosen = examples or list(DEFAULT_EXAMPLES)
    pairs, skipped = [], []
    for word, context_a, context_b in chosen:
        try:
            pairs.append(contextual_similarity(model, tokenizer, word, context_a, context_b))
        except AttnlabError as err:
            if examples:
                raise
            skipped.append(f"{word}: {err}")
    if not pairs:
        raise AttnlabError("no example could be measured: " + "; ".join(skipped))
    plot_contextual(pairs, f"{Path(model_dir).name}: one word, two contexts", out)
    return {
        "output": str(out),
        "cosines": {p.word: [round(c, 4) for c in p.cosines] for p in pairs},
        "skipped": skipped,
    }
