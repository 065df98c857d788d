"""Embedding gradients kept from step to step (a CPU speed measure; the gradients are unchanged).

A lookup's dense gradient is a fresh (vocab, width) tensor every backward pass: zero-filled,
then the looked-up rows added in. On CPU, glibc hands a freed buffer that large (above its
mmap threshold, at most 32 MB) back to the operating system, so every step page-faults it in
again: for 30,522 x 384 floats about 40 ms against about 5 ms to zero a buffer that is kept
(one thread), a sizeable share of a fine-tuning step on short sentences. HF transformers
pays it every step.

While training, the large embeddings send sparse gradients (the looked-up rows only) and
each such weight's ``.grad`` is a dense buffer kept across steps, zeroed before the step and
added into. Optimisers, clipping, tied output projections and checkpoints see the same dense
gradient as before; only where it is stored changes. (One difference: an embedding that no
loss reached in a step has a zero gradient instead of none; the trainer's models use theirs
every step.)
"""

from __future__ import annotations

import torch
from torch import nn


class KeptEmbeddingGrads:
    """Sparse lookups into dense ``.grad`` buffers kept across steps, for embeddings of at
    least ``MIN_ELEMENTS`` weights; ``with`` turns the sparse lookups on (and off again after).
    """

    MIN_ELEMENTS = 1 << 20  # 4 MB of fp32: smaller tables gain nothing measurable

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
        self.buffers = [torch.zeros_like(w) for w in self.weights]

    def __enter__(self) -> KeptEmbeddingGrads:
        for module in self.modules:
            module.sparse = True
        return self

    def __exit__(self, *exc: object) -> None:
        for module in self.modules:
            module.sparse = False

    def attach(self) -> None:
        """Give each embedding weight its kept gradient buffer, zeroed (before a step's first backward)."""
        for weight, buffer in zip(self.weights, self.buffers, strict=True):
            weight.grad = buffer.zero_()
