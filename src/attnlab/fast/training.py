"""The trainer's speed-ups that are not modules: kept embedding gradients and freed memory
kept by glibc. ``TrainingSpeedups`` hands them to the trainer (train/hooks.py), each on
unless ``ATTNLAB_SPEEDUPS`` leaves it out by name.

Embedding gradients ("embedding_grads"). A lookup's dense gradient is a fresh (vocab, width)
tensor every backward pass: zero-filled, then the looked-up rows added in. On CPU, glibc hands
a freed buffer that large back to the operating system, so every step page-faults it in again.
While training, the large embeddings' lookups send sparse gradients (the looked-up rows) and a
hook moves them into a dense buffer kept from step to step; where a dense gradient reaches the
same weight (a tied output projection) autograd sums the two, in place when the dense one
arrives second (tied_weight). Either way the optimiser, clipping and checkpoints see the same
dense ``.grad`` as before; only where it is stored changes. A kept buffer is zero outside the rows this step's lookups touched, and the buffer
knows which: the next step zeroes only those rows, and the clipping reads and scales only
those rows instead of the whole table.

Freed memory kept ("keep_freed_memory"). glibc serves requests above its mmap threshold with
fresh mappings and returns them when freed, and trims freed memory at the top of its heap. A
training step allocates and frees the same large buffers every step (feed-forward activations
and their gradients, the MLM logits, the word-embedding gradient), so every step faults those
pages in again, each one zeroed by the kernel. With ``mallopt`` set here freed memory stays in
the heap for the next step. Held for good, that memory grows: temporaries differ in size from
step to step (translation batches, evaluation's decoding), so freed blocks are split and the
heap grows around them. So once a ``RELEASE_SECONDS`` the trainer hands the free pages back
(``malloc_trim``): a few page faults a minute instead of a step's worth each step.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import platform
import sys
import time
from collections.abc import Iterable, Iterator
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx
from torch.utils.hooks import RemovableHandle

from attnlab.fast.route import fast_bf16_matmul
from attnlab.fast.swap import TRAINING, Speedup, chosen
from attnlab.train.hooks import TrainerHooks

if TYPE_CHECKING:
    from attnlab.train.trainer import Trainer


class KeptEmbeddingGrads:
    """Sparse lookups for embeddings of at least ``MIN_ELEMENTS`` weights, whose ``.grad`` still
    ends dense; ``with`` turns it on for the model and off again after.
    """

    MIN_ELEMENTS = 1 << 20  # 4 MB of fp32: vocabulary tables; position and segment ones stay dense

    def __init__(self, model: nn.Module) -> None:
        self.modules = [
            m
            for m in model.modules()
            if isinstance(m, nn.Embedding)
            and not m.sparse
            and m.weight.requires_grad
            and m.weight.numel() >= self.MIN_ELEMENTS
        ]
        self.weights = list({id(m.weight): m.weight for m in self.modules}.values())  # tied once
        self.buffers: dict[int, Tensor] = {}  # id(weight) -> its kept dense gradient
        # id(weight) -> the rows its kept buffer may hold nonzero (unique), while it is .grad
        self.rows: dict[int, Tensor] = {}
        self._incoming: dict[int, list[Tensor | None]] = {}  # this backward's row indices
        self._hooks: list[RemovableHandle] = []
        self.model = model

    def __enter__(self) -> KeptEmbeddingGrads:
        self._hooks.append(self.model.register_forward_pre_hook(self._forget_handles))
        for module in self.modules:
            module.sparse = True
            self._hooks.append(module.register_forward_pre_hook(_make_tied_handle))
        for w in self.weights:
            self._hooks.append(w.register_hook(partial(self._note_rows, id(w))))
            self._hooks.append(w.register_post_accumulate_grad_hook(self._densify))
        return self

    def __exit__(self, *exc: object) -> None:
        self._forget_handles()
        for module in self.modules:
            module.sparse = False
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _forget_handles(self, *_: object) -> None:
        """At the start of each forward pass: the tied handles of the last one are stale."""
        for module in self.modules:
            module.__dict__.pop(TIED_HANDLE, None)

    def _note_rows(self, key: int, grad: Tensor) -> None:
        """Before autograd stores a gradient of the weight: note its rows (None: dense, any row)."""
        self._incoming.setdefault(key, []).append(grad._indices()[0] if grad.is_sparse else None)

    def _densify(self, weight: Tensor) -> None:
        """Once autograd has stored a weight's gradient: a sparse one goes into the kept buffer."""
        key = id(weight)
        incoming = self._incoming.pop(key, [])
        buffer = self.buffers.get(key)
        if weight.grad is None:
            return
        if not weight.grad.is_sparse:
            # Dense: a tied projection's gradient took the rows in place, or a later
            # micro-batch's rows were added into the kept buffer by autograd.
            known = self.rows.get(key)
            if weight.grad is buffer and known is not None:
                self._set_rows(key, [known, *incoming])
            else:
                self.rows.pop(key, None)
            return
        if buffer is None:
            buffer = self.buffers[key] = torch.zeros_like(weight)
        elif key in self.rows:
            buffer.index_fill_(0, self.rows[key], 0.0)  # zero outside these rows already
        else:
            buffer.zero_()
        weight.grad = buffer.add_(weight.grad)
        self._set_rows(key, incoming)

    def _set_rows(self, key: int, parts: list[Tensor | None]) -> None:
        """The buffer's rows are the union of parts; unknown (any row) if one part is None."""
        if parts and all(part is not None for part in parts):
            self.rows[key] = torch.cat(parts).unique()
        else:
            self.rows.pop(key, None)


TIED_HANDLE = "tied_handle"  # an embedding's attribute while its gradients are kept


class _TiedWeight(torch.autograd.Function):
    """An embedding table, unchanged, as a tied output projection's weight (see tied_weight)."""

    @staticmethod
    def forward(ctx: FunctionCtx, weight: Tensor) -> Tensor:
        """The weight itself (a view)."""
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> Tensor:
        """The gradient as it is (the tensor itself, so it can be added into)."""
        return grad


def _make_tied_handle(module: nn.Embedding, args: object) -> None:
    """Before an embedding's first lookup of a forward pass: its table's handle (tied_weight)."""
    if torch.is_grad_enabled() and TIED_HANDLE not in module.__dict__:
        module.__dict__[TIED_HANDLE] = _TiedWeight.apply(module.weight)


def tied_weight(embedding: nn.Embedding) -> Tensor:
    """The embedding's table, for a tied output projection in the same forward pass.

    Autograd runs backward nodes in reverse order of creation and sums two gradients of one
    weight as they arrive: a dense one arriving second takes a sparse one in place, while a
    sparse one arriving second makes an out-of-place sum, a copy of the whole table. While
    its gradients are kept (KeptEmbeddingGrads), an embedding makes a handle of its table
    before its first lookup; a projection through it passes its dense gradient on after the
    lookups' sparse rows. Elsewhere this is the table itself.
    """
    handle = embedding.__dict__.get(TIED_HANDLE)
    return embedding.weight if handle is None or not torch.is_grad_enabled() else handle


def kept_embedding_grads(
    model: nn.Module, compiled: bool = False, distributed: bool = False
) -> KeptEmbeddingGrads | None:
    """KeptEmbeddingGrads for a model trained eagerly on CPU in one process, else None.

    GPUs have no page-fault cost to save; DDP buckets dense gradients and compile traces the
    lookups, so both keep them dense.
    """
    on_cpu = next(model.parameters()).device.type == "cpu"
    return KeptEmbeddingGrads(model) if on_cpu and not compiled and not distributed else None


def _grads_and_rows(
    parameters: Iterable[Tensor], kept: KeptEmbeddingGrads | None
) -> list[tuple[Tensor, Tensor | None]]:
    """Each gradient with the rows it may hold nonzero (a kept buffer's), or None for any row."""
    pairs = []
    for p in parameters:
        if p.grad is not None:
            is_kept = kept is not None and p.grad is kept.buffers.get(id(p))
            pairs.append((p.grad, kept.rows.get(id(p)) if is_kept else None))
    return pairs


def _total_norm(pairs: list[tuple[Tensor, Tensor | None]]) -> Tensor:
    """The 2-norm of all gradients together; a kept buffer's is that of its rows (the rest is 0)."""
    if not pairs:
        return torch.tensor(0.0)
    squares = [_squared_norm(g if r is None else g.index_select(0, r)) for g, r in pairs]
    return torch.stack(squares).sum().sqrt()


def _squared_norm(g: Tensor) -> Tensor:
    """sum(g ** 2) as a 0-d tensor of g's dtype (BLAS dot for contiguous CPU fp32 gradients).

    The dot product reads each gradient at full memory speed, faster than
    ``linalg.vector_norm`` (bench/step_parts.py); both sum in fp32.
    """
    if g.device.type == "cpu" and g.dtype == torch.float32 and g.is_contiguous():
        flat = g.view(-1)
        return torch.dot(flat, flat)
    return torch.linalg.vector_norm(g).square()


def _clip_coefficient(total: Tensor, max_norm: float) -> Tensor:
    return (max_norm / (total + 1e-6)).clamp(max=1.0)  # as torch's clip_grad_norm_


def _scale_(pairs: list[tuple[Tensor, Tensor | None]], scale: Tensor) -> None:
    for g, r in pairs:
        if r is None:
            g.mul_(scale)
        else:
            g.index_copy_(0, r, g.index_select(0, r).mul_(scale))


def clipped_step(
    optimizer: torch.optim.Optimizer,
    parameters: Iterable[Tensor],
    max_norm: float,
    kept: KeptEmbeddingGrads | None,
) -> Tensor:
    """optimizer.step() on gradients clipped to a total 2-norm of max_norm; the norm before.

    A kept embedding buffer's norm and scaling read only the rows this step touched.
    """
    pairs = _grads_and_rows(parameters, kept)
    total = _total_norm(pairs)
    if max_norm < math.inf and pairs:
        _scale_(pairs, _clip_coefficient(total, max_norm))
    optimizer.step()
    return total


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's malloc.h


@functools.cache
def keep_freed_memory() -> bool:
    """Make glibc malloc reuse freed memory (no per-step page faults); True where it is in effect.

    For the whole process, once; False off glibc.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    # Every request from the heap (glibc still maps memory when the heap cannot grow), and the
    # heap trimmed only when more than 2 GB (mallopt takes a C int) lie free at its top.
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def release_freed_memory() -> None:
    """Hand glibc malloc's free pages (in every arena, not only the heap's top) back to the system."""
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        ctypes.CDLL(None).malloc_trim(0)


def _glibc() -> bool:
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _always() -> bool:
    return True


TRAINER_SPEEDUPS = [
    Speedup(
        "embedding_grads", None, None, (TRAINING,), _always,
        "CPU: large embeddings' gradients as sparse rows into a dense buffer kept across steps",
    ),
    Speedup(
        "keep_freed_memory", None, None, (TRAINING,), _glibc,
        "glibc malloc keeps freed memory for the next step, handed back once a minute (glibc only)",
    ),
]  # fmt: skip


class TrainingSpeedups(TrainerHooks):
    """The trainer's speed-ups that ``names`` (default: ATTNLAB_SPEEDUPS) selects and apply here."""

    RELEASE_SECONDS = 60.0  # how often kept freed memory goes back (keep_freed_memory above)

    def __init__(self, names: str | None = None) -> None:
        self.names = {s.name for s in chosen(TRAINING, names)}
        self.kept: KeptEmbeddingGrads | None = None
        self.released_at = time.monotonic()

    @contextlib.contextmanager
    def running(self, trainer: Trainer) -> Iterator[None]:
        """Around fit()'s loop: malloc settings, kept embedding gradients, a note on bf16."""
        if "keep_freed_memory" in self.names:
            keep_freed_memory()
            self.released_at = time.monotonic()
        on_cpu = trainer.device.type == "cpu"
        if trainer.config.precision == "bf16" and on_cpu and trainer.is_main:
            _note_bf16()
        if "embedding_grads" in self.names:
            compiled, distributed = trainer.config.compile, trainer.world_size > 1
            self.kept = kept_embedding_grads(trainer.model, compiled, distributed)
        try:
            with self.kept or contextlib.nullcontext():
                yield
        finally:
            self.kept = None

    def after_step(self, trainer: Trainer) -> None:
        """Once a RELEASE_SECONDS, give the memory malloc keeps for the next step back."""
        if "keep_freed_memory" in self.names and self._release_due():
            release_freed_memory()
            self.released_at = time.monotonic()

    def _release_due(self) -> bool:
        return time.monotonic() - self.released_at >= self.RELEASE_SECONDS

    def clipped_step(
        self, optimizer: torch.optim.Optimizer, parameters: Iterable[Tensor], max_norm: float
    ) -> Tensor:
        """optimizer.step() on clipped gradients (clipped_step); the norm before."""
        return clipped_step(optimizer, parameters, max_norm, self.kept)


def _note_bf16() -> None:
    if fast_bf16_matmul() is False:  # fast/linear.py: bf16_by_fp32
        print(
            "note: this CPU multiplies bf16 no faster than fp32 (it has no AMX, nor AMD's "
            "avx512_bf16): --precision bf16 computes its bf16 products with the fp32 "
            "kernel here, so it is no faster than fp32",
            file=sys.stderr,
        )
