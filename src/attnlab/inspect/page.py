"""The attention page: one self-contained HTML file (inline CSS and JS, no network) with a
head view and a model view of ``AttentionMaps``, drawn on canvas by ``assets/page.js``.

The weights travel as 8-bit integers (weight * 255, rounded) in base64. Past a size budget each
query row keeps only its strongest keys (the page then says so); the model view's small
heatmaps are mean-pooled from the full weights, so they stay exact at any size.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass
from importlib import resources

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.inspect.maps import AttentionMaps

KIND_TITLES = {
    "encoder": "Encoder self-attention",
    "decoder": "Decoder self-attention (masked)",
    "cross": "Decoder-encoder (cross) attention",
}
SINGLE_TITLES = {"encoder": "Self-attention", "decoder": "Causal self-attention"}  # BERT, GPT
BYTE_BUDGET = 12_000_000  # weight bytes in one page before rows keep only their top keys
THUMB_SIZE = 64  # the model view's heatmaps hold at most this many rows and columns


@dataclass
class PageStats:
    """What render_page put in the page: kept keys per row (None: all) and their weight share."""

    top_k: int | None
    kept_share: float  # mean over rows of the weight the stored keys hold (1.0 when dense)


def _b64(tensor: Tensor) -> str:
    return base64.b64encode(tensor.contiguous().numpy().tobytes()).decode("ascii")


def _quantise(weights: Tensor) -> Tensor:
    """Weights in [0, 1] -> uint8 steps of 1/255."""
    return (weights.clamp(0, 1) * 255).round().to(torch.uint8)


def _thumbnails(weights: Tensor) -> tuple[Tensor, int, int]:
    """(layers, heads, q, k) -> mean-pooled (layers, heads, tq, tk) uint8 with tq, tk <= THUMB_SIZE."""
    layers, heads, q, k = weights.shape
    tq, tk = min(q, THUMB_SIZE), min(k, THUMB_SIZE)
    flat = weights.reshape(layers * heads, 1, q, k).float()
    pooled = F.adaptive_avg_pool2d(flat, (tq, tk))
    # Each cell shows its mean weight relative to a uniform row (1/k), capped at 1, so that a
    # head's pattern is visible whatever the sequence length.
    scaled = (pooled * k / max(1, min(k, 8))).clamp(0, 1)
    return _quantise(scaled.reshape(layers, heads, tq, tk)), tq, tk


def _top_k(n_rows: int) -> int:
    """Keys kept per row so that rows * k * 3 bytes (uint16 index + uint8 weight) fit the budget."""
    return max(1, BYTE_BUDGET // (3 * n_rows))


def _kind_data(
    name: str, title: str, maps: AttentionMaps, weights: Tensor, top_k: int | None
) -> tuple[dict, float]:
    """One kind's entry of the page data, and the mean weight share its stored keys hold."""
    layers, heads = weights.shape[:2]
    thumbs, tq, tk = _thumbnails(weights)
    entry = {
        "name": name,
        "title": title,
        "queries": maps.query_tokens(name),
        "keys": maps.key_tokens(name),
        "layers": maps.layer_labels.get(name, list(range(layers))),
        "heads": maps.head_labels.get(name, list(range(heads))),
        "thumb": _b64(thumbs),
        "thumbQ": tq,
        "thumbK": tk,
        "dense": None,
    }
    if top_k is None or top_k >= weights.shape[-1]:
        entry["dense"] = _b64(_quantise(weights))
        return entry, 1.0
    values, index = weights.topk(top_k, dim=-1)  # (layers, heads, q, top_k)
    entry.update(topk=top_k, index=_b64(index.to(torch.int32).to(torch.int16).view(torch.uint8)),
                 value=_b64(_quantise(values)))  # fmt: skip
    return entry, float(values.sum(-1).mean())


def page_data(maps: AttentionMaps) -> tuple[dict, PageStats]:
    """The JSON the page script reads: per kind its tokens, labels and weights, plus notes."""
    kinds = maps.kinds()
    cells = sum(w.numel() for w in kinds.values())
    rows = sum(w.shape[:-1].numel() for w in kinds.values())
    top_k = None if cells <= BYTE_BUDGET else _top_k(rows)
    entries, shares = [], []
    for name, weights in kinds.items():
        title = KIND_TITLES[name] if len(kinds) > 1 else SINGLE_TITLES[name]
        entry, share = _kind_data(name, title, maps, weights, top_k)
        entries.append(entry)
        shares.append(share)
    kept = min(shares)
    notes = [
        "Weights are stored as 8-bit integers (steps of 1/255); lines under 0.01 are not drawn.",
        "Model view cells are mean-pooled to at most 64 x 64 and shown against a uniform row.",
    ]
    warnings = []
    if top_k is not None:
        warnings.append(
            f"Down-sampled to fit the page: each query row keeps its {top_k} strongest keys "
            f"(holding {kept:.1%} of its weight on average); the model view is exact. "
            "Select fewer layers or heads for every weight."
        )
    warnings.extend(maps.notes)
    data = {"kinds": entries, "notes": notes, "warnings": warnings}
    return data, PageStats(top_k, kept)


def _asset(name: str) -> str:
    return resources.files("attnlab.inspect").joinpath("assets", name).read_text(encoding="utf-8")


def _escape_html(text: str) -> str:
    return (
        text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
    )


def render_page(
    maps: AttentionMaps, title: str = "attnlab attention", first: dict[str, int] | None = None
) -> tuple[str, PageStats]:
    """The self-contained HTML page of maps (and what it stores).

    first: {"layer": i, "head": j}, indices into the layers and heads the maps hold, that the
    head view opens on (the page's address can choose others: #layer=2&head=3).
    """
    data, stats = page_data(maps)
    data["first"] = first or {}
    # Inside <script>, "<" is escaped so no token can close the element ("</script>").
    payload = json.dumps(data, ensure_ascii=False).replace("<", "\\u003c")
    parts = {
        "__TITLE__": _escape_html(title),
        "__CSS__": _asset("page.css"),
        "__JS__": _asset("page.js"),
        "__DATA__": payload,
    }
    # One pass: text put in (tokens, the script) is never searched for placeholders again.
    html = re.sub("__(TITLE|CSS|JS|DATA)__", lambda m: parts[m.group(0)], _asset("page.html"))
    return html, stats
