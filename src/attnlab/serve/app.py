"""The FastAPI app: one model, its endpoints, the batcher that runs them, health and metrics.

Each task endpoint checks its body (limits.py), counts every input's tokens (refusing one past
the model's length when the request says truncate: false), hands the inputs to the batcher
and waits for them, or for its client to go away, whichever comes first.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Hashable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from attnlab.errors import AttnlabError, first_line

from .batching import Batcher, Job, QueueFull
from .limits import ApiError, Guard, Limits, check_lengths, check_texts, error_body
from .metrics import ServerMetrics
from .models import EncoderModel, LanguageModel, ServedModel, TaskModel, TranslationModel
from .schemas import (
    AttentionRequest,
    ClassifyRequest,
    CompletionsRequest,
    EmbeddingsRequest,
    FillMaskRequest,
    NerRequest,
    QARequest,
    TranslateRequest,
)

log = logging.getLogger("attnlab.serve")
RETRY_AFTER_S = 1  # what a 503 asks a client to wait


@dataclass(frozen=True)
class BatchSettings:
    """How requests are gathered into batches (the CLI's --max-batch-tokens and the rest)."""

    max_batch_tokens: int = 4096
    max_wait_ms: float = 5.0
    max_queue: int = 256

    def __post_init__(self) -> None:
        """Refuse settings that could never run a batch."""
        if self.max_batch_tokens < 1:
            raise AttnlabError("max_batch_tokens must be at least 1", options=("max_batch_tokens",))
        if not 0 <= self.max_wait_ms <= 60_000:  # NaN fails too
            raise AttnlabError("max_wait_ms must be from 0 to 60000", options=("max_wait_ms",))
        if self.max_queue < 1:
            raise AttnlabError("max_queue must be at least 1", options=("max_queue",))


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

    def usage(self, tokens: list[int]) -> dict[str, int]:
        """OpenAI's usage object."""
        return {"prompt_tokens": sum(tokens), "total_tokens": sum(tokens)}


async def _disconnected(request: Request) -> None:
    """Return once the client has closed its connection (the body is read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _counted(server: Server, items: list[Any], limit: int, truncate: bool) -> list[int]:
    """Each item's tokens as the model will see them (cut to limit), refusing when asked."""
    tokens = [server.served.token_count(item) for item in items]
    check_lengths(tokens, limit, truncate)
    return [min(n, limit) for n in tokens]


# ------------------------------------------------------------------------------ endpoints


def _add_encoder_routes(app: FastAPI, server: Server, served: EncoderModel) -> None:
    @app.post("/v1/embeddings", tags=["bert"])
    async def embeddings(body: EmbeddingsRequest, request: Request) -> dict[str, Any]:
        """Sentence embeddings in OpenAI's shape (mean pooling, L2-normalised, by default)."""
        texts = _as_list(body.input)
        check_texts(texts, server.limits)
        tokens = _counted(server, texts, served.max_length, body.truncate)
        vectors = await server.answer(request, ("embed", body.normalize), texts, tokens)
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": server.name, "usage": server.usage(tokens)}

    if not served.has_mlm:
        return

    @app.post("/v1/fill-mask", tags=["bert"])
    async def fill_mask(body: FillMaskRequest, request: Request) -> dict[str, Any]:
        """The top_k tokens for each [MASK] of each text, with their probabilities."""
        texts = _as_list(body.input)
        check_texts(texts, server.limits)
        if not 1 <= body.top_k <= server.limits.max_top_k:
            raise ApiError(422 if body.top_k < 1 else 413, f"top_k must be from 1 to max_top_k "
                           f"({server.limits.max_top_k}), got {body.top_k}", limit="max_top_k")  # fmt: skip
        tokens = _counted(server, texts, served.max_positions, body.truncate)
        found = await server.answer(request, ("fill-mask", body.top_k), texts, tokens)
        data = [
            {"index": i, "text": text,
             "masks": [[{"token": t, "probability": p} for t, p in mask] for mask in masks]}
            for i, (text, masks) in enumerate(zip(texts, found, strict=True))
        ]  # fmt: skip
        return {"object": "list", "data": data, "model": server.name, "usage": server.usage(tokens)}


def _add_task_routes(app: FastAPI, server: Server, served: TaskModel) -> None:
    if served.task in ("classify", "regress"):

        @app.post("/v1/classify", tags=["fine-tuned"])
        async def classify(body: ClassifyRequest, request: Request) -> dict[str, Any]:
            """Each text's (or pair's) label and class probabilities, or its score."""
            texts = _as_list(body.input)
            check_texts(texts, server.limits)
            items: list[Any] = texts
            if body.pair is not None:
                pairs = _as_list(body.pair)
                if len(pairs) != len(texts):
                    raise ApiError(422, f"input has {len(texts)} texts but pair {len(pairs)}")
                check_texts(pairs, server.limits, "pair")
                items = list(zip(texts, pairs, strict=True))
            return await _predict(server, request, items, body.truncate, body.pair is not None)

    elif served.task == "ner":

        @app.post("/v1/ner", tags=["fine-tuned"])
        async def ner(body: NerRequest, request: Request) -> dict[str, Any]:
            """Each sentence's words and their predicted tags."""
            given = [body.input] if isinstance(body.input, str) else body.input
            sentences = [item.split() if isinstance(item, str) else item for item in given]
            check_texts([" ".join(words) for words in sentences], server.limits)
            bad = next((i for i, words in enumerate(sentences) if not all(words)), None)
            if bad is not None:
                raise ApiError(422, f"input[{bad}] has no words (or an empty word)")
            return await _predict(server, request, sentences, body.truncate, "ner")

    else:

        @app.post("/v1/qa", tags=["fine-tuned"])
        async def qa(body: QARequest, request: Request) -> dict[str, Any]:
            """Each question's answer: the best span of its context."""
            questions = _as_list(body.input)
            check_texts([q.question for q in questions], server.limits)
            check_texts([q.context for q in questions], server.limits)
            items = [(q.question, q.context) for q in questions]
            # A long context is read in overlapping windows: nothing is cut, nothing refused.
            return await _predict(server, request, items, True, "qa")


async def _predict(server: Server, request: Request, items: list[Any], truncate: bool,
                   key: Hashable) -> dict[str, Any]:  # fmt: skip
    """FinetunedModel.predict's rows for items, each with its index (qa: no question id)."""
    served = server.served
    tokens = _counted(server, items, served.max_length, truncate)
    rows = await server.answer(request, (served.task, key), items, tokens)
    data = [{"index": i, **{k: v for k, v in row.items() if k != "id"}}
            for i, row in enumerate(rows)]  # fmt: skip
    return {"object": "list", "data": data, "model": server.name, "usage": server.usage(tokens)}


def _add_translation_routes(app: FastAPI, server: Server, served: TranslationModel) -> None:
    from attnlab.decode import SearchOptions

    @app.post("/v1/translate", tags=["translation"])
    async def translate(body: TranslateRequest, request: Request) -> dict[str, Any]:
        """Each line's translation, searched as `attnlab translate` with the same options."""
        lines = _as_list(body.input)
        check_texts(lines, server.limits)
        beam = 1 if body.greedy else body.beam
        if beam > server.limits.max_beam:
            raise ApiError(413, f"beam {beam} is above max_beam ({server.limits.max_beam})",
                           limit="max_beam")  # fmt: skip
        search = (beam, body.length_penalty, body.max_len_a, body.max_len_b)
        try:
            SearchOptions(*search)
        except AttnlabError as err:
            raise ApiError(422, str(err).replace("beam_size", "beam")) from None
        tokens = _counted(server, lines, served.max_length, body.truncate)
        hyps = await server.answer(request, search, lines, tokens)
        data = [{"index": i, "translation": hyp} for i, hyp in enumerate(hyps)]
        return {"object": "list", "data": data, "model": server.name, "usage": server.usage(tokens)}


def _add_lm_routes(app: FastAPI, server: Server, served: LanguageModel) -> None:
    @app.post("/v1/completions", tags=["gpt"], response_model=None)
    async def completions(body: CompletionsRequest, request: Request) -> dict | StreamingResponse:
        """OpenAI's completions: each prompt's n continuations, or one streamed as SSE."""
        prompts = _as_list(body.prompt)
        check_texts(prompts, server.limits, "prompt")
        settings = _sampling(server, body)
        room = served.max_length - body.max_tokens
        if room < 1:
            raise ApiError(422, f"max_tokens {body.max_tokens} leaves no room for a prompt in "
                           f"the model's context of {served.max_length}", limit="max_length")  # fmt: skip
        tokens = [served.token_count(prompt) for prompt in prompts]
        long = next((i for i, n in enumerate(tokens) if n > room), None)
        if long is not None:
            raise ApiError(422, f"prompt[{long}] has {tokens[long]} tokens: with max_tokens "
                           f"{body.max_tokens} the model's context of {served.max_length} "
                           f"leaves room for {room}", limit="max_length")  # fmt: skip
        # A seeded request runs alone: its draws would change with the batch around it.
        tag = id(request) if body.seed is not None else None
        key = (tuple(sorted(settings.items())), body.n, tag)
        if body.stream:
            if len(prompts) != 1 or body.n != 1 or body.stop is not None:
                raise ApiError(422, "stream takes one prompt, n 1 and no stop")
            return _streamed(server, served, key, prompts[0], tokens)
        results = await server.answer(request, key, prompts, tokens)
        texts = [text for samples in results for text in samples]
        counts = [served.completion_tokens(text) for text in texts]
        choices = [{"text": text, "index": i, "logprobs": None,
                    "finish_reason": "length" if n >= body.max_tokens else "stop"}
                   for i, (text, n) in enumerate(zip(texts, counts, strict=True))]  # fmt: skip
        usage = {"prompt_tokens": sum(tokens), "completion_tokens": sum(counts),
                 "total_tokens": sum(tokens) + sum(counts)}  # fmt: skip
        return {**_completion_head(server), "choices": choices, "usage": usage}


def _sampling(server: Server, body: CompletionsRequest) -> dict[str, Any]:
    """generate_texts' settings of a completions request (temperature 0: greedy)."""
    from attnlab.tasks.lm import check_sampling

    limits = server.limits
    if body.max_tokens > limits.max_new_tokens:
        raise ApiError(413, f"max_tokens {body.max_tokens} is above max_new_tokens "
                       f"({limits.max_new_tokens})", limit="max_new_tokens")  # fmt: skip
    if body.n > limits.max_samples:
        raise ApiError(413, f"n {body.n} is above max_samples ({limits.max_samples})",
                       limit="max_samples")  # fmt: skip
    greedy = body.temperature == 0
    settings = {"max_new_tokens": body.max_tokens, "greedy": greedy,
                "temperature": 1.0 if greedy else body.temperature, "top_k": body.top_k,
                "top_p": None if body.top_p == 1 else body.top_p, "seed": body.seed,
                "stop": body.stop}  # fmt: skip
    try:
        check_sampling(**settings, num_samples=body.n)
    except AttnlabError as err:
        message = str(err).replace("max_new_tokens", "max_tokens").replace("num_samples", "n")
        raise ApiError(422, message) from None
    return settings


def _completion_head(server: Server) -> dict[str, Any]:
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": server.name}  # fmt: skip


def _streamed(server: Server, served: LanguageModel, key: Hashable, prompt: str,
              tokens: list[int]) -> StreamingResponse:  # fmt: skip
    """The completion as server-sent events, a chunk per piece of text, then [DONE].

    The worker thread hands each piece to the event loop as the model emits it; a client
    that goes away ends the generation at its next token.
    """
    loop = asyncio.get_running_loop()
    pieces: asyncio.Queue[str] = asyncio.Queue()
    gone = threading.Event()

    def sink(text: str) -> None:  # in the worker thread
        if gone.is_set():
            raise ClientGone
        if text:
            loop.call_soon_threadsafe(pieces.put_nowait, text)

    job = server.enqueue(key, [(prompt, sink)], tokens)  # 503 before the stream starts
    work = asyncio.ensure_future(server.batcher.result(job))
    head = _completion_head(server)

    def event(text: str, finish: str | None) -> str:
        choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
        return f"data: {json.dumps({**head, 'choices': [choice]}, ensure_ascii=False)}\n\n"

    async def events() -> AsyncIterator[str]:
        try:
            while True:
                piece = asyncio.ensure_future(pieces.get())
                await asyncio.wait({piece, work}, return_when=asyncio.FIRST_COMPLETED)
                if not piece.done():
                    piece.cancel()
                    break
                yield event(piece.result(), None)
            while not pieces.empty():
                yield event(pieces.get_nowait(), None)
            try:
                text = work.result()[0][0]
            except Exception as err:  # the stream has begun: the error is its last event
                log.error("error streaming a completion: %s", first_line(err), exc_info=err)
                body = error_body("internal server error", "server_error")
                yield f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n"
                return
            n = served.completion_tokens(text)
            max_new = dict(key[0])["max_new_tokens"]  # type: ignore[index]
            yield event("", "length" if n >= max_new else "stop")
            yield "data: [DONE]\n\n"
        finally:
            gone.set()
            if not work.done():
                work.cancel()

    return StreamingResponse(events(), media_type="text/event-stream")


# ------------------------------------------------------------------------------ attention

ATTENTION = "attention"  # the batch key's tag of an attention request (each runs alone)


def run_batch(served: ServedModel) -> Callable[[Hashable, list[Any]], list[Any]]:
    """The batcher's run: attention requests by inspect.attention_maps, the rest by the model."""

    def run(key: Hashable, items: list[Any]) -> list[Any]:
        if isinstance(key, tuple) and key[0] == ATTENTION:
            from attnlab.inspect.maps import attention_maps

            # In the worker thread: the model is never used by two threads at once.
            return [attention_maps(served.model, served.tokenizer, *item) for item in items]
        return served.run(key, items)

    return run


def _add_attention_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/attention", tags=["inspect"])
    async def attention(body: AttentionRequest, request: Request) -> dict[str, Any]:
        """Every attention weight on the text, as `attnlab attention --output FILE.json`."""
        maps = await _maps(server, request, body.text, body.pair, body.target, body.truncate)
        chosen = maps.select(body.layers, body.heads)
        values = sum(w.numel() for w in chosen.kinds().values())
        if values > server.limits.max_attention_values:
            raise ApiError(413, f"the answer would hold {values} weights, more than "
                           f"max_attention_values ({server.limits.max_attention_values}): "
                           "choose layers or heads", limit="max_attention_values")  # fmt: skip
        return {"model": server.name, **chosen.to_json()}

    @app.get("/", tags=["inspect"], response_class=HTMLResponse)
    async def page(request: Request, text: str | None = None, pair: str | None = None,
                   target: str | None = None) -> HTMLResponse:  # fmt: skip
        """The attention page of ?text= (and &pair= or &target=); without text, a form."""
        from attnlab.inspect.page import render_page

        if text is None:
            return HTMLResponse(FORM)
        maps = await _maps(server, request, text, pair, target, False)
        html, _ = render_page(maps.select(None, None), f"{server.name}: attention")
        return HTMLResponse(html)


async def _maps(server: Server, request: Request, text: str, pair: str | None,
                target: str | None, truncate: bool) -> Any:  # fmt: skip
    """AttentionMaps of one input, computed in the worker thread (each request alone)."""
    check_texts([t for t in (text, pair, target) if t is not None], server.limits, "text")
    item = (text, pair, target, truncate)
    return (await server.answer(request, (ATTENTION, id(item)), [item], [len(text)]))[0]


FORM = """<!doctype html><meta charset="utf-8"><title>attnlab attention</title>
<form method="get" action="/"><p><label>Text <input name="text" size="60"></label>
<button>Show attention</button></p></form>"""


# ------------------------------------------------------------------------------ the app


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

    @app.get("/health", tags=["server"])
    async def health() -> dict[str, Any]:
        """Whether the server is up, its model and queue (answered without the API key)."""
        return {"status": "ok", "model": name, "kind": served.kind, "endpoints": endpoints,
                "queue": batcher.queue_length()}  # fmt: skip

    @app.get("/metrics", tags=["server"])
    async def prometheus() -> Response:
        """Prometheus text: requests, errors, queue length, batch sizes, latency."""
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    _add_attention_routes(app, server)
    if isinstance(served, EncoderModel):
        _add_encoder_routes(app, server, served)
    elif isinstance(served, TaskModel):
        _add_task_routes(app, server, served)
    elif isinstance(served, LanguageModel):
        _add_lm_routes(app, server, served)
    else:
        _add_translation_routes(app, server, served)
    return Guard(app, api_key, limits.max_body_bytes, metrics)
