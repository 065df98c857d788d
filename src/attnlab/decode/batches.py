"""Decoding many batches: several at once on a CPU's cores, each on its share of the threads."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch
from torch import Tensor

from attnlab.decode.options import SearchOptions
from attnlab.decode.search import decoding, search_options, translate_ids
from attnlab.errors import AttnlabError
from attnlab.models.seq2seq import Transformer

Batch = TypeVar("Batch")
Result = TypeVar("Result")


def map_batches(
    fn: Callable[[Batch], Result], batches: Sequence[Batch], workers: int = 1
) -> list[Result]:
    """[fn(b) for b in batches], with up to ``workers`` batches in flight at once; results in order.

    A decoding step is many small operations, which a CPU's cores share poorly: several
    batches at once, one thread each, keep the cores busy instead (as Marian's and
    CTranslate2's CPU translators do). The torch threads are split between the workers; each
    worker is a Python thread (torch releases the GIL inside its operations). Each batch's
    result is what fn gives on that many threads alone: decoding is deterministic per thread
    count, whatever runs beside it. There are at most as many workers as torch threads: more
    would only take turns on the cores.
    """
    if workers < 1:
        raise AttnlabError(f"workers must be at least 1, got {workers}")
    total = torch.get_num_threads()
    workers = min(workers, len(batches), total)
    if workers <= 1:
        return [fn(batch) for batch in batches]
    # The thread count is per OS thread: a new thread would otherwise use every core itself.
    try:
        with ThreadPoolExecutor(
            workers, initializer=torch.set_num_threads, initargs=(max(1, total // workers),)
        ) as pool:
            return list(pool.map(fn, batches))  # an error cancels the batches not started
    finally:  # torch also sets MKL's thread count, which is process-wide: set it back
        torch.set_num_threads(total)


def translate_batches(
    model: Transformer,
    batches: Sequence[tuple[Tensor, Tensor | None]],
    workers: int = 1,
    options: SearchOptions | None = None,
    **overrides: Any,
) -> list[list[list[int]]]:
    """translate_ids on each (src_ids, src_mask) batch, ``workers`` batches at a time (map_batches).

    ``overrides`` replace fields of ``options`` (SearchOptions).
    """
    options = search_options(options, overrides)

    def one(batch: tuple[Tensor, Tensor | None]) -> list[list[int]]:
        src_ids, src_mask = batch
        return translate_ids(model, src_ids, src_mask, options)

    # Evaluation mode once, here: workers entering and leaving it on their own would switch
    # the shared model's mode under each other.
    with decoding(model):
        return map_batches(one, batches, workers)
