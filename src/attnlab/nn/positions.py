"""Positional information: every scheme behind one small interface.

Self-attention is order-blind, so position must enter somewhere. The schemes differ in *where*:

- added to the token embeddings: ``sinusoidal`` (Vaswani et al. 2017, section 3.5:
  PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...)), ``learned`` (BERT), and
  the two teaching baselines the design notes reject: ``normalized`` (pos / (length - 1) in
  [0, 1], so one position gets a different code in sentences of different length) and
  ``integer`` (1, 2, ..., n, whose magnitude swamps the token embedding in long sentences),
  each a scalar added as (+x, -x, +x, ...) so that a LayerNorm cannot subtract it away;
- added to the attention scores: ``relative_bias`` (T5, Raffel et al. 2020: a learned scalar
  per head and log-spaced distance bucket) and ``alibi`` (Press et al. 2022: -slope_h * |i - j|;
  the paper's decoder sees only j <= i, where this is its -slope_h * (i - j); an encoder gets
  the symmetric form its authors suggest for bidirectional models, which tells a key's distance
  but not its side, so ALiBi alone leaves an encoder unable to tell a sentence from its mirror
  image);
- rotating queries and keys: ``rope`` (Su et al. 2021), so q_m . k_n depends on n - m only.
  Dimension i is paired with i + d_head/2 ("rotate half", as GPT-NeoX and HF's Llama), not
  with its neighbour as in the paper's equation (RoFormer): the same rotation with the head's
  dimensions in another order;
- inside each self-attention layer: ``shaw`` (Shaw et al. 2018), learned vectors a^K_ij (and
  a^V_ij) for the clipped offset j - i, added to the keys (and values) a query sees. Each layer
  owns its tables (``RelativePositionRepresentations``, held by
  ``nn/attention.py: RelativeMultiHeadAttention``), so the model-level scheme has no hook.

A model asks each hook once per forward pass; a hook that does not apply returns None.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from attnlab.errors import AttnlabError


class PositionEncoding(nn.Module):
    """Base scheme: no positional information at all (every hook returns None)."""

    def embed(self, positions: Tensor, lengths: Tensor | None = None) -> Tensor | None:
        """Vectors to add to token embeddings: positions (seq,) -> (seq, d_model), or None.

        ``lengths`` (batch,) is the unpadded length of each sequence; only ``normalized`` uses
        it, and then returns (batch, seq, d_model), each sequence's own codes.
        """
        return None

    def attention_bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor | None:
        """Additive score bias (1, heads, q_len, k_len) for these query/key positions, or None."""
        return None

    def rotary(self, positions: Tensor) -> tuple[Tensor, Tensor] | None:
        """(cos, sin), each (seq, d_head), that rotate queries and keys, or None."""
        return None


def sinusoidal_table(n_positions: int, d_model: int) -> Tensor:
    """The paper's fixed table (n_positions, d_model): sin on even dims, cos on odd dims."""
    position = torch.arange(n_positions, dtype=torch.float64).unsqueeze(1)
    inv_freq = torch.pow(10000.0, -torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    table = torch.zeros(n_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq[: d_model // 2])
    return table.float()


def _check_range(positions: Tensor, max_positions: int) -> None:
    if positions.numel() and int(positions.max()) >= max_positions:
        raise AttnlabError(
            f"position {int(positions.max())} is past max_positions ({max_positions}): "
            "truncate the input or build the model with a larger max_positions"
        )


class SinusoidalPositions(PositionEncoding):
    """Fixed sine/cosine codes added to the embeddings (not trained)."""

    def __init__(self, d_model: int, max_positions: int) -> None:
        super().__init__()
        self.max_positions = max_positions
        self.register_buffer("table", sinusoidal_table(max_positions, d_model), persistent=False)

    def embed(self, positions: Tensor, lengths: Tensor | None = None) -> Tensor:
        """The table's rows at these positions: (seq,) -> (seq, d_model)."""
        _check_range(positions, self.max_positions)
        return self.table[positions]


class LearnedPositions(PositionEncoding):
    """One trained vector per absolute position (BERT's position_embeddings)."""

    def __init__(self, d_model: int, max_positions: int) -> None:
        super().__init__()
        self.max_positions = max_positions
        self.weight = nn.Parameter(torch.empty(max_positions, d_model).normal_(std=0.02))

    def embed(self, positions: Tensor, lengths: Tensor | None = None) -> Tensor:
        """The trained vectors at these positions: (seq,) -> (seq, d_model)."""
        _check_range(positions, self.max_positions)
        return self.weight[positions]


def alternating_signs(d_model: int) -> Tensor:
    """(+1, -1, +1, ...) of length d_model, its last entry 0 when d_model is odd: mean exactly 0.

    The teaching baselines add their scalar along this direction, not to every dimension
    alike: LayerNorm subtracts each vector's mean, so a scalar added to every dimension would
    vanish at BERT's embedding LayerNorm (and in pre-LN layers) and the model would see no
    position at all.
    """
    signs = torch.ones(d_model)
    signs[1::2] = -1.0
    if d_model % 2:
        signs[-1] = 0.0
    return signs


class NormalizedPositions(PositionEncoding):
    """Teaching baseline: the scalar pos / (length - 1), added with alternating sign (+x, -x, ...).

    A position's code depends on the sentence's length, so it changes as a decoder's output
    grows: cached decoding, which keeps earlier positions' keys, then differs from recomputing
    them (and neither sees the length that teacher forcing divided by).
    """

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.register_buffer("signs", alternating_signs(d_model), persistent=False)

    def embed(self, positions: Tensor, lengths: Tensor | None = None) -> Tensor:
        """pos / (length - 1) times alternating_signs: (seq,) -> (batch, seq, d_model)."""
        pos = positions.float()
        if lengths is None:
            lengths = torch.full((1,), positions.shape[-1], device=positions.device)
        denom = (lengths.float() - 1).clamp(min=1).unsqueeze(-1)  # (batch, 1)
        value = (pos / denom).clamp(max=1.0)  # (batch, seq)
        return value.to(self.signs.dtype).unsqueeze(-1) * self.signs


class IntegerPositions(PositionEncoding):
    """Teaching baseline: the raw position number 1..n, added with alternating sign (+n, -n, ...)."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.register_buffer("signs", alternating_signs(d_model), persistent=False)

    def embed(self, positions: Tensor, lengths: Tensor | None = None) -> Tensor:
        """(pos + 1) times alternating_signs: (seq,) -> (seq, d_model)."""
        value = positions.float() + 1
        return value.to(self.signs.dtype).unsqueeze(-1) * self.signs


def relative_buckets(
    relative: Tensor, n_buckets: int, max_distance: int, bidirectional: bool
) -> Tensor:
    """T5's bucket of each key-minus-query offset: exact for small offsets, log-spaced up to max_distance."""
    bucket = torch.zeros_like(relative)
    if bidirectional:
        n_buckets //= 2
        bucket = bucket + (relative > 0).long() * n_buckets  # the sign gets its own half
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)  # only the past is visible
    exact = n_buckets // 2
    is_small = distance < exact
    log_ratio = torch.log(distance.float().clamp(min=1) / exact) / math.log(max_distance / exact)
    large = exact + (log_ratio * (n_buckets - exact)).long()
    large = large.clamp(max=n_buckets - 1)
    return bucket + torch.where(is_small, distance, large)


class RelativePositionBias(PositionEncoding):
    """T5 relative position bias: a learned scalar per (head, distance bucket), shared by all layers."""

    def __init__(
        self, n_heads: int, n_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True
    ) -> None:
        super().__init__()
        self.n_buckets, self.max_distance, self.bidirectional = (
            n_buckets,
            max_distance,
            bidirectional,
        )
        self.bias = nn.Embedding(n_buckets, n_heads)
        nn.init.normal_(self.bias.weight, std=0.02)

    def attention_bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        """Each head's learned scalar for the bucket of k - q: (1, heads, q_len, k_len)."""
        relative = k_positions[None, :] - q_positions[:, None]  # (q, k)
        buckets = relative_buckets(relative, self.n_buckets, self.max_distance, self.bidirectional)
        return self.bias(buckets).permute(2, 0, 1).unsqueeze(0)  # (1, heads, q, k)


def alibi_slopes(n_heads: int) -> Tensor:
    """ALiBi's head slopes: the geometric sequence 2^(-8/n), 2^(-16/n), ... (interleaved if n is not a power of 2)."""

    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_heads).is_integer():
        return torch.tensor(power_of_two(n_heads))
    closest = 2 ** math.floor(math.log2(n_heads))
    extra = power_of_two(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(power_of_two(closest) + extra)


class ALiBi(PositionEncoding):
    """Attention with linear biases: score(i, j) -= slope_h * |i - j|; nothing is learned."""

    def __init__(self, n_heads: int) -> None:
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(n_heads), persistent=False)

    def attention_bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        """-slope_h * |i - j| for query i and key j: (1, heads, q_len, k_len)."""
        distance = (k_positions[None, :] - q_positions[:, None]).abs().float()  # (q, k)
        return (-self.slopes[:, None, None] * distance).unsqueeze(0)


class RotaryPositions(PositionEncoding):
    """RoPE: rotate each pair of query/key dims by angle pos * base^(-2i/d_head)."""

    def __init__(self, d_head: int, base: float = 10000.0) -> None:
        super().__init__()
        self.d_head, self.base = d_head, base

    def rotary(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """(cos, sin), each (seq, d_head), of the angles pos * base^(-2i/d_head), in float32.

        The frequencies are made here, in float32, rather than kept in a buffer that
        ``model.to(torch.bfloat16)`` would round (bf16 keeps 3 significant digits, so long
        positions' angles would be off by radians); ``apply_rotary`` casts cos and sin to
        the queries' dtype.
        """
        exponents = torch.arange(0, self.d_head, 2, dtype=torch.float32, device=positions.device)
        inv_freq = self.base ** (-exponents / self.d_head)  # (d_head / 2,)
        angles = positions.float()[:, None] * inv_freq[None, :]  # (seq, d_head / 2)
        angles = torch.cat((angles, angles), dim=-1)  # pairs (i, i + d/2), see rotate_half
        return angles.cos(), angles.sin()


class RelativePositionRepresentations(nn.Module):
    """Shaw et al. 2018, section 3.2: w^K_o (and w^V_o) for each clipped offset o, one layer's.

    a^K_ij = w^K_clip(j - i, k) and a^V_ij = w^V_clip(j - i, k), where clip(x, k) =
    max(-k, min(k, x)): 2k + 1 learned vectors of the head size, shared by the layer's heads
    (section 3.3), so every offset beyond k looks the same as k.
    """

    def __init__(self, d_head: int, max_distance: int, values: bool = True) -> None:
        super().__init__()
        self.max_distance = max_distance  # the paper's clipping distance k
        n_offsets = 2 * max_distance + 1
        self.keys = nn.Parameter(torch.empty(n_offsets, d_head).normal_(std=0.02))  # w^K
        self.values = (
            nn.Parameter(torch.empty(n_offsets, d_head).normal_(std=0.02)) if values else None
        )  # w^V, or None: the paper's ablation with a^K only

    def offsets(self, q_len: int, k_len: int, device: torch.device | None = None) -> Tensor:
        """Row index of each (query, key) pair's table entry: clip(j - i, -k, k) + k, (q_len, k_len).

        Queries are the last ``q_len`` of the ``k_len`` positions, as in cached decoding.
        """
        k_pos = torch.arange(k_len, device=device)
        q_pos = k_pos[k_len - q_len :]
        relative = k_pos[None, :] - q_pos[:, None]  # (q, k): j - i
        return relative.clamp(-self.max_distance, self.max_distance) + self.max_distance

    def forward(
        self, q_len: int, k_len: int, device: torch.device | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """a^K and a^V (or None), each (q_len, k_len, d_head), for these query and key counts."""
        index = self.offsets(q_len, k_len, device)
        a_values = None if self.values is None else self.values[index]
        return self.keys[index], a_values


class ShawPositions(PositionEncoding):
    """Shaw et al. 2018: position enters only inside self-attention, so every model hook is None.

    The learned tables live in each self-attention layer (``nn/attention.py:
    RelativeMultiHeadAttention``, built by the layers when the model passes its config's
    ``shaw_max_distance``).
    """


def build_position_encoding(
    name: str,
    d_model: int,
    n_heads: int,
    max_positions: int,
    bidirectional: bool = True,
    relative_buckets: int = 32,
    relative_max_distance: int = 128,
    rope_base: float = 10000.0,
    d_head: int | None = None,
) -> PositionEncoding:
    """The scheme called name, sized for this model.

    ``d_model`` is the width the additive schemes are added to (ALBERT's embedding width E
    where it differs from the model's); RoPE rotates the attention's heads, of ``d_head``
    (default d_model // n_heads).
    """
    if name == "learned":
        return LearnedPositions(d_model, max_positions)
    if name == "sinusoidal":
        return SinusoidalPositions(d_model, max_positions)
    if name == "normalized":
        return NormalizedPositions(d_model)
    if name == "integer":
        return IntegerPositions(d_model)
    if name == "relative_bias":
        return RelativePositionBias(n_heads, relative_buckets, relative_max_distance, bidirectional)
    if name == "alibi":
        return ALiBi(n_heads)
    if name == "rope":
        return RotaryPositions(d_head or d_model // n_heads, rope_base)
    if name == "shaw":
        return ShawPositions()
    if name == "none":
        return PositionEncoding()
    raise AttnlabError(
        f"unknown position encoding {name!r} (choose from learned, sinusoidal, relative_bias, "
        "shaw, rope, alibi, normalized, integer, none)"
    )
