"""The FastAPI app: one model, its endpoints, the batcher that runs them, health and metrics.

The endpoints live by family: routes_bert.py (embeddings, fill-mask, classify, ner, qa),
routes_generate.py (translate, completions), routes_attention.py (attention JSON and page);
handling.py holds what each handler uses. Here: the error handlers, /health, /metrics, and
``create_app``, which puts them together behind the Guard (API key, body limit).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from attnlab.errors import AttnlabError, first_line

from .batching import Batcher, BatchSettings
from .handling import ClientGone, Server
from .limits import ApiError, Guard, Limits, error_body
from .metrics import ServerMetrics
from .models import EncoderModel, LanguageModel, ServedModel, TaskModel
from .routes_attention import add_attention_routes, run_batch
from .routes_bert import add_encoder_routes, add_task_routes
from .routes_generate import add_lm_routes, add_translation_routes

log = logging.getLogger("attnlab.serve")

__all__ = ["BatchSettings", "create_app"]


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), err.status, headers=err.headers)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, err: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @app.exception_handler(AttnlabError)
    async def bad_input(request: Request, err: AttnlabError) -> JSONResponse:
        return JSONResponse(error_body(str(err), "invalid_request_error"), 422)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        if first.get("type") == "json_invalid":
            message = f"malformed JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
        else:  # the field and what is wrong with it, never the (maybe huge) value
            message = f"{where or 'body'}: {first.get('msg', 'invalid')}"
        return JSONResponse(error_body(message, "invalid_request_error"), 422)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(err.detail), "invalid_request_error"),
                            err.status_code, headers=err.headers)  # fmt: skip

    @app.exception_handler(Exception)
    async def server_error(request: Request, err: Exception) -> JSONResponse:
        # The traceback goes to the server's log; the client learns only that it failed.
        log.error("error answering %s: %s", request.url.path, first_line(err), exc_info=err)
        return JSONResponse(error_body("internal server error", "server_error"), 500)


def _add_server_routes(app: FastAPI, server: Server, endpoints: list[str]) -> None:
    """GET /health (answered without the API key) and GET /metrics."""

    @app.get("/health", tags=["server"])
    async def health() -> dict[str, Any]:
        """Whether the server is up, its model and queue (answered without the API key)."""
        return {"status": "ok", "model": server.name, "kind": server.served.kind,
                "endpoints": endpoints, "queue": server.batcher.queue_length()}  # fmt: skip

    @app.get("/metrics", tags=["server"])
    async def prometheus() -> Response:
        """Prometheus text: requests, errors, queue length, batch sizes, latency."""
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def create_app(
    served: ServedModel,
    name: str,
    settings: BatchSettings | None = None,
    limits: Limits | None = None,
    api_key: str | None = None,
    threads: int | None = None,
) -> Guard:
    """The ASGI app serving one model (start it with uvicorn; the lifespan runs the batcher)."""
    settings, limits = settings or BatchSettings(), limits or Limits()
    endpoints = [*served.endpoints(), "/v1/attention"]
    metrics = ServerMetrics({*endpoints, "/", "/health", "/metrics"})
    batcher = Batcher(run_batch(served), settings.max_batch_tokens, settings.max_wait_ms,
                      settings.max_queue, threads, metrics,
                      sort_by_length=not isinstance(served, LanguageModel))  # fmt: skip
    server = Server(served, name, batcher, metrics, limits)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        batcher.start()
        yield
        await asyncio.to_thread(batcher.stop)  # the queued requests are answered first

    app = FastAPI(title=f"attnlab serve: {name}", version="1", lifespan=lifespan,
                  description=f"A {served.kind} model; endpoints {', '.join(endpoints)}.")  # fmt: skip
    _add_error_handlers(app)
    _add_server_routes(app, server, endpoints)
    add_attention_routes(app, server)
    if isinstance(served, EncoderModel):
        add_encoder_routes(app, server, served)
    elif isinstance(served, TaskModel):
        add_task_routes(app, server, served)
    elif isinstance(served, LanguageModel):
        add_lm_routes(app, server, served)
    else:
        add_translation_routes(app, server, served)
    return Guard(app, api_key, limits.max_body_bytes, metrics)
