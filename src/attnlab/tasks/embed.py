"""Sentence embeddings from a BERT encoder: [CLS] or mean pooling, batched without waste.

Speed comes from the batching, not from the model: texts are sorted by token length and cut
into batches by a token budget, so padding stays near zero; results are written back in input
order. The default budget (2,048 tokens) is measured, not guessed: it keeps each layer's
activations (tokens x d_ff floats) small enough to stay in cache and below glibc's 32 MB mmap
threshold, so buffers are reused instead of page-faulted in afresh every layer; 8,192-token
batches ran about 25% slower on the benchmark machine (bench/RESULTS.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab import fast
from attnlab.errors import AttnlabError
from attnlab.models.bert import BertForPreTraining, BertModel, cls_only
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


def mean_pool(hidden: Tensor, attention_mask: Tensor) -> Tensor:
    """(batch, seq, d) -> (batch, d): the mean over real (unpadded) tokens."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)


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
    go to the model's device, where the vectors stay.
    """
    if isinstance(texts, str):
        texts = [texts]
    if isinstance(model, BertForPreTraining):
        model = model.bert
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
    autocast = torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext()
    # The inference twins (fp32: weights packed once for every batch) while it runs.
    with eval_mode(model), fast.inference_twins(model):
        for batch in length_batches(encodings, tokenizer.pad_id, max_tokens, max_batch):
            ids, mask, types = (
                t.to(device) for t in (batch.input_ids, batch.attention_mask, batch.token_type_ids)
            )
            # [CLS] pooling reads one row, so the last layer computes only that row.
            keep = cls_only(ids) if pooling == "cls" else None
            with autocast:
                out = model(ids, mask, types, keep=keep)
            hidden = out.last_hidden_state.float()  # (batch, d) with keep
            if pooling == "none":  # per-token vectors, each unit length with normalize
                rows = F.normalize(hidden, dim=-1) if normalize else hidden
                for row, index in enumerate(batch.indices):
                    results[index] = rows[row, : int(batch.attention_mask[row].sum())].clone()
            else:
                vectors = hidden if keep is not None else mean_pool(hidden, mask)
                if normalize:
                    vectors = F.normalize(vectors, dim=-1)
                for row, index in enumerate(batch.indices):
                    results[index] = vectors[row]
            if progress is not None:
                progress(len(batch.indices))
    return results  # type: ignore[return-value]
