"""The endpoints of a BERT (embeddings, fill-mask) and of a fine-tuned one (classify, ner, qa).

Each answers as the CLI does for the same input: `attnlab embed`, `attnlab fill-mask --json`,
`attnlab predict`.
"""

from __future__ import annotations

import base64
from collections.abc import Hashable
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import Response

from .handling import Server, as_list, json_response
from .limits import ApiError, check_texts
from .models import EncoderModel, TaskModel
from .schemas import ClassifyRequest, EmbeddingsRequest, FillMaskRequest, NerRequest, QARequest


def base64_floats(vector: list[float]) -> str:
    """OpenAI's base64 embedding: the vector's float32 values, little-endian, in base64."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


def add_encoder_routes(app: FastAPI, server: Server, served: EncoderModel) -> None:
    """POST /v1/embeddings, and /v1/fill-mask when the folder holds the MLM head."""

    @app.post("/v1/embeddings", tags=["bert"])
    async def embeddings(body: EmbeddingsRequest, request: Request) -> Response:
        """Sentence embeddings in OpenAI's shape (mean pooling, L2-normalised, by default)."""
        texts = as_list(body.input)
        check_texts(texts, server.limits)
        tokens = server.counted(texts, served.max_length, body.truncate)
        vectors = await server.answer(request, ("embed", body.normalize), texts, tokens)
        if body.encoding_format == "base64":
            vectors = [base64_floats(v) for v in vectors]
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
        return json_response(server.listing(data, tokens))

    if not served.has_mlm:
        return

    @app.post("/v1/fill-mask", tags=["bert"])
    async def fill_mask(body: FillMaskRequest, request: Request) -> dict[str, Any]:
        """The top_k tokens for each [MASK] of each text, with their probabilities."""
        texts = as_list(body.input)
        check_texts(texts, server.limits)
        if not 1 <= body.top_k <= server.limits.max_top_k:
            raise ApiError(422 if body.top_k < 1 else 413, f"top_k must be from 1 to max_top_k "
                           f"({server.limits.max_top_k}), got {body.top_k}", limit="max_top_k")  # fmt: skip
        tokens = server.counted(texts, served.max_positions, body.truncate)
        found = await server.answer(request, ("fill-mask", body.top_k), texts, tokens)
        data = [
            {"index": i, "text": text,
             "masks": [[{"token": t, "probability": p} for t, p in mask] for mask in masks]}
            for i, (text, masks) in enumerate(zip(texts, found, strict=True))
        ]  # fmt: skip
        return server.listing(data, tokens)


def add_task_routes(app: FastAPI, server: Server, served: TaskModel) -> None:
    """The fine-tuned model's endpoint: /v1/classify (classify, regress), /v1/ner or /v1/qa."""
    if served.task in ("classify", "regress"):

        @app.post("/v1/classify", tags=["fine-tuned"])
        async def classify(body: ClassifyRequest, request: Request) -> dict[str, Any]:
            """Each text's (or pair's) label and class probabilities, or its score."""
            texts = as_list(body.input)
            check_texts(texts, server.limits)
            items: list[Any] = texts
            if body.pair is not None:
                pairs = as_list(body.pair)
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
            questions = as_list(body.input)
            check_texts([q.question for q in questions], server.limits)
            check_texts([q.context for q in questions], server.limits)
            items = [(q.question, q.context) for q in questions]
            # A long context is read in overlapping windows: nothing is cut, nothing refused.
            return await _predict(server, request, items, True, "qa")


async def _predict(server: Server, request: Request, items: list[Any], truncate: bool,
                   key: Hashable) -> dict[str, Any]:  # fmt: skip
    """FinetunedModel.predict's rows for items, each with its index (qa: no question id)."""
    served = server.served
    tokens = server.counted(items, served.max_length, truncate)
    rows = await server.answer(request, (served.task, key), items, tokens)
    data = [{"index": i, **{k: v for k, v in row.items() if k != "id"}}
            for i, row in enumerate(rows)]  # fmt: skip
    return server.listing(data, tokens)
