"""What the trainer reads: an endless, resumable, rank-sharded stream of batches."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from attnlab.errors import AttnlabError

Batch = dict[str, Any]  # keyword arguments of model(**batch); tensors go to the device


@runtime_checkable
class BatchSource(Protocol):
    """An endless stream of batches that can say, and be put back to, where it stands.

    ``__iter__`` yields batches forever, each one micro-batch of *this rank's* share.
    ``state_dict`` describes the position after the last batch handed out (primitives and
    tensors only: it is stored in ``trainer.pt`` and read with ``weights_only=True``), and
    ``load_state_dict`` restores it, so a resumed run reads exactly the batches an
    uninterrupted one would have. ``set_rank`` is called once, before iteration, under
    torch.distributed. An optional ``tokens_in(batch) -> int`` counts tokens for tokens/s;
    without it the trainer uses :func:`count_tokens`.
    """

    def __iter__(self) -> Iterator[Batch]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def set_rank(self, rank: int, world_size: int) -> None: ...


def count_tokens(batch: Mapping[str, Any]) -> int:
    """Real (non-padding) tokens: attention_mask.sum() if present, else input_ids.numel()."""
    mask = batch.get("attention_mask")
    if isinstance(mask, Tensor):
        return int(mask.sum())
    ids = batch.get("input_ids")
    return ids.numel() if isinstance(ids, Tensor) else 0


class TensorBatches:
    """In-memory examples shuffled by a seeded permutation each epoch, sharded across ranks.

    ``batch_size`` is the *global* micro-batch: with world size W, rank r gets rows
    ``[r*B/W, (r+1)*B/W)`` of each global batch, so W processes together see exactly the
    batch one process would. Each epoch drops the last incomplete batch, so every batch has
    the same size (a requirement for averaging gradients by rank and by accumulation step).
    """

    def __init__(self, tensors: Mapping[str, Tensor], batch_size: int, seed: int = 0) -> None:
        sizes = {t.shape[0] for t in tensors.values()}
        if len(sizes) != 1:
            raise AttnlabError(f"TensorBatches: tensors differ in length: {sorted(sizes)}")
        (self.n_examples,) = sizes
        if not 1 <= batch_size <= self.n_examples:
            raise AttnlabError(
                f"batch size {batch_size} must be between 1 and the {self.n_examples} examples"
            )
        self.tensors = dict(tensors)
        self.batch_size = batch_size
        self.seed = seed
        self.rank, self.world_size = 0, 1
        self.epoch, self.batch_index = 0, 0  # the next batch to hand out

    def set_rank(self, rank: int, world_size: int) -> None:
        """Read only this rank's slice of each global batch."""
        if self.batch_size % world_size:
            raise AttnlabError(
                f"batch size {self.batch_size} is not divisible by the {world_size} processes"
            )
        self.rank, self.world_size = rank, world_size

    @property
    def batches_per_epoch(self) -> int:
        """Full global batches in one pass over the examples."""
        return self.n_examples // self.batch_size

    def _permutation(self, epoch: int) -> Tensor:
        # Its own generator: the order depends on (seed, epoch) only, never on how much of the
        # global RNG the model's dropout consumed.
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.n_examples, generator=generator)

    def __iter__(self) -> Iterator[Batch]:
        """Yield this rank's share of each global batch, from the current position, forever."""
        share = self.batch_size // self.world_size
        while True:
            order = self._permutation(self.epoch)
            while self.batch_index < self.batches_per_epoch:
                start = self.batch_index * self.batch_size + self.rank * share
                rows = order[start : start + share]
                self.batch_index += 1  # before yielding: state_dict() names the next batch
                yield {name: t[rows] for name, t in self.tensors.items()}
            self.epoch, self.batch_index = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        """The position: epoch and index of the next global batch."""
        return {"epoch": self.epoch, "batch_index": self.batch_index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position given by state_dict()."""
        self.epoch, self.batch_index = int(state["epoch"]), int(state["batch_index"])
