"""The endpoints that generate text: /v1/translate (translation) and /v1/completions (GPT).

Translations are searched as `attnlab translate`; completions follow OpenAI's shape, by
``generate_texts`` (what `attnlab generate` runs), and ``stream: true`` answers as
server-sent events.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Hashable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from attnlab.errors import AttnlabError, first_line

from .handling import ClientGone, Server, as_list
from .limits import ApiError, check_texts, error_body
from .models import LanguageModel, TranslationModel
from .schemas import CompletionsRequest, TranslateRequest

log = logging.getLogger("attnlab.serve")


def add_translation_routes(app: FastAPI, server: Server, served: TranslationModel) -> None:
    """POST /v1/translate."""
    from attnlab.decode import SearchOptions

    @app.post("/v1/translate", tags=["translation"])
    async def translate(body: TranslateRequest, request: Request) -> dict[str, Any]:
        """Each line's translation, searched as `attnlab translate` with the same options."""
        lines = as_list(body.input)
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
        tokens = server.counted(lines, served.max_length, body.truncate)
        hyps = await server.answer(request, search, lines, tokens)
        return server.listing([{"index": i, "translation": h} for i, h in enumerate(hyps)], tokens)


def add_lm_routes(app: FastAPI, server: Server, served: LanguageModel) -> None:
    """POST /v1/completions."""

    @app.post("/v1/completions", tags=["gpt"], response_model=None)
    async def completions(body: CompletionsRequest, request: Request) -> dict | StreamingResponse:
        """OpenAI's completions: each prompt's n continuations, or one streamed as SSE."""
        prompts = as_list(body.prompt)
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
