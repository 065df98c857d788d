"""Writing attention maps: an HTML page, a PNG heatmap or JSON, chosen by the file's suffix."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnlab.errors import AttnlabError
from attnlab.inspect.maps import AttentionMaps, check_indices

SUFFIXES = (".html", ".png", ".json")


@dataclass
class Selection:
    """Which part of the maps to write: layer/head pick one (a PNG heatmap, the page's first
    view); layers/heads filter (None: all); kind picks the attention a PNG shows."""

    layer: int | None = None
    head: int | None = None
    layers: list[int] | None = None
    heads: list[int] | None = None
    kind: str | None = None


def parse_indices(text: str, option: str) -> list[int]:
    """'0,5' or '0-3' or '0-3,7' -> sorted distinct indices."""
    chosen: set[int] = set()
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if match is None:
            raise AttnlabError(
                f"{option} takes numbers and ranges such as 0,5 or 0-3, got {text!r}",
                options=(option,),
            )
        first, last = int(match[1]), int(match[2] or match[1])
        if last < first:
            raise AttnlabError(f"{option}: the range {part.strip()} is empty", options=(option,))
        chosen.update(range(first, last + 1))
    return sorted(chosen)


def check_suffix(out: Path) -> str:
    """The output kind ('.html', '.png' or '.json') of out, or an error naming the choices."""
    suffix = out.suffix.lower()
    if suffix not in SUFFIXES:
        raise AttnlabError(
            f"output {out} must end in .html (the page), .png (a heatmap) or .json, "
            f"not {out.suffix or 'nothing'}",
            options=("output",),
        )
    return suffix


def _check_pick(maps: AttentionMaps, sel: Selection) -> None:
    """Refuse a layer or head the model does not have (named as the option that asked)."""
    kinds = maps.kinds().values()
    n_layers, n_heads = max(w.shape[0] for w in kinds), next(iter(kinds)).shape[1]
    if sel.layer is not None:
        check_indices([sel.layer], n_layers, "layer", "layer")
    if sel.head is not None:
        check_indices([sel.head], n_heads, "head", "head")


def _narrowed(maps: AttentionMaps, sel: Selection) -> AttentionMaps:
    """maps.select() of the layer/head pick (one each) or else the layers/heads filters."""
    layers = [sel.layer] if sel.layer is not None else sel.layers
    heads = [sel.head] if sel.head is not None else sel.heads
    return maps.select(layers, heads)


def _png_kind(maps: AttentionMaps, kind: str | None) -> str:
    kinds = maps.kinds()
    if kind is None:  # a translation model's cross-attention is its word alignment
        return "cross" if "cross" in kinds else next(iter(kinds))
    if kind not in kinds:
        raise AttnlabError(
            f"kind {kind!r} is not among this model's attention ({', '.join(kinds)})",
            options=("kind",),
        )
    return kind


def write_png(maps: AttentionMaps, out: Path, sel: Selection, title: str) -> dict[str, Any]:
    """A heatmap of one head (layer and head given) or a grid of heads, of one kind."""
    from attnlab.inspect.heatmap import grid_heatmap, head_heatmap

    kind = _png_kind(maps, sel.kind)
    chosen = _narrowed(maps, sel)
    weights = chosen.kinds().get(kind)
    if weights is None:
        raise AttnlabError(f"the {kind} attention has no layer {sel.layer}", options=("layer",))
    layers, heads = chosen.layer_labels[kind], chosen.head_labels[kind]
    queries, keys = maps.query_tokens(kind), maps.key_tokens(kind)
    if len(layers) == 1 and len(heads) == 1:
        name = f"{title}: {kind} layer {layers[0]} head {heads[0]}"
        head_heatmap(weights[0, 0], queries, keys, name, out)
    else:
        rows, cols = [f"L{i}" for i in layers], [f"h{j}" for j in heads]
        grid_heatmap(weights, queries, keys, rows, cols, f"{title}: {kind} attention", out)
    return {"kind": kind, "layers": layers, "heads": heads}


def write_attention(
    maps: AttentionMaps, out: Path, sel: Selection, title: str = "attnlab"
) -> dict[str, Any]:
    """Write maps to out (.html page, .png heatmap or .json by suffix); returns a summary.

    title names the model in the page's and the heatmap's titles.
    """
    from attnlab.io import write_text_atomic

    suffix = check_suffix(out)
    _check_pick(maps, sel)
    summary: dict[str, Any] = {"output": str(out), "tokens": len(maps.tokens)}
    if suffix == ".png":
        return summary | write_png(maps, out, sel, title)
    # JSON holds just the layer or head picked; the page holds the filtered set, opening there.
    chosen = _narrowed(maps, sel) if suffix == ".json" else maps.select(sel.layers, sel.heads)
    summary["kinds"] = list(chosen.kinds())
    if suffix == ".json":
        write_text_atomic(out, json.dumps(chosen.to_json(), ensure_ascii=False))
        return summary
    from attnlab.inspect.page import render_page

    html, stats = render_page(chosen, f"{title}: attention", first=_first_view(chosen, sel))
    write_text_atomic(out, html)
    return summary | {"top_k": stats.top_k, "kept_share": round(stats.kept_share, 4)}


def _first_view(maps: AttentionMaps, sel: Selection) -> dict[str, int]:
    """Indices (within what the page holds) of the layer and head the page opens on."""
    first = {}
    for option, wanted, labels in (
        ("layer", sel.layer, next(iter(maps.layer_labels.values()), None)),
        ("head", sel.head, next(iter(maps.head_labels.values()), None)),
    ):
        if wanted is not None and labels is not None:
            if wanted not in labels:
                raise AttnlabError(
                    f"{option} {wanted} is not among the {option}s selected ({labels})",
                    options=(option,),
                )
            first[option] = labels.index(wanted)
    return first
