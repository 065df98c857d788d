"""Dynamic batching: concurrent requests gathered into length-sorted batches, run in one thread.

Each request is a ``Job``: its items (one text each) and a key naming what can share a model
call (the endpoint and its options). One worker thread runs the jobs: as soon as it is free and
a job waits, it takes the oldest job and the queued jobs of the same key that fit in
``max_batch_tokens`` and runs them as one batch, longest item first. Jobs that arrive while a
batch runs gather in the queue for the next one, so batches grow with the load and a lone
request never waits for company. ``max_wait_ms`` (default 0) makes the worker also hold the
oldest job up to that long for its batch to fill, trading latency for larger batches. Each
job is answered on the event loop; the model never runs there, so the server keeps accepting
and refusing requests while it computes. A job withdrawn before its batch starts (its client
went away) frees its slot.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from attnlab.errors import AttnlabError

log = logging.getLogger("attnlab.serve")

RunBatch = Callable[[Hashable, list[Any]], list[Any]]  # (key, items) -> one result per item


@dataclass(frozen=True)
class BatchSettings:
    """How requests are gathered into batches (the CLI's --max-batch-tokens and the rest)."""

    max_batch_tokens: int = 4096
    max_wait_ms: float = 0.0  # 0: a batch starts as soon as the worker is free
    max_queue: int = 256

    def __post_init__(self) -> None:
        """Refuse settings that could never run a batch."""
        if self.max_batch_tokens < 1:
            raise AttnlabError("max_batch_tokens must be at least 1", options=("max_batch_tokens",))
        if not 0 <= self.max_wait_ms <= 60_000:  # NaN fails too
            raise AttnlabError("max_wait_ms must be from 0 to 60000", options=("max_wait_ms",))
        if self.max_queue < 1:
            raise AttnlabError("max_queue must be at least 1", options=("max_queue",))


class QueueFull(Exception):
    """The queue holds max_queue requests already: the caller should retry later."""


class BatchObserver(Protocol):
    """What the batcher reports (ServerMetrics implements it)."""

    def queued(self, requests: int) -> None:
        """The number of requests waiting for a batch."""

    def batch(self, items: int, tokens: int) -> None:
        """A batch of items holding tokens started."""


@dataclass(eq=False)
class Job:
    """One request's items, their lengths in tokens, and the future its handler awaits."""

    key: Hashable
    items: list[Any]
    tokens: list[int]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    enqueued: float = field(default_factory=time.monotonic)

    @property
    def total_tokens(self) -> int:
        """Tokens of all its items."""
        return sum(self.tokens)


class Batcher:
    """The queue of jobs and the one worker thread that runs them in batches."""

    def __init__(
        self,
        run: RunBatch,
        max_batch_tokens: int,
        max_wait_ms: float,
        max_queue: int,
        threads: int | None = None,
        observer: BatchObserver | None = None,
        sort_by_length: bool = True,
    ) -> None:
        self.run = run
        self.sort_by_length = sort_by_length  # False: items in arrival order (seeded sampling)
        self.max_batch_tokens = max_batch_tokens
        self.max_wait = max_wait_ms / 1000
        self.max_queue = max_queue
        self.threads = threads
        self.observer = observer
        self._queue: deque[Job] = deque()
        self._ready = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---- the event loop's side

    def start(self) -> None:
        """Start the worker thread."""
        self._thread = threading.Thread(target=self._work, name="attnlab-batcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Run the jobs still queued, then stop the worker thread."""
        with self._ready:
            self._stopping = True
            self._ready.notify()
        if self._thread is not None:
            self._thread.join()

    async def submit(self, key: Hashable, items: list[Any], tokens: list[int]) -> list[Any]:
        """The results of items (one per item, in order); QueueFull when the queue is full."""
        return await self.result(self.enqueue(key, items, tokens))

    def enqueue(self, key: Hashable, items: list[Any], tokens: list[int]) -> Job:
        """Queue items (on the event loop); QueueFull when the queue is full."""
        loop = asyncio.get_running_loop()
        job = Job(key, items, tokens, loop.create_future(), loop)
        with self._ready:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"the queue is full (max_queue {self.max_queue} requests)")
            self._queue.append(job)
            self._report_queue()
            self._ready.notify()
        return job

    async def result(self, job: Job) -> list[Any]:
        """The results of a queued job, one per item, in order.

        Cancelling the awaiting task (a client that went away) withdraws the job if its batch
        has not started; a started batch runs to the end and its result is dropped.
        """
        try:
            return await job.future
        except asyncio.CancelledError:  # withdraw the job unless its batch is running
            with self._ready:
                if job in self._queue:
                    self._queue.remove(job)
                    self._report_queue()
            raise

    def queue_length(self) -> int:
        """Requests waiting for a batch."""
        return len(self._queue)

    def _report_queue(self) -> None:
        if self.observer is not None:
            self.observer.queued(len(self._queue))

    # ---- the worker thread's side

    def _work(self) -> None:
        if self.threads is not None:  # torch's thread count is per thread under OpenMP
            import torch

            torch.set_num_threads(self.threads)
        while True:
            jobs = self._next_batch()
            if not jobs:
                return
            self._run_batch(jobs)

    def _next_batch(self) -> list[Job]:
        """The next batch once a job waits (held up to max_wait for a full batch when that is
        above 0); [] when stopping with none left."""
        with self._ready:
            while True:
                if not self._queue:
                    if self._stopping:
                        return []
                    self._ready.wait()
                    continue
                oldest = self._queue[0]
                waiting = sum(j.total_tokens for j in self._queue if j.key == oldest.key)
                wait_left = oldest.enqueued + self.max_wait - time.monotonic()
                if waiting >= self.max_batch_tokens or wait_left <= 0 or self._stopping:
                    jobs = self._take(oldest.key)
                    self._report_queue()
                    return jobs
                self._ready.wait(wait_left)

    def _take(self, key: Hashable) -> list[Job]:
        """The oldest job of key and the next ones of key that fit in max_batch_tokens."""
        jobs, tokens = [], 0
        for job in list(self._queue):
            if job.key != key:
                continue
            if jobs and tokens + job.total_tokens > self.max_batch_tokens:
                continue  # a smaller job further back may still fit
            jobs.append(job)
            tokens += job.total_tokens
            self._queue.remove(job)
        return jobs

    def _run_batch(self, jobs: list[Job]) -> None:
        """Run jobs as one batch; when it fails, run each alone, so one bad input fails one job."""
        items = [
            (item, n, j)
            for j, job in enumerate(jobs)
            for item, n in zip(job.items, job.tokens, strict=True)
        ]
        order = list(range(len(items)))
        if self.sort_by_length:
            order.sort(key=lambda i: -items[i][1])  # longest first: little padding
        if self.observer is not None:
            self.observer.batch(len(items), sum(n for _, n, _ in items))
        try:
            results = self._call(jobs[0].key, [items[i][0] for i in order])
        except Exception as err:
            if len(jobs) == 1:
                _settle(jobs[0], error=err)
                return
            for job in jobs:
                self._run_alone(job)
            return
        by_item: list[Any] = [None] * len(items)
        for place, i in enumerate(order):
            by_item[i] = results[place]
        start = 0
        for job in jobs:
            _settle(job, result=by_item[start : start + len(job.items)])
            start += len(job.items)

    def _run_alone(self, job: Job) -> None:
        try:
            _settle(job, result=self._call(job.key, job.items))
        except Exception as err:
            _settle(job, error=err)

    def _call(self, key: Hashable, items: Sequence[Any]) -> list[Any]:
        results = self.run(key, list(items))
        if len(results) != len(items):  # a broken adapter must not hand out shifted answers
            raise RuntimeError(f"{len(results)} results for {len(items)} items")
        return results


def _settle(job: Job, result: list[Any] | None = None, error: BaseException | None = None) -> None:
    """Hand job its result (or error) on its event loop, unless its handler gave up on it."""

    def settle() -> None:
        if job.future.done():  # cancelled: the client went away
            return
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)

    try:
        job.loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop has closed (shutdown): nobody waits for the answer
        log.debug("dropped the answer of a request whose event loop has closed")
