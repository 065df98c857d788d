"""The JSON bodies each endpoint accepts (pydantic, strict: "5" is not a number, and an
unknown field is an error rather than ignored)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from attnlab.decode import SearchOptions

_SEARCH = SearchOptions()  # translate's defaults, as the CLI's


class Body(BaseModel):
    """Strict types, no unknown fields."""

    model_config = ConfigDict(strict=True, extra="forbid")


class EmbeddingsRequest(Body):
    """OpenAI's embeddings request; `normalize` and `truncate` are attnlab's additions."""

    input: str | list[str]
    model: str | None = None  # accepted as OpenAI clients send it; the server has one model
    encoding_format: Literal["float", "base64"] = "float"  # OpenAI's clients ask for base64
    user: str | None = None
    normalize: bool = True  # unit-length vectors (L2), as `attnlab embed --normalize`
    truncate: bool = True  # cut a text past the model's length (false: refuse it)


class FillMaskRequest(Body):
    """Texts with one or more [MASK]."""

    input: str | list[str]
    top_k: int = 5
    truncate: bool = True


class ClassifyRequest(Body):
    """Texts, and for a sentence-pair model the second text of each."""

    input: str | list[str]
    pair: str | list[str] | None = None
    truncate: bool = True


class NerRequest(Body):
    """Texts (split at spaces into words) or sentences given as lists of words."""

    input: str | list[str] | list[list[str]]
    truncate: bool = True


class Question(Body):
    """A question and the passage that answers it."""

    question: str
    context: str


class QARequest(Body):
    """One question or a list of them; long passages are read in windows, never cut."""

    input: Question | list[Question]


class TranslateRequest(Body):
    """Source sentences and the search, as `attnlab translate`'s flags."""

    input: str | list[str]
    beam: int = _SEARCH.beam_size
    greedy: bool = False  # beam 1
    length_penalty: float = _SEARCH.length_penalty
    max_len_a: float = _SEARCH.max_len_a
    max_len_b: float = _SEARCH.max_len_b
    truncate: bool = True


class CompletionsRequest(Body):
    """OpenAI's completions request; temperature 0 is greedy search, top_k is attnlab's."""

    prompt: str | list[str]
    model: str | None = None
    max_tokens: int = 16  # OpenAI's default
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    n: int = 1
    stream: bool = False
    stop: str | None = None
    seed: int | None = None  # the same seed, prompts and settings give the same text
    user: str | None = None


class AttentionRequest(Body):
    """A text to look inside, as `attnlab attention` takes it."""

    text: str
    pair: str | None = None  # BERT: segment B
    target: str | None = None  # translation: the decoder's input (default: its own translation)
    layers: list[int] | None = None  # the model's layer numbers to keep (default all)
    heads: list[int] | None = None
    truncate: bool = False
