"""Parallel text for translation: reading sentence pairs, and batches formed by token count.

Vaswani et al. 2017, §5.1: "Sentence pairs were batched together by approximate sequence
length. Each training batch contained a set of sentence pairs containing approximately 25000
source tokens and 25000 target tokens." Here a batch holds as many pairs as fit a budget of
padded tokens, ``n_pairs * max(source length, target length)``, after sorting by length so
little of the budget is padding. §3 / figure 1 ("outputs (shifted right)"): the decoder reads
``<sos> y1 .. y_{m-1} y_m`` and is trained to predict ``y1 .. y_m <eos>``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attnlab.errors import AttnlabError
from attnlab.io import check_input_file, decode_line, text_lines

Batch = dict[str, Any]  # keyword arguments of the model: src_ids, tgt_in, tgt_out


@dataclass
class ParallelText:
    """Aligned source and target sentences; pairs with an empty side were skipped."""

    src: list[str]
    tgt: list[str]
    skipped: int = 0  # pairs dropped because one side (or both) was empty

    def __len__(self) -> int:
        return len(self.src)


def read_text_lines(path: Path) -> list[str]:
    """Lines of a UTF-8 text file (.gz allowed), without line endings; errors name the line."""
    return [line.removesuffix("\n").rstrip("\r") for line in text_lines(check_input_file(path))]


def decode_lines(data: bytes, source: str) -> list[str]:
    """UTF-8 bytes -> lines without line endings; an invalid line's error names source and line."""
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return [decode_line(raw, source, number).rstrip("\r") for number, raw in enumerate(lines, 1)]


def read_parallel(paths: Sequence[str | Path]) -> ParallelText:
    """Sentence pairs from two aligned files (source, target) or one ``src<TAB>tgt`` file."""
    paths = [Path(p) for p in paths]
    if len(paths) == 2:
        src, tgt = read_text_lines(paths[0]), read_text_lines(paths[1])
        if len(src) != len(tgt):
            raise AttnlabError(
                f"source {paths[0]} has {len(src)} lines but target {paths[1]} has {len(tgt)}: "
                "line i of one must be the translation of line i of the other"
            )
    elif len(paths) == 1:
        src, tgt = [], []
        for number, line in enumerate(read_text_lines(paths[0]), 1):
            if not line.strip():
                src.append("")  # a blank line: an empty pair, skipped below like the others
                tgt.append("")
                continue
            parts = line.split("\t")
            if len(parts) != 2:
                raise AttnlabError(
                    f"{paths[0]}, line {number}: expected 'source<TAB>target', found "
                    f"{len(parts) - 1} TABs"
                )
            src.append(parts[0])
            tgt.append(parts[1])
    else:
        raise AttnlabError(
            f"expected a source and a target file, or one TSV file; got {len(paths)} files"
        )
    pairs = ParallelText([], [])
    for s, t in zip(src, tgt, strict=True):
        s, t = s.strip(), t.strip()
        if not s or not t:
            pairs.skipped += 1
            continue
        pairs.src.append(s)
        pairs.tgt.append(t)
    return pairs


@dataclass
class EncodedPairs:
    """Token ids of sentence pairs: sources end with <eos>; targets are bare ``y1 .. y_m``."""

    src: list[list[int]]
    tgt: list[list[int]]
    truncated: int = 0  # pairs cut to fit max_positions

    def __len__(self) -> int:
        return len(self.src)


def encode_source(ids: list[int], eos_id: int, max_positions: int) -> tuple[list[int], bool]:
    """Source ids + <eos>, cut to max_positions; (ids, whether it was cut)."""
    # <eos> closes the source as in the target: the encoder always sees where a sentence ends.
    cut = len(ids) > max_positions - 1
    return [*ids[: max_positions - 1], eos_id], cut


def encode_pairs(tokenizer: Any, pairs: ParallelText, max_positions: int) -> EncodedPairs:
    """Tokenize both sides; sources and targets longer than the model allows are truncated."""
    src = tokenizer.encode_batch(pairs.src)
    tgt = tokenizer.encode_batch(pairs.tgt)
    out = EncodedPairs([], [])
    for s, t in zip(src, tgt, strict=True):
        s, cut = encode_source(s, tokenizer.eos_id, max_positions)
        # The decoder reads <sos> + y (or predicts y + <eos>): m + 1 positions.
        cut = cut or len(t) > max_positions - 1
        out.src.append(s)
        out.tgt.append(t[: max_positions - 1])
        out.truncated += cut
    return out


def pad_batch(sequences: Sequence[list[int]], pad_id: int) -> Tensor:
    """(batch, longest) long tensor, right-padded with pad_id."""
    out = torch.full((len(sequences), max(len(s) for s in sequences)), pad_id, dtype=torch.long)
    for row, seq in enumerate(sequences):
        out[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    return out


def collate(
    src: Sequence[list[int]], tgt: Sequence[list[int]], pad_id: int, sos_id: int, eos_id: int
) -> Batch:
    """Model input of pairs: src_ids, tgt_in = <sos> y (shifted right), tgt_out = y <eos>."""
    return {
        "src_ids": pad_batch(src, pad_id),
        "tgt_in": pad_batch([[sos_id, *t] for t in tgt], pad_id),
        "tgt_out": pad_batch([[*t, eos_id] for t in tgt], pad_id),
    }


class TokenBatches:
    """The translation BatchSource: length-sorted batches of at most max_tokens padded tokens.

    Each epoch: a seeded permutation breaks ties, pairs are sorted by length (stable), cut in
    order into batches whose padded size ``n_pairs * max(len(src), len(tgt) + 1)`` stays
    within ``max_tokens``, and the batch order is shuffled; every pair is in exactly one batch.
    The order depends on (seed, epoch) alone, so a resumed run rebuilds the same epoch and
    skips the batches already read. Under torch.distributed, global step s hands batch
    ``s * W + r`` to rank r (the epoch's last ``< W`` batches are left out, so every rank
    takes the same number of steps). The position is the count of the epoch's batches read,
    every rank's together, not of steps: a run resumed with another number of processes goes
    on from the first batch no process has read. ``shuffle=False`` keeps the sorted order
    (evaluation).

    An optimiser step reads ``grad_accum`` batches on each rank (they may cross into the next
    epoch); each carries ``tgt_normalizer`` = (target tokens of all the step's batches, every
    rank's) / (grad_accum x ranks), so the averaged losses are the mean over the step's tokens.
    """

    def __init__(
        self,
        pairs: EncodedPairs,
        max_tokens: int,
        pad_id: int,
        sos_id: int,
        eos_id: int,
        seed: int = 0,
        shuffle: bool = True,
        grad_accum: int = 1,
    ) -> None:
        if len(pairs) == 0:
            raise AttnlabError("no sentence pairs to train on")
        if grad_accum < 1:
            raise AttnlabError(f"grad_accum must be at least 1, got {grad_accum}")
        self.pairs = pairs
        self.sizes = [max(len(s), len(t) + 1) for s, t in zip(pairs.src, pairs.tgt, strict=True)]
        longest = max(self.sizes)
        if max_tokens < longest:
            raise AttnlabError(
                f"max_tokens {max_tokens} is below the longest sentence pair ({longest} "
                "tokens): raise it or lower the model's max_positions",
                options=("max_tokens",),
            )
        self.max_tokens = max_tokens
        self.pad_id, self.sos_id, self.eos_id = pad_id, sos_id, eos_id
        self.seed, self.shuffle, self.grad_accum = seed, shuffle, grad_accum
        self.targets = [len(t) + 1 for t in pairs.tgt]  # tgt_out's tokens: y <eos>
        self.rank, self.world_size = 0, 1
        # The next batch of the epoch to hand out (to rank 0): batches, not steps, since a step
        # is W batches and a resumed run may have another W.
        self.epoch, self.next_batch = 0, 0
        self._cached: dict[int, list[list[int]]] = {}  # two epochs: a step may cross the end

    # ---- the batches of an epoch ---------------------------------------------------------

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """Pair indices of each batch of an epoch, in the order they are read."""
        if epoch in self._cached:
            return self._cached[epoch]
        # Its own generator: the order depends on (seed, epoch) only, not on dropout's draws.
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        n = len(self.sizes)
        order = torch.randperm(n, generator=generator).tolist() if self.shuffle else range(n)
        order = sorted(order, key=self.sizes.__getitem__)
        batches: list[list[int]] = []
        batch: list[int] = []
        width = 0
        for index in order:
            size = self.sizes[index]
            if batch and (len(batch) + 1) * max(width, size) > self.max_tokens:
                batches.append(batch)
                batch, width = [], 0
            batch.append(index)
            width = max(width, size)
        batches.append(batch)
        if self.shuffle:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=generator)]
        self._cached = {e: b for e, b in self._cached.items() if e == epoch - 1}
        self._cached[epoch] = batches
        return batches

    def batches_per_epoch(self, epoch: int = 0) -> int:
        """Global steps in an epoch (one batch per rank each)."""
        return len(self.epoch_batches(epoch)) // self.world_size

    def collate(self, indices: Sequence[int]) -> Batch:
        """The model input of the pairs at these indices."""
        return collate(
            [self.pairs.src[i] for i in indices],
            [self.pairs.tgt[i] for i in indices],
            self.pad_id,
            self.sos_id,
            self.eos_id,
        )

    # ---- BatchSource ---------------------------------------------------------------------

    def set_rank(self, rank: int, world_size: int) -> None:
        """Read only this rank's batch of each global step."""
        if len(self.epoch_batches(0)) < world_size:
            raise AttnlabError(
                f"the data makes {len(self.epoch_batches(0))} batches per epoch, fewer than the "
                f"{world_size} processes: lower max_tokens",
                options=("max_tokens",),
            )
        self.rank, self.world_size = rank, world_size

    def __iter__(self) -> Iterator[Batch]:
        """This rank's batches from the current position (a step's start), forever."""
        width = self.world_size
        while True:
            reads = self._next_reads(self.grad_accum)
            step = [self.epoch_batches(e)[first : first + width] for e, first in reads]
            tokens = sum(self.targets[p] for batches in step for batch in batches for p in batch)
            normalizer = torch.tensor(tokens / (self.grad_accum * width))
            for (epoch, first), batches in zip(reads, step, strict=True):
                self.epoch, self.next_batch = epoch, first + width  # state_dict(): the next one
                yield {**self.collate(batches[self.rank]), "tgt_normalizer": normalizer}

    def _next_reads(self, count: int) -> list[tuple[int, int]]:
        """(epoch, first batch) of the next `count` reads (one batch per rank each) from here."""
        epoch, first, reads = self.epoch, self.next_batch, []
        while len(reads) < count:
            if first + self.world_size <= len(self.epoch_batches(epoch)):
                reads.append((epoch, first))
                first += self.world_size
            else:  # fewer batches left than ranks: the epoch ends for all of them
                epoch, first = epoch + 1, 0
        return reads

    def state_dict(self) -> dict[str, Any]:
        """The position: the epoch, and how many of its batches all ranks have read."""
        return {"epoch": self.epoch, "next_batch": self.next_batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position given by state_dict()."""
        self.epoch = int(state["epoch"])
        if "next_batch" in state:
            self.next_batch = int(state["next_batch"])
        else:  # an older checkpoint counted steps (of as many processes as now)
            self.next_batch = int(state["batch_index"]) * self.world_size

    def tokens_in(self, batch: Batch) -> int:
        """Target tokens of a batch (<eos> included, padding not): what tokens/s counts."""
        return int((batch["tgt_out"] != self.pad_id).sum())

    def once(self) -> Iterator[Batch]:
        """Every batch of epoch 0 once, in order (for evaluation; no position is kept)."""
        for indices in self.epoch_batches(0):
            yield self.collate(indices)
