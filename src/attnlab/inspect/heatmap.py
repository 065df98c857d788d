"""Attention heatmaps with matplotlib: softmax(QK^T / sqrt(d_k)) of one head as an image,
queries down the rows and keys along the columns, tokens on both axes; or a grid of heads.

Chinese, Japanese and Korean tokens need a font with their glyphs: ``cjk_font`` finds one
among the system fonts (Debian's fonts-noto-cjk, installed by the Makefile) and registers it
with matplotlib, which falls back to it glyph by glyph.
"""

from __future__ import annotations

import math
from pathlib import Path

from torch import Tensor

from attnlab.errors import AttnlabError

# Font families known to hold CJK glyphs, best first; file names to look for when matplotlib's
# font cache predates their installation.
CJK_FAMILIES = (
    "Noto Sans CJK SC", "Noto Sans CJK JP", "Noto Sans CJK TC", "Noto Sans CJK KR",
    "Source Han Sans SC", "Source Han Sans CN", "WenQuanYi Zen Hei", "WenQuanYi Micro Hei",
    "Droid Sans Fallback", "Microsoft YaHei", "SimHei", "PingFang SC", "Hiragino Sans GB",
    "Arial Unicode MS",
)  # fmt: skip
CJK_FILE_HINTS = ("cjk", "sourcehansans", "wqy", "droidsansfallback", "msyh", "simhei", "pingfang")
MAX_TICK_LABELS = 64  # past this many tokens an axis labels every n-th one


def cjk_font() -> str | None:
    """The name of a font family with CJK glyphs known to matplotlib, or None when none is installed."""
    from matplotlib import font_manager

    def known() -> str | None:
        names = {font.name for font in font_manager.fontManager.ttflist}
        return next((family for family in CJK_FAMILIES if family in names), None)

    found = known()
    if found is None:
        for path in font_manager.findSystemFonts():
            if any(hint in Path(path).name.lower() for hint in CJK_FILE_HINTS):
                try:
                    font_manager.fontManager.addfont(path)
                except (OSError, RuntimeError, ValueError):
                    continue  # an unreadable font file: try the others
        found = known()
    return found


def font_families() -> list[str]:
    """matplotlib's font.family list: its default sans-serif, then a CJK font for the glyphs it lacks."""
    cjk = cjk_font()
    return ["DejaVu Sans", cjk] if cjk else ["DejaVu Sans"]


def _ticks(ax, tokens: list[str], axis: str, fontsize: float) -> None:
    step = max(1, math.ceil(len(tokens) / MAX_TICK_LABELS))
    positions = list(range(0, len(tokens), step))
    labels = [tokens[i] for i in positions]
    if axis == "x":
        ax.set_xticks(positions, labels, rotation=90, fontsize=fontsize)
    else:
        ax.set_yticks(positions, labels, fontsize=fontsize)


def _label_size(n_tokens: int) -> float:
    return max(4.0, min(10.0, 400.0 / max(1, n_tokens)))


def _figure(rows: int, cols: int, cell: float):
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    plt.rcParams["font.family"] = font_families()
    return plt.subplots(rows, cols, figsize=(cols * cell + 1.5, rows * cell + 1.0), squeeze=False)


def head_heatmap(
    weights: Tensor, queries: list[str], keys: list[str], title: str, out: Path
) -> None:
    """One head's weights (queries, keys) as a PNG heatmap with the tokens on both axes."""
    n = max(len(queries), len(keys))
    fig, axes = _figure(1, 1, cell=max(4.0, min(16.0, 0.22 * n + 2)))
    ax = axes[0][0]
    image = ax.imshow(weights.numpy(), cmap="Blues", vmin=0, vmax=1, aspect="auto")
    size = _label_size(n)
    _ticks(ax, keys, "x", size)
    _ticks(ax, queries, "y", size)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query (attending)")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, fraction=0.04, pad=0.02, label="attention weight")
    _save(fig, out)


def grid_heatmap(
    weights: Tensor,
    queries: list[str],
    keys: list[str],
    row_labels: list[str],
    col_labels: list[str],
    title: str,
    out: Path,
) -> None:
    """(rows, cols, queries, keys) weights as a grid of heatmaps; tokens on the outer axes only.

    A layer's heads come as one row; with many rows (every layer) the tokens are left out.
    """
    rows, cols = weights.shape[:2]
    if rows == 1 and cols > 4:  # one layer's heads: wrap into a near-square grid
        wrap = math.ceil(math.sqrt(cols))
        cells = [(0, j) for j in range(cols)]
        rows, cols = math.ceil(len(cells) / wrap), wrap
        labels = [f"{row_labels[0]} {col_labels[j]}" for j in range(len(cells))]
    else:
        cells = [(i, j) for i in range(rows) for j in range(cols)]
        labels = [f"{row_labels[i]} {col_labels[j]}" for i, j in cells]
    show_tokens = rows * cols <= 32 and max(len(queries), len(keys)) <= 80
    fig, axes = _figure(rows, cols, cell=3.2 if show_tokens else 1.6)
    size = _label_size(max(len(queries), len(keys))) * 0.7
    for index, ax in enumerate(axes.flat):
        if index >= len(cells):
            ax.axis("off")
            continue
        ax.imshow(weights[cells[index]].numpy(), cmap="Blues", vmin=0, vmax=1, aspect="auto")
        ax.set_title(labels[index], fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
        if show_tokens and index + cols >= len(cells):  # the bottom cell of its column
            _ticks(ax, keys, "x", size)
        if show_tokens and index % cols == 0:
            _ticks(ax, queries, "y", size)
    fig.suptitle(title)
    _save(fig, out)


def _save(fig, out: Path) -> None:
    import matplotlib.pyplot as plt

    from attnlab.io import write_with_atomic

    try:
        fig.tight_layout()
        write_with_atomic(out, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    except ValueError as err:  # matplotlib refuses an image too large to draw
        raise AttnlabError(f"cannot draw {out}: {err}") from None
    finally:
        plt.close(fig)
