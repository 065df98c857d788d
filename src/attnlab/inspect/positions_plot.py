"""Pictures of the positional schemes of ``attnlab.nn.positions`` (the design notes' figures).

Each figure has three panels:
- the additive schemes (sinusoidal, learned, normalized, integer): the table as a heatmap
  (positions x dimensions); the dot product PE(p) . PE(p + k) against the distance k from
  several positions p (sinusoidal: one curve whatever p, a function of the offset alone; raw
  integers and [0, 1] normalisation: curves that depend on p, or on the sentence's length);
  a third panel on what makes each tick (its waves, its length dependence, its growth);
- rope: the rotation angles pos * base^(-2i/d), q_m . k_n against n - m from several m (the
  same curve: it depends on the offset only) and one pair of dimensions turning with position;
- alibi: the bias matrix -slope_h |i - j| of a head, every head's bias against distance, and
  the slopes;
- relative_bias: the bucket of each offset and each head's bias against offset;
- shaw: one self-attention layer's w^K (offset by dimension), the cosine of every pair of
  offsets' w^K, and w^V (without it, |w^K| against offset).
With a model directory the model's own (trained) scheme is drawn.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attnlab.errors import AttnlabError
from attnlab.nn import positions as pe

SCHEMES = (
    "sinusoidal", "learned", "rope", "alibi", "relative_bias", "normalized", "integer", "shaw",
)  # fmt: skip
ADDITIVE = ("sinusoidal", "learned", "normalized", "integer")


@dataclass
class PositionsPlot:
    """What to draw: a scheme at a size, or (model given) the model's own scheme and weights."""

    scheme: str | None = None
    model: str | Path | None = None
    positions: int = 128
    dim: int = 128
    n_heads: int = 8
    layer: int | None = None  # shaw: the self-attention layer whose tables are drawn (default 0)

    def validate(self) -> None:
        """Refuse sizes that cannot be drawn and a scheme attnlab does not have."""
        if self.scheme is None and self.model is None:
            raise AttnlabError("give a scheme or a model to draw", options=("scheme", "model"))
        if self.scheme is not None and self.scheme not in SCHEMES:
            raise AttnlabError(f"scheme must be one of {', '.join(SCHEMES)}", options=("scheme",))
        if not 4 <= self.positions <= 4096:
            raise AttnlabError("positions must be from 4 to 4096", options=("positions",))
        if not 4 <= self.dim <= 4096 or self.dim % 2:
            raise AttnlabError("dim must be even, from 4 to 4096", options=("dim",))
        if self.layer is not None and self.layer < 0:
            raise AttnlabError("layer must be 0 or more", options=("layer",))


def shaw_layers(model: torch.nn.Module) -> list[pe.RelativePositionRepresentations]:
    """Each self-attention layer's Shaw tables, in the model's order (translation: encoder first)."""
    return [m for m in model.modules() if isinstance(m, pe.RelativePositionRepresentations)]


def shaw_tables(encoding: pe.RelativePositionRepresentations) -> tuple[Tensor, Tensor | None]:
    """One layer's w^K and w^V (None without), each (2k + 1, d_head), row o for offset o - k."""
    keys = encoding.keys.detach().float().clone()
    values = None if encoding.values is None else encoding.values.detach().float().clone()
    return keys, values


def offset_cosine(table: Tensor) -> Tensor:
    """Cosine similarity of every pair of rows (offsets' vectors): (rows, rows)."""
    unit = torch.nn.functional.normalize(table.float(), dim=-1)
    return unit @ unit.T


def _shaw_layer(model: torch.nn.Module, path: str | Path, layer: int | None):
    """The chosen layer's RelativePositionRepresentations and a note naming it."""
    layers = shaw_layers(model)
    index = 0 if layer is None else layer
    if index >= len(layers):
        raise AttnlabError(
            f"{path} has {len(layers)} self-attention layers: layer must be from 0 to "
            f"{len(layers) - 1}",
            options=("layer",),
        )
    return layers[index], f"layer {index} of {len(layers)}"


def _model_scheme(
    path: str | Path, layer: int | None = None
) -> tuple[str, torch.nn.Module, int, int, str]:
    """(scheme, encoding, d_model, max_positions, where) of a model directory's token side.

    For shaw the encoding is one layer's tables and ``where`` names that layer.
    """
    from attnlab.inspect.maps import load_attention_model

    model, _ = load_attention_model(path)
    config = model.config
    if config.position_encoding == "shaw":
        encoding, where = _shaw_layer(model, path, layer)
        return "shaw", encoding, config.d_model, config.max_positions, where
    if hasattr(model, "embeddings"):  # BERT
        encoding = model.embeddings.positions
    elif hasattr(model, "src_positions"):  # the translation Transformer: its source side
        encoding = model.src_positions
    else:  # GPT
        encoding = model.positions
    return config.position_encoding, encoding, config.d_model, config.max_positions, ""


def _fresh(request: PositionsPlot) -> tuple[str, torch.nn.Module, int, int, str]:
    """A newly built encoding of the requested scheme and size (no model)."""
    scheme, n = request.scheme, request.positions
    untrained = "untrained (random init): pass a model for a trained one"
    if scheme == "shaw":  # one layer's tables, of the head size, at the config's default k
        from attnlab.config import BertConfig

        d_head = max(1, request.dim // request.n_heads)
        encoding = pe.RelativePositionRepresentations(d_head, BertConfig.shaw_max_distance)
        return scheme, encoding, request.dim, 2 * encoding.max_distance + 1, untrained
    encoding = pe.build_position_encoding(scheme, request.dim, request.n_heads, n)
    note = untrained if scheme in ("learned", "relative_bias") else ""
    return scheme, encoding, request.dim, n, note


def resolve(request: PositionsPlot) -> tuple[str, torch.nn.Module, int, int, str]:
    """The scheme, its encoding module, d_model, positions drawn and a note on its origin.

    For shaw the module is one layer's ``RelativePositionRepresentations`` and the count is
    its 2k + 1 offsets.
    """
    request.validate()
    if request.layer is not None and request.scheme not in (None, "shaw"):
        raise AttnlabError(
            "layer is for shaw only: other schemes have one table for the model", options=("layer",)
        )
    if request.model is None:
        return _fresh(request)
    scheme, encoding, d_model, max_positions, where = _model_scheme(request.model, request.layer)
    if scheme not in SCHEMES:
        raise AttnlabError(f"{request.model} uses position_encoding {scheme!r}: nothing to draw")
    if request.scheme is not None and request.scheme != scheme:
        raise AttnlabError(
            f"{request.model} uses {scheme}, not {request.scheme}: leave scheme out",
            options=("scheme",),
        )
    if scheme == "shaw":
        n_offsets = 2 * encoding.max_distance + 1
        return scheme, encoding, d_model, n_offsets, f"{where}, {Path(request.model).name}"
    if request.layer is not None:
        raise AttnlabError(
            f"{request.model} uses {scheme}, one table for the model: leave layer out",
            options=("layer",),
        )
    return (
        scheme,
        encoding,
        d_model,
        min(request.positions, max_positions),
        Path(request.model).name,
    )


def additive_table(scheme: str, encoding: pe.PositionEncoding, n: int) -> Tensor:
    """(n, d_model) vectors the scheme adds at positions 0..n-1 (normalized: in a sentence of n)."""
    with torch.no_grad():
        table = encoding.embed(torch.arange(n))
    return table.reshape(n, -1).float() if scheme != "normalized" else table[0].float()


def dot_by_distance(table: Tensor, starts: list[int]) -> dict[int, Tensor]:
    """PE(p) . PE(p + k) for k = 0..n-1-p, from each start p."""
    return {p: table[p:] @ table[p] for p in starts}


def _heatmap(ax, values: Tensor, title: str, xlabel: str, ylabel: str, cmap: str = "RdBu_r"):
    limit = float(values.abs().max()) or 1.0
    image = ax.imshow(values.numpy(), aspect="auto", cmap=cmap, vmin=-limit, vmax=limit)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.03)


def _starts(n: int) -> list[int]:
    return sorted({0, n // 8, n // 4, n // 2})


def _draw_additive(axes, scheme: str, encoding: pe.PositionEncoding, n: int) -> None:
    table = additive_table(scheme, encoding, n)
    _heatmap(axes[0], table, f"{scheme}: the table PE(pos, i)", "dimension i", "position")
    for p, dots in dot_by_distance(table, _starts(n)).items():
        axes[1].plot(range(len(dots)), dots.numpy(), label=f"from p = {p}")
    axes[1].set(title="PE(p) . PE(p + k)", xlabel="distance k", ylabel="dot product")
    axes[1].legend(fontsize=8)
    ax = axes[2]
    if scheme == "sinusoidal":
        d = table.shape[1]
        for i in sorted({0, 2 * (d // 16), 2 * (d // 8), 2 * (d // 4)}):
            ax.plot(table[:, i].numpy(), label=f"dim {i}")
        ax.set(title="waves: each pair of dims, a lower frequency", xlabel="position")
    elif scheme == "normalized":
        for length in (8, n // 2, n):
            codes = encoding.embed(torch.arange(length), torch.tensor([length]))[0, :, 0]
            ax.plot(range(length), codes.numpy(), marker=".", label=f"sentence of {length}")
        ax.set(title="pos / (length - 1): position 5 has no one code", xlabel="position")
    elif scheme == "integer":
        norm = table.norm(dim=-1)
        ax.plot(norm.numpy(), label="|PE(pos)|")
        ax.axhline(float(torch.randn(4096, table.shape[1]).norm(dim=-1).mean()), color="gray",
                   linestyle="--", label="|token embedding| ~ N(0, 1) entries")  # fmt: skip
        ax.set(title="raw integers grow without bound", xlabel="position", ylabel="norm")
    else:
        cosine = torch.nn.functional.normalize(table, dim=-1)
        _heatmap(axes[2], cosine @ cosine.T, "cosine of positions", "position", "position")
        return
    ax.legend(fontsize=8)


def _draw_rope(axes, encoding: pe.RotaryPositions, n: int) -> None:
    cos, sin = encoding.rotary(torch.arange(n))
    half = encoding.d_head // 2
    _heatmap(axes[0], cos[:, :half], "rope: cos(pos * base^(-2i/d))", "pair i", "position")
    torch.manual_seed(0)
    q, k = torch.randn(encoding.d_head), torch.randn(encoding.d_head)
    from attnlab.nn.attention import rotate_half

    rotated_q = q * cos + rotate_half(q) * sin  # (n, d_head): q at every position
    rotated_k = k * cos + rotate_half(k) * sin
    for m in _starts(n):
        scores = rotated_k[m:] @ rotated_q[m]
        axes[1].plot(range(len(scores)), scores.numpy(), label=f"from m = {m}")
    axes[1].set(title="q_m . k_n: a function of n - m only", xlabel="offset n - m",
                ylabel="score")  # fmt: skip
    axes[1].legend(fontsize=8)
    pair = (0, half)
    for i, steps in ((0, min(n, 24)), (half // 4, n)):
        points = rotated_q[:steps][:, [pair[0] + i, pair[1] + i]]
        axes[2].plot(points[:, 0].numpy(), points[:, 1].numpy(), marker=".", label=f"pair {i}")
    axes[2].set(title="one query's pairs turning with position", aspect="equal")
    axes[2].legend(fontsize=8)


def _draw_bias(axes, scheme: str, encoding: pe.PositionEncoding, n: int) -> None:
    positions = torch.arange(n)
    with torch.no_grad():
        bias = encoding.attention_bias(positions, positions)[0].float()  # (heads, n, n)
    _heatmap(axes[0], bias[0], f"{scheme}: bias of head 0", "key j", "query i", cmap="viridis")
    middle = n // 2
    for h in range(bias.shape[0]):
        axes[1].plot(range(-middle, n - middle), bias[h, middle].numpy(), label=f"head {h}")
    axes[1].set(title=f"bias against offset j - i (i = {middle})", xlabel="j - i", ylabel="bias")
    axes[1].legend(fontsize=6, ncol=2)
    if scheme == "alibi":
        axes[2].bar(range(len(encoding.slopes)), encoding.slopes.numpy())
        axes[2].set(title="slopes 2^(-8h/H)", xlabel="head", ylabel="slope")
    else:
        offsets = torch.arange(-n + 1, n)
        buckets = pe.relative_buckets(offsets, encoding.n_buckets, encoding.max_distance,
                                      encoding.bidirectional)  # fmt: skip
        axes[2].plot(offsets.numpy(), buckets.numpy(), drawstyle="steps-mid")
        axes[2].set(title="T5 bucket of each offset (log-spaced)", xlabel="j - i", ylabel="bucket")


def _offset_ticks(ax, k: int, axes: str) -> None:
    """Label rows/columns 0..2k of a Shaw table with their offsets -k..k."""
    rows = sorted({0, k // 2, k, k + k // 2, 2 * k})
    labels = [str(row - k) for row in rows]
    if "x" in axes:
        ax.set_xticks(rows, labels)
    if "y" in axes:
        ax.set_yticks(rows, labels)


def _draw_shaw(axes, encoding: pe.RelativePositionRepresentations) -> None:
    keys, values = shaw_tables(encoding)
    k = encoding.max_distance
    offset = f"offset j - i (clipped to ±{k})"
    _heatmap(axes[0], keys, "shaw: w^K of each offset", "dimension of the head", offset)
    _offset_ticks(axes[0], k, "y")
    _heatmap(axes[1], offset_cosine(keys), "cosine of the offsets' w^K", "offset", "offset")
    _offset_ticks(axes[1], k, "xy")
    if values is not None:
        _heatmap(axes[2], values, "shaw: w^V of each offset", "dimension of the head", offset)
        _offset_ticks(axes[2], k, "y")
    else:  # the paper's ablation with a^K only
        axes[2].plot(range(-k, k + 1), keys.norm(dim=-1).numpy(), marker=".")
        axes[2].set(title="|w^K| by offset (no w^V: shaw_values off)", xlabel=offset,
                    ylabel="norm")  # fmt: skip


def plot_positions(request: PositionsPlot, out: Path) -> dict[str, Any]:
    """Draw the scheme's three panels into the PNG out; returns a summary."""
    from attnlab.inspect.heatmap import _figure, _save

    scheme, encoding, d_model, n, note = resolve(request)
    fig, axes = _figure(1, 3, cell=4.6)
    axes = axes[0]
    if scheme in ADDITIVE:
        _draw_additive(axes, scheme, encoding, n)
    elif scheme == "rope":
        _draw_rope(axes, encoding, n)
    elif scheme == "shaw":
        _draw_shaw(axes, encoding)
    else:
        _draw_bias(axes, scheme, encoding, n)
    if scheme == "shaw":
        k = encoding.max_distance
        size = f"k = {k}, d_head {encoding.keys.shape[1]}, d_model {d_model}"
        shape = {"offsets": n, "max_distance": k, "values": encoding.values is not None}
    else:
        size, shape = f"{n} positions, d_model {d_model}", {"positions": n}
    fig.suptitle(f"{scheme} positions ({size})" + (f": {note}" if note else ""))
    _save(fig, out)
    return {"output": str(out), "scheme": scheme, **shape, "d_model": d_model,
            "panels": [ax.get_title() for ax in axes]}  # fmt: skip
