"""Batches of fine-tuning rows: padded to their own longest, grouped by length when training.

Sentence lengths vary widely (SST-2: 3 to 60+ tokens), so padding to a fixed 128, or to the
longest of a random batch, would spend most FLOPs on [PAD]: training batches hold rows of
near-equal length, drawn at random.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from attnlab.errors import AttnlabError
from attnlab.text import tasks as task_data
from attnlab.train.data import Batch


def collate(rows: Sequence[dict[str, Any]], pad_id: int, targets: bool = True) -> Batch:
    """Pad rows to the longest of them: input_ids, attention_mask, token_type_ids (+ targets)."""
    longest = max(len(row["input_ids"]) for row in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    types = torch.zeros((len(rows), longest), dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        ids[i, :n] = torch.tensor(row["input_ids"])
        types[i, :n] = torch.tensor(row["token_type_ids"])
        mask[i, :n] = 1
    batch: Batch = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
    if not targets:
        return batch
    first = rows[0]
    if "start_positions" in first:  # target distributions: each answer an equal share
        for key in ("start_positions", "end_positions"):
            shares = torch.zeros((len(rows), longest))
            for i, row in enumerate(rows):
                for position in row[key]:
                    shares[i, position] += 1 / len(row[key])
            batch[key] = shares
    elif isinstance(first.get("labels"), list):  # token labels; padding carries no loss
        labels = torch.full((len(rows), longest), task_data.IGNORE_INDEX, dtype=torch.long)
        for i, row in enumerate(rows):
            labels[i, : len(row["labels"])] = torch.tensor(row["labels"])
        batch["labels"] = labels
    elif isinstance(first.get("labels"), float):
        batch["labels"] = torch.tensor([row["labels"] for row in rows], dtype=torch.float)
    elif "labels" in first:
        batch["labels"] = torch.tensor([row["labels"] for row in rows], dtype=torch.long)
    return batch


class LengthGroupedBatches:
    """Shuffled batches of similar-length rows, each padded to its own longest: the BatchSource.

    Per epoch (seeded by seed and epoch only, so resuming reproduces it): a random
    permutation of the rows, cut into chunks of ``chunk_batches`` batches; each chunk is
    sorted by length and cut into batches; then the order of all the epoch's batches is
    shuffled. Batches stay random in content (a chunk is a random sample) but hold rows of
    near-equal length. Like ``TensorBatches``, the last incomplete batch of an epoch is
    dropped (a different random remainder each epoch) and, under torch.distributed, rank r
    reads rows [r*B/W, (r+1)*B/W) of every global batch.
    """

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        batch_size: int,
        pad_id: int,
        seed: int = 0,
        chunk_batches: int = 64,
    ) -> None:
        if not 1 <= batch_size <= len(rows):
            raise AttnlabError(
                f"batch_size {batch_size} must be between 1 and the {len(rows)} training "
                "examples (features)",
                options=("batch_size",),
            )
        self.rows = rows
        self.lengths = torch.tensor([len(row["input_ids"]) for row in rows])
        self.batch_size, self.pad_id = batch_size, pad_id
        self.seed, self.chunk_batches = seed, chunk_batches
        self.rank, self.world_size = 0, 1
        self.epoch, self.batch_index = 0, 0  # the next global batch to hand out

    @property
    def batches_per_epoch(self) -> int:
        """Full global batches in one pass over the rows."""
        return len(self.rows) // self.batch_size

    def set_rank(self, rank: int, world_size: int) -> None:
        """Read only this rank's slice of each global batch."""
        if self.batch_size % world_size:
            raise AttnlabError(
                f"batch_size {self.batch_size} is not divisible by the {world_size} processes",
                options=("batch_size",),
            )
        self.rank, self.world_size = rank, world_size

    def epoch_batches(self, epoch: int) -> list[Tensor]:
        """The row indices of every global batch of an epoch, in the order they are read."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(len(self.rows), generator=generator)
        order = order[: self.batches_per_epoch * self.batch_size]
        chunk = self.chunk_batches * self.batch_size
        batches = []
        for start in range(0, len(order), chunk):
            part = order[start : start + chunk]
            part = part[torch.argsort(self.lengths[part], descending=True, stable=True)]
            batches.extend(part.split(self.batch_size))
        shuffle = torch.randperm(len(batches), generator=generator)
        return [batches[i] for i in shuffle]

    def __iter__(self) -> Iterator[Batch]:
        """Yield this rank's share of each global batch, from the current position, forever."""
        share = self.batch_size // self.world_size
        while True:
            batches = self.epoch_batches(self.epoch)
            while self.batch_index < len(batches):
                rows = batches[self.batch_index][self.rank * share : (self.rank + 1) * share]
                self.batch_index += 1  # before yielding: state_dict() names the next batch
                yield collate([self.rows[i] for i in rows.tolist()], self.pad_id)
            self.epoch, self.batch_index = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        """The position: epoch and index of the next global batch."""
        return {"epoch": self.epoch, "batch_index": self.batch_index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position given by state_dict()."""
        self.epoch, self.batch_index = int(state["epoch"]), int(state["batch_index"])

    def tokens_in(self, batch: Batch) -> int:
        """Real (unpadded) tokens of a batch, for tokens/s."""
        return int(batch["attention_mask"].sum())
