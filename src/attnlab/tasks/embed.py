"""Sentence embeddings from a BERT encoder: [CLS] or mean pooling, batched without waste.

Speed comes from the batching: texts are sorted by token length and cut into batches by a
token budget, so padding stays near zero; results are written back in input order. The
encoder is asked for the rows pooling reads only (``keep``), so its fast twins compute no
padding either. The default budget (2,048 tokens) keeps each layer's activations (tokens x
d_ff floats) small enough to stay in cache and below glibc's 32 MB mmap threshold, so buffers
are reused instead of page-faulted in afresh every layer; larger budgets ran slower."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab import fast
from attnlab.errors import AttnlabError
from attnlab.io import json_safe, write_bytes_atomic, write_text_atomic
from attnlab.models.bert import BertForPreTraining, BertModel, cls_only
from attnlab.models.heads import mean_pool
from attnlab.nn.mode import eval_mode
from attnlab.text.tokenizer import BertTokenizer, Encoding

POOLINGS = ("mean", "cls", "none")


@dataclass
class Batch:
    """Padded model inputs for a set of original indices."""

    indices: list[int]
    input_ids: Tensor  # (batch, seq)
    attention_mask: Tensor  # (batch, seq)
    token_type_ids: Tensor  # (batch, seq)


def pad_batch(encodings: Sequence[Encoding], pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """(input_ids, attention_mask, token_type_ids), each (batch, longest), right-padded."""
    longest = max(len(e.ids) for e in encodings)
    ids = torch.full((len(encodings), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(encodings), longest), dtype=torch.long)
    types = torch.zeros((len(encodings), longest), dtype=torch.long)
    for row, enc in enumerate(encodings):
        n = len(enc.ids)
        ids[row, :n] = torch.tensor(enc.ids)
        mask[row, :n] = 1
        types[row, :n] = torch.tensor(enc.type_ids)
    return ids, mask, types


def length_batches(
    encodings: Sequence[Encoding], pad_id: int, max_tokens: int, max_batch: int
) -> list[Batch]:
    """Group encodings, longest first, into batches of at most max_tokens padded tokens and max_batch rows."""
    order = sorted(range(len(encodings)), key=lambda i: len(encodings[i].ids), reverse=True)
    batches: list[Batch] = []
    start = 0
    while start < len(order):
        longest = len(encodings[order[start]].ids)  # sorted: the first is the longest
        size = max(1, min(max_batch, max_tokens // max(longest, 1)))
        chosen = order[start : start + size]
        ids, mask, types = pad_batch([encodings[i] for i in chosen], pad_id)
        batches.append(Batch(chosen, ids, mask, types))
        start += size
    return batches


@torch.inference_mode()
def embed(
    model: BertModel | BertForPreTraining,
    tokenizer: BertTokenizer,
    texts: Sequence[str] | str,
    pooling: str = "mean",
    normalize: bool = False,
    max_length: int | None = None,
    max_tokens: int = 2048,
    max_batch: int = 128,
    truncate: bool = True,
    dtype: torch.dtype | None = None,
    on_truncate: Callable[[int], None] | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[Tensor]:
    """One vector per text (or one (tokens, d) matrix per text when pooling='none'), in input order.

    max_length defaults to the model's max_positions; longer texts are truncated (reported
    through on_truncate with the count) or, when truncate=False, an error naming the line.
    A single string is one text; a model with pretraining heads embeds with its encoder. The
    model runs in evaluation mode (no dropout) and is left in the mode it came in; the batches
    go to the model's device, where the vectors stay. progress(n) is told of each n texts done.
    """
    if isinstance(texts, str):
        texts = [texts]
    if isinstance(model, BertForPreTraining):
        model = model.bert
    max_length = _checked_max_length(model, tokenizer, pooling, max_length, max_tokens, max_batch)
    encodings = tokenizer.encode_batch(list(texts), max_length=max_length)
    truncated = [i for i, e in enumerate(encodings) if e.truncated]
    if truncated and not truncate:
        raise AttnlabError(
            f"input line {truncated[0] + 1} is longer than {max_length} tokens "
            "(drop --no-truncate to truncate it)"
        )
    if truncated and on_truncate is not None:
        on_truncate(len(truncated))
    results: list[Tensor | None] = [None] * len(encodings)
    device = next(model.parameters()).device  # the batches go where the model is (a GPU)
    # The inference twins (no layer computes padding) while it runs.
    with eval_mode(model), fast.inference_twins(model):
        for batch in length_batches(encodings, tokenizer.pad_id, max_tokens, max_batch):
            vectors = _embed_batch(model, batch, pooling, normalize, device, dtype)
            for index, vector in zip(batch.indices, vectors, strict=True):
                results[index] = vector
            if progress is not None:
                progress(len(batch.indices))
    return results  # type: ignore[return-value]


def _checked_max_length(
    model: BertModel,
    tokenizer: BertTokenizer,
    pooling: str,
    max_length: int | None,
    max_tokens: int,
    max_batch: int,
) -> int:
    """embed's max_length (the model's and tokenizer's limit when None), once its options pass."""
    if pooling not in POOLINGS:
        raise AttnlabError(f"unknown pooling {pooling!r} (choose from mean, cls, none)")
    for flag, value in (("max_batch", max_batch), ("max_tokens", max_tokens)):
        if value < 1:
            raise AttnlabError(f"{flag} must be at least 1, got {value}", options=(flag,))
    limit = model.config.max_positions
    if max_length is None:
        max_length = min(limit, tokenizer.max_length or limit)
    if max_length < 2:
        raise AttnlabError(f"--max-length must be at least 2 ([CLS] and [SEP]), got {max_length}")
    if max_length > limit:
        raise AttnlabError(f"--max-length {max_length} is above the model's maximum ({limit})")
    return max_length


def _embed_batch(
    model: BertModel,
    batch: Batch,
    pooling: str,
    normalize: bool,
    device: torch.device,
    dtype: torch.dtype | None,
) -> list[Tensor]:
    """The batch's vectors (pooled, or each text's (tokens, d) rows for pooling 'none'), in its order."""
    ids, mask, types = (
        t.to(device) for t in (batch.input_ids, batch.attention_mask, batch.token_type_ids)
    )
    # The positions pooling reads: [CLS] alone, or every real token. The encoder returns just
    # those rows, (count, d), and its fast twins compute nothing else (no padding).
    keep = cls_only(ids) if pooling == "cls" else mask.bool()
    with torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext():
        rows = model(ids, mask, types, keep=keep).last_hidden_state.float()
    if pooling == "cls":
        vectors = rows  # (batch, d)
    else:
        hidden = rows.new_zeros(*keep.shape, rows.shape[-1])  # (batch, seq, d), padding 0
        hidden[keep] = rows
        if pooling == "none":  # per-token vectors, each unit length with normalize
            hidden = F.normalize(hidden, dim=-1) if normalize else hidden
            lengths = batch.attention_mask.sum(1).tolist()
            return [hidden[row, :n].clone() for row, n in enumerate(lengths)]
        vectors = mean_pool(hidden, mask)
    if normalize:
        vectors = F.normalize(vectors, dim=-1)
    return list(vectors)


# ---------------------------------------------------------------------------- output files

OUTPUT_SUFFIXES = (".npy", ".jsonl", ".safetensors")


def check_output_suffix(path: str | Path, pooling: str = "mean") -> None:
    """Refuse an output file whose suffix names no format write_embeddings writes for pooling."""
    suffix = Path(path).suffix.lower()
    if suffix not in OUTPUT_SUFFIXES:
        raise AttnlabError(
            f"output {path}: unknown format {suffix or '(no suffix)'!r}: name a .npy, .jsonl or "
            ".safetensors file",
            options=("output",),
        )
    if suffix == ".npy" and pooling == "none":
        raise AttnlabError(
            f"output {path}: pooling none gives each line its own number of token vectors, "
            "which one .npy array cannot hold: write .jsonl or .safetensors",
            options=("output", "pooling"),
        )


def json_line(vector: Tensor) -> str:
    """A vector (or per-token matrix) as one line of strict JSON, 7 decimals, NaN as null."""
    rows = vector.float().cpu().tolist()
    if vector.dim() == 1:
        rounded = [round(v, 7) for v in rows]
    else:
        rounded = [[round(v, 7) for v in row] for row in rows]
    return json.dumps(json_safe(rounded), allow_nan=False) + "\n"


def write_embeddings(vectors: Sequence[Tensor], path: str | Path, width: int) -> None:
    """Write embed's vectors to path atomically, in the format its suffix names.

    .npy: a float32 (lines, width) array, row i for input line i. .jsonl: the JSON lines the
    command prints. .safetensors: "embeddings" (lines, width) float32; with pooling 'none',
    "tokens" (all tokens, width) and "offsets" (lines + 1,) int64, line i's vectors being
    tokens[offsets[i]:offsets[i + 1]].
    """
    path = Path(path)
    suffix = path.suffix.lower()
    per_token = any(v.dim() == 2 for v in vectors)
    check_output_suffix(path, "none" if per_token else "mean")
    if suffix == ".jsonl":
        write_text_atomic(path, "".join(json_line(v) for v in vectors))
        return
    rows = [v.detach().float().cpu() for v in vectors]
    stacked = torch.cat(rows) if per_token else torch.stack(rows) if rows else None
    if stacked is None:
        stacked = torch.zeros(0, width)
    if suffix == ".npy":
        buffer = io.BytesIO()
        np.save(buffer, stacked.numpy().astype(np.float32, copy=False), allow_pickle=False)
        write_bytes_atomic(path, buffer.getvalue())
        return
    if per_token:
        lengths = torch.tensor([0] + [len(r) for r in rows], dtype=torch.int64)
        tensors = {"tokens": stacked.contiguous(), "offsets": lengths.cumsum(0)}
    else:
        tensors = {"embeddings": stacked.contiguous()}
    write_bytes_atomic(path, safetensors.torch.save(tensors))
