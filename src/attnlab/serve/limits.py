"""What the server accepts: the request limits, the API key, and the JSON error shape.

``Guard`` is plain ASGI middleware, outside FastAPI: it answers 401 before a request without
the key is read, and 413 before a body past ``max_body_bytes`` is buffered whole. Every error
is ``{"error": {"message", "type", "limit"?}}`` (OpenAI's shape), never a traceback.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from attnlab.errors import AttnlabError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = ("/health",)  # answered without the API key (load balancers probe it)


@dataclass(frozen=True)
class Limits:
    """Bounds on one request; a request past one is refused with 413 naming the field."""

    max_body_bytes: int = 1 << 20  # the JSON body
    max_items: int = 256  # texts (or questions) in one request
    max_text_chars: int = 20_000  # characters of one text
    max_top_k: int = 100  # fill-mask predictions per [MASK]
    max_beam: int = 16  # translation beam size
    max_new_tokens: int = 1024  # completions' max_tokens
    max_samples: int = 16  # completions' n
    max_attention_values: int = 4_000_000  # weights in one /v1/attention answer

    def __post_init__(self) -> None:
        """Refuse limits that would refuse everything."""
        for name, value in vars(self).items():
            if value < 1:
                raise AttnlabError(f"{name} must be at least 1, got {value}", options=(name,))


class ApiError(Exception):
    """An answer other than 200: status, message, and the limit or field it is about."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        limit: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.limit, self.headers = limit, headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON error object."""
        return error_body(self.message, self.kind, self.limit)


def error_body(message: str, kind: str, limit: str | None = None) -> dict[str, Any]:
    """{"error": {...}}: the one error shape of every endpoint."""
    error: dict[str, Any] = {"message": message, "type": kind}
    if limit is not None:
        error["limit"] = limit
    return {"error": error}


async def send_error(send: Send, error: ApiError) -> None:
    """Answer an ASGI request with error, as JSON."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """ASGI middleware: the API key, the body limit, and metrics of every answer."""

    def __init__(
        self, app: ASGIApp, api_key: str | None, max_body_bytes: int, metrics: Any
    ) -> None:
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Check the request, buffer its body, then let the app answer it."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.monotonic(), [500]

        async def counted_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            error = self._refusal(scope)
            body = None if error else await self._body(scope, receive)
            if error is None and body is None:
                error = self._too_large()
            if error is not None:
                await send_error(counted_send, error)
                return
            await self.app(scope, _replay(body, receive), counted_send)
        finally:
            self.metrics.answered(scope["path"], status[0], time.monotonic() - started)

    def _refusal(self, scope: Scope) -> ApiError | None:
        """401 without the key, 413 for a declared body past the limit, else None."""
        headers = dict(scope["headers"])
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b"").decode("latin-1")
            expected = f"Bearer {self.api_key}"
            if not hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8")):
                return ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                                "authentication_error", headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return self._too_large()
        return None

    def _too_large(self) -> ApiError:
        return ApiError(413, f"the request body is larger than max_body_bytes "
                        f"({self.max_body_bytes} bytes)", limit="max_body_bytes")  # fmt: skip

    async def _body(self, scope: Scope, receive: Receive) -> bytes | None:
        """The whole body, or None once it passes max_body_bytes (a chunked upload)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"".join(chunks)  # the app's read sees the disconnect next
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives body first, then the server's messages (a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def check_texts(texts: list[str], limits: Limits, field: str = "input") -> None:
    """Refuse an empty list, too many texts, a text too long, or text that is not UTF-8."""
    if not texts:
        raise ApiError(422, f"{field} is empty: give at least one text")
    if len(texts) > limits.max_items:
        raise ApiError(413, f"{field} has {len(texts)} items, more than max_items "
                       f"({limits.max_items})", limit="max_items")  # fmt: skip
    for i, text in enumerate(texts):
        if len(text) > limits.max_text_chars:
            raise ApiError(413, f"{field}[{i}] has {len(text)} characters, more than "
                           f"max_text_chars ({limits.max_text_chars})", limit="max_text_chars")  # fmt: skip
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # JSON's "\ud800": a lone surrogate is no character
            raise ApiError(422, f"{field}[{i}] is not valid Unicode (a lone surrogate)") from None


def check_lengths(tokens: list[int], limit: int, truncate: bool, field: str = "input") -> None:
    """Refuse a text past the model's maximum length when the request said truncate: false."""
    if truncate:
        return
    for i, n in enumerate(tokens):
        if n > limit:
            raise ApiError(422, f"{field}[{i}] has {n} tokens, more than the model's maximum "
                           f"length ({limit}); send \"truncate\": true to cut it", limit="max_length")  # fmt: skip
