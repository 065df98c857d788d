"""The key/value cache of incremental decoding, and its beam-search bookkeeping.

A decoding step feeds the decoder only the newest token; each self-attention layer appends
that position's keys and values to its buffer and attends to all of them, and each
cross-attention layer projects the encoder output once, at the first step. ``KVCache`` is
what ``attnlab.nn.attention.Cache`` asks for (``length``, ``update``, ``cross``,
``set_cross``), plus the row moves beam search needs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.errors import AttnlabError


class KVBuffer:
    """Self-attention keys and values (batch, heads, seq, d_head) of the positions decoded so far.

    Kept with room to grow: a step writes its new positions into spare capacity instead of
    concatenating (which copies the whole cache), and a beam reorder copies the filled
    positions into a second buffer kept for that; so a step copies the cache at most once, into
    memory already touched. Beam search copies less still: ``copy_entries`` rewrites in place
    only some positions of the rows of beams that died (``KVCache.copy_rows``).

    Stored position-major, (capacity, batch, heads, d_head), and read through a permuted view:
    the filled positions are then one compact block, where a (batch, heads, capacity, d_head)
    layout would scatter them over the whole capacity, a short run per batch row and head.
    """

    def __init__(self) -> None:
        self.length = 0
        self._kv: tuple[Tensor, Tensor] | None = None  # (capacity, batch, heads, d_head) each
        self._spare: tuple[Tensor, Tensor] | None = None  # where the next reorder writes

    def _filled(self) -> tuple[Tensor, Tensor]:
        # (length, batch, heads, d_head): the storage's filled positions
        if self._kv is None:
            raise AttnlabError("the key/value buffer is empty")
        return self._kv[0][: self.length], self._kv[1][: self.length]

    @property
    def kv(self) -> tuple[Tensor, Tensor]:
        """(keys, values) of the filled positions: views (batch, heads, length, d_head)."""
        k, v = self._filled()
        return k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add the new positions' keys and values; returns all of them (see kv)."""
        end = self.length + k.shape[2]
        if self._kv is None or end > self._kv[0].shape[0]:
            b, h, _, d = k.shape
            grown = tuple(x.new_empty(max(2 * end, 16), b, h, d) for x in (k, v))
            if self._kv is not None:
                for old, buffer in zip(self._filled(), grown, strict=True):
                    buffer[: self.length] = old
            self._kv, self._spare = grown, None
        for new, buffer in zip((k, v), self._kv, strict=True):
            buffer[self.length : end] = new.permute(2, 0, 1, 3)
        self.length = end
        return self.kv

    def select_rows(self, rows: Tensor) -> None:
        """Keep/duplicate batch rows by index (beam reordering; finished sentences leaving)."""
        if self._kv is None:
            return
        capacity, _, h, d = self._kv[0].shape
        shape = (capacity, rows.shape[0], h, d)
        if self._spare is None or self._spare[0].shape != shape:
            self._spare = tuple(x.new_empty(shape) for x in self._kv)
        for old, target in zip(self._filled(), self._spare, strict=True):
            torch.index_select(old, 1, rows, out=target[: self.length])
        same_rows = shape[1] == self._kv[0].shape[1]
        self._kv, self._spare = self._spare, (self._kv if same_rows else None)

    @property
    def batch_size(self) -> int:
        """Rows held (0 while empty)."""
        return 0 if self._kv is None else self._kv[0].shape[1]

    def copy_entries(self, dst: Tensor, src: Tensor) -> None:
        """Overwrite entries dst with entries src in place (all sources read before any write).

        An entry is one position of one row, all heads: entry ``position * batch + row``.
        """
        if self._kv is None or dst.numel() == 0:
            return
        for buffer in self._kv:
            entries = buffer.view(buffer.shape[0] * buffer.shape[1], -1)
            entries.index_copy_(0, dst, entries.index_select(0, src))


class HeadMajorKVBuffer:
    """KVBuffer's keys and values stored head-major, (batch, heads, capacity, d_head): for sampling.

    Each head's positions are one contiguous run, which is how attention reads them: a sampling
    step reads every cached key and value of every row once, and once the cache outgrows the
    processor's caches, contiguous runs read faster than the position-major layout's short
    strided ones (bench/RESULTS.md). Sampling never reorders beams, which is what KVBuffer's
    layout is for. The same methods as KVBuffer, with the same results.
    """

    def __init__(self) -> None:
        self.length = 0
        self._kv: tuple[Tensor, Tensor] | None = None  # (batch, heads, capacity, d_head) each

    @property
    def kv(self) -> tuple[Tensor, Tensor]:
        """(keys, values) of the filled positions: views (batch, heads, length, d_head)."""
        if self._kv is None:
            raise AttnlabError("the key/value buffer is empty")
        return self._kv[0][:, :, : self.length], self._kv[1][:, :, : self.length]

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add the new positions' keys and values; returns all of them (see kv)."""
        end = self.length + k.shape[2]
        if self._kv is None or end > self._kv[0].shape[2]:
            b, h, _, d = k.shape
            grown = tuple(x.new_empty(b, h, max(2 * end, 16), d) for x in (k, v))
            if self._kv is not None:
                for old, buffer in zip(self.kv, grown, strict=True):
                    buffer[:, :, : self.length] = old
            self._kv = grown
        for new, buffer in zip((k, v), self._kv, strict=True):
            buffer[:, :, self.length : end] = new
        self.length = end
        return self.kv

    def select_rows(self, rows: Tensor) -> None:
        """Keep/duplicate batch rows by index."""
        if self._kv is not None:
            self._kv = (self._kv[0].index_select(0, rows), self._kv[1].index_select(0, rows))

    @property
    def batch_size(self) -> int:
        """Rows held (0 while empty)."""
        return 0 if self._kv is None else self._kv[0].shape[0]

    def copy_entries(self, dst: Tensor, src: Tensor) -> None:
        """As KVBuffer.copy_entries: entry ``position * batch + row`` is one position of one row."""
        if self._kv is None or dst.numel() == 0:
            return
        rows = self.batch_size
        for buffer in self._kv:  # the right side is read whole before the write
            buffer[dst % rows, :, dst // rows] = buffer[src % rows, :, src // rows]


def _select_rows(kv: tuple[Tensor, Tensor] | None, rows: Tensor) -> tuple[Tensor, Tensor] | None:
    return None if kv is None else (kv[0].index_select(0, rows), kv[1].index_select(0, rows))


class KVCache:
    """Keys and values of past positions for incremental decoding, one slot per layer.

    ``self_kv[layer]`` grows by the new positions at every step; ``cross_kv[layer]`` (the
    encoder output projected to keys and values) is computed once per source and reused at
    every step. In beam search it may hold one row per sentence, shared by the sentence's
    beams (consecutive rows of the self-attention slots). Tensors are (batch, heads, seq, d_head).
    """

    def __init__(
        self, n_layers: int, buffer: type[KVBuffer | HeadMajorKVBuffer] = KVBuffer
    ) -> None:
        self.n_layers = n_layers
        self.self_kv = [buffer() for _ in range(n_layers)]
        self.cross_kv: list[tuple[Tensor, Tensor] | None] = [None] * n_layers

    @property
    def length(self) -> int:
        """Number of positions already cached."""
        return self.self_kv[0].length

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append self-attention keys and values of the new positions; returns all positions'."""
        return self.self_kv[layer].append(k, v)

    def cross(self, layer: int) -> tuple[Tensor, Tensor] | None:
        """The cross-attention keys and values of layer, or None before the first step."""
        return self.cross_kv[layer]

    def set_cross(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Keep the cross-attention keys and values of layer for the later steps."""
        # Stored contiguous: per head, the (src, d_head) keys are one block, which every later
        # step's product then reads in place (kv_proj's output interleaves the heads).
        self.cross_kv[layer] = (k.contiguous(), v.contiguous())

    def reorder(self, index: Tensor, cross_index: Tensor | None = None) -> None:
        """Keep/duplicate batch rows: self-attention ones by index, cross-attention ones by cross_index.

        cross_index=None leaves the cross-attention keys/values as they are: in beam search
        they hold one row per sentence, shared by its beams, and change only when sentences
        leave the batch.
        """
        for buffer in self.self_kv:
            buffer.select_rows(index)
        if cross_index is not None:
            self.cross_kv = [_select_rows(kv, cross_index) for kv in self.cross_kv]

    def copy_rows(self, dst: Tensor, src: Tensor, start: Tensor | None = None) -> None:
        """Self-attention rows dst become copies of rows src, in place; the others stay.

        A beam search that keeps each surviving beam in its row moves only the rows whose
        beam died, which costs less than copying every row (reorder). ``start`` (one per
        pair; default 0) copies only positions start[i] onward of each pair: a position's keys
        and values depend only on the tokens up to it, so where two beams' prefixes agree the
        row holds the right ones already. All sources are read before any write.
        """
        if start is None:
            start = torch.zeros_like(dst)
        positions = torch.arange(self.length, device=dst.device)
        pair, pos = (positions >= start.unsqueeze(1)).nonzero().unbind(1)  # what to copy
        if pair.numel() == 0:
            return
        rows = self.self_kv[0].batch_size  # every layer's buffer holds the same rows
        dst_entries, src_entries = pos * rows + dst[pair], pos * rows + src[pair]
        for buffer in self.self_kv:
            buffer.copy_entries(dst_entries, src_entries)
