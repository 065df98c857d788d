"""Every model's look inside: POST /v1/attention (the JSON of `attnlab attention`) and GET /,
its attention page. Each request runs alone in the worker thread, the one thread that uses
the model.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse

from .handling import Server
from .limits import ApiError, check_texts
from .models import ServedModel
from .schemas import AttentionRequest

ATTENTION = "attention"  # the batch key's tag of an attention request (each runs alone)

FORM = """<!doctype html><meta charset="utf-8"><title>attnlab attention</title>
<form method="get" action="/"><p><label>Text <input name="text" size="60"></label>
<button>Show attention</button></p></form>"""


def run_batch(served: ServedModel) -> Callable[[Hashable, list[Any]], list[Any]]:
    """The batcher's run: attention requests by inspect.attention_maps, the rest by the model."""

    def run(key: Hashable, items: list[Any]) -> list[Any]:
        if isinstance(key, tuple) and key[0] == ATTENTION:
            from attnlab.inspect.maps import attention_maps

            # In the worker thread: the model is never used by two threads at once.
            return [attention_maps(served.model, served.tokenizer, *item) for item in items]
        return served.run(key, items)

    return run


def add_attention_routes(app: FastAPI, server: Server) -> None:
    """POST /v1/attention and GET /."""

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
