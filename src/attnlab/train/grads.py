"""Embedding gradients without a fresh (vocab, width) buffer each step (a CPU speed measure).

A lookup's dense gradient is a fresh (vocab, width) tensor every backward pass: zero-filled,
then the looked-up rows added in. On CPU, glibc hands a freed buffer that large (above its
mmap threshold, at most 32 MB) back to the operating system, so every step page-faults it in
again: for 30,522 x 384 floats about 40 ms against about 5 ms to zero a buffer that is kept
(one thread), a sizeable share of a fine-tuning step on short sentences. HF transformers pays
it every step.

While training, the large embeddings' lookups send sparse gradients (the looked-up rows).
Where a dense gradient reaches the same weight in that backward pass (a tied output
projection), autograd adds the rows into it in place; where the rows are all there is, a hook
moves them into a dense buffer kept from step to step. Either way the optimiser, clipping and
checkpoints see the same dense ``.grad`` as before; only where it is stored changes.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle


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
        self._hooks: list[RemovableHandle] = []

    def __enter__(self) -> KeptEmbeddingGrads:
        for module in self.modules:
            module.sparse = True
        self._hooks = [w.register_post_accumulate_grad_hook(self._densify) for w in self.weights]
        return self

    def __exit__(self, *exc: object) -> None:
        for module in self.modules:
            module.sparse = False
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _densify(self, weight: Tensor) -> None:
        """Once autograd has stored a weight's gradient: a sparse one goes into the kept buffer."""
        if weight.grad is None or not weight.grad.is_sparse:
            return  # dense already: a tied projection's gradient took the rows in place
        buffer = self.buffers.get(id(weight))
        if buffer is None:
            buffer = self.buffers[id(weight)] = torch.zeros_like(weight)
        weight.grad = buffer.zero_().add_(weight.grad)


def kept_embedding_grads(
    model: nn.Module, compiled: bool = False, distributed: bool = False
) -> KeptEmbeddingGrads | None:
    """KeptEmbeddingGrads for a model trained eagerly on CPU in one process, else None.

    GPUs have no page-fault cost to save; DDP buckets dense gradients and compile traces the
    lookups, so both keep them dense.
    """
    on_cpu = next(model.parameters()).device.type == "cpu"
    return KeptEmbeddingGrads(model) if on_cpu and not compiled and not distributed else None
