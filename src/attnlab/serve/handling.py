"""What every endpoint handler uses: the served model, its batcher, limits and metrics.

A task endpoint checks its body (limits.py), counts every input's tokens (refusing one past
the model's length when the request says truncate: false), hands the inputs to the batcher
and waits for them, or for its client to go away, whichever comes first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic_core import to_json

from .batching import Batcher, Job, QueueFull
from .limits import ApiError, Limits, check_lengths
from .metrics import ServerMetrics
from .models import ServedModel

RETRY_AFTER_S = 1  # what a 503 asks a client to wait


class ClientGone(Exception):
    """The client closed its connection before its answer was ready."""


class Server:
    """The served model, its batcher and metrics: what every handler uses."""

    def __init__(self, served: ServedModel, name: str, batcher: Batcher, metrics: ServerMetrics,
                 limits: Limits) -> None:  # fmt: skip
        self.served, self.name, self.batcher = served, name, batcher
        self.metrics, self.limits = metrics, limits

    async def answer(
        self, request: Request, key: Hashable, items: list[Any], tokens: list[int]
    ) -> list[Any]:
        """The batcher's results for items, unless the queue is full or the client goes away."""
        work = asyncio.ensure_future(self.batcher.result(self.enqueue(key, items, tokens)))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()  # the batcher withdraws the job: its slot is free
        if not work.done() or work.cancelled():
            self.metrics.disconnects.inc()
            raise ClientGone
        return work.result()

    def enqueue(self, key: Hashable, items: list[Any], tokens: list[int]) -> Job:
        """Queue items for a batch; 503 with Retry-After when the queue is full."""
        try:
            return self.batcher.enqueue(key, items, tokens)
        except QueueFull as err:
            raise ApiError(503, f"{err}: retry later", "overloaded", limit="max_queue",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None  # fmt: skip

    def counted(self, items: list[Any], limit: int, truncate: bool) -> list[int]:
        """Each item's tokens as the model will see them (cut to limit), refusing when asked."""
        tokens = [self.served.token_count(item) for item in items]
        check_lengths(tokens, limit, truncate)
        return [min(n, limit) for n in tokens]

    def usage(self, tokens: list[int]) -> dict[str, int]:
        """OpenAI's usage object."""
        return {"prompt_tokens": sum(tokens), "total_tokens": sum(tokens)}

    def listing(self, data: list[dict[str, Any]], tokens: list[int]) -> dict[str, Any]:
        """The answer of a task endpoint: its rows, the model's name and the usage."""
        return {"object": "list", "data": data, "model": self.name, "usage": self.usage(tokens)}


def json_response(body: Any) -> Response:
    """body as compact JSON, serialised once (FastAPI would validate and copy it first)."""
    return Response(to_json(body), media_type="application/json")


async def _disconnected(request: Request) -> None:
    """Return once the client has closed its connection (the body is read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def as_list(value: Any) -> list[Any]:
    """A request's input as a list (a single string or object is a list of one)."""
    return value if isinstance(value, list) else [value]
