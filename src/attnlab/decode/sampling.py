"""Autoregressive generation from a decoder-only LM: greedy, temperature, top-k, nucleus (top-p).

At each step the model reads only the newest token (its past keys and values are cached),
the last position's logits z become a distribution, and one token is drawn from it:

- greedy: argmax z;
- sampling: softmax(z / T) (temperature T), after two optional filters, in HF's order:
  top-k keeps the k largest logits (Fan et al. 2018); top-p, the nucleus (Holtzman et al.
  2020), keeps the smallest set of most likely tokens whose probability reaches p.

Left-padded batches (``attention_mask`` 0 at the pads) let prompts of different lengths
continue together; a row that emits ``eos_id`` is finished and gets ``pad_id`` after it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

from attnlab.errors import AttnlabError, check_token_batch


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """logits (batch, vocab) with all but the k largest of each row set to -inf (ties kept)."""
    k = min(k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, -math.inf)


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """logits (batch, vocab) keeping each row's nucleus: the fewest most likely tokens whose
    probability sums to at least p (always the most likely one); the rest set to -inf."""
    if p >= 1.0:
        return logits
    probs, order = torch.softmax(logits.float(), dim=-1).sort(dim=-1, descending=True)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the more likely tokens
    drop_sorted = mass_before >= p  # the set already reached p without this token
    drop_sorted[..., 0] = False
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, -math.inf)


def check_options(
    max_new_tokens: int,
    do_sample: bool,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
) -> None:
    """Refuse generation options outside their ranges, naming them as ``generate`` does."""
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or max_new_tokens < 0
    ):
        raise AttnlabError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if not do_sample:
        return
    if not (
        isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0
    ):
        raise AttnlabError(
            f"temperature must be a finite number > 0 when sampling, got {temperature!r}"
        )
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise AttnlabError(f"top_k must be an integer >= 1, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        raise AttnlabError(f"top_p must be in (0, 1], got {top_p!r}")


def next_tokens(
    logits: Tensor,
    do_sample: bool,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """One token per row from the last position's logits (batch, vocab) -> (batch,)."""
    if not do_sample:
        return logits.argmax(dim=-1)
    scores = logits.float() / temperature
    if top_k is not None:
        scores = top_k_filter(scores, top_k)
    if top_p is not None:
        scores = top_p_filter(scores, top_p)
    probs = torch.softmax(scores, dim=-1)
    if generator is not None and generator.device != probs.device:
        # draw where the generator lives: the same seed gives the same tokens on any device
        drawn = torch.multinomial(probs.to(generator.device), 1, generator=generator)
        return drawn.squeeze(-1).to(probs.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _check_prompts(
    model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor | None, max_new_tokens: int
) -> None:
    """Refuse empty, right-padded or too long prompts."""
    check_token_batch(input_ids, "input_ids", attention_mask=attention_mask)
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise AttnlabError("input_ids must hold at least one prompt token per row")
    context = model.config.max_positions
    if input_ids.shape[1] > context:
        raise AttnlabError(
            f"the prompt has {input_ids.shape[1]} tokens, more than the model's context of "
            f"{context}: shorten it (keep its last tokens)"
        )
    if input_ids.shape[1] + max_new_tokens > context:
        raise AttnlabError(
            f"max_new_tokens {max_new_tokens} after a prompt of {input_ids.shape[1]} tokens "
            f"goes past the model's context of {context}"
        )
    if attention_mask is not None:
        mask = attention_mask.long()
        if not bool(((mask == 0) | (mask == 1)).all()) or not bool(mask[:, -1].all()):
            raise AttnlabError("attention_mask must be 0/1 and 1 at every row's last token")
        if not bool((mask[:, 1:] >= mask[:, :-1]).all()):
            raise AttnlabError("prompts must be left-padded: attention_mask 0s before the 1s")


@torch.inference_mode()
def generate(
    model: torch.nn.Module,
    input_ids: Tensor,
    max_new_tokens: int,
    *,
    attention_mask: Tensor | None = None,
    do_sample: bool = True,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    pad_id: int | None = None,
    generator: torch.Generator | None = None,
    on_token: Callable[[int, Tensor], None] | None = None,
) -> Tensor:
    """Continue each prompt of input_ids (batch, seq): returns (batch, seq + new) token ids.

    Greedy when do_sample is False (temperature, top_k and top_p then unused). Prompts of
    different lengths are left-padded with attention_mask 0 at the pads. A row that emits
    eos_id is finished: its later tokens are pad_id (eos_id when pad_id is None); the loop
    ends early when every row is finished. ``on_token(step, tokens)`` sees each step's
    tokens (batch,) as they are made (for streaming). The model runs in eval mode.
    """
    check_options(max_new_tokens, do_sample, temperature, top_k, top_p)
    _check_prompts(model, input_ids, attention_mask, max_new_tokens)
    vocab = model.config.vocab_size
    for name, value in (("eos_id", eos_id), ("pad_id", pad_id)):
        if value is not None and not 0 <= value < vocab:
            raise AttnlabError(f"{name} {value} is outside the vocabulary (vocab_size {vocab})")
    choose = functools.partial(
        next_tokens,
        do_sample=do_sample,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        generator=generator,
    )
    was_training = model.training
    model.eval()
    try:
        return _decode(model, input_ids, max_new_tokens, attention_mask, choose, eos_id, pad_id,
                       on_token)  # fmt: skip
    finally:
        model.train(was_training)


def _decode(
    model: torch.nn.Module,
    input_ids: Tensor,
    max_new_tokens: int,
    attention_mask: Tensor | None,
    choose: Callable[[Tensor], Tensor],
    eos_id: int | None,
    pad_id: int | None,
    on_token: Callable[[int, Tensor], None] | None,
) -> Tensor:
    """generate's loop over steps, its arguments checked; choose maps logits to tokens."""
    rows = input_ids.shape[0]
    finished = torch.zeros(rows, dtype=torch.bool, device=input_ids.device)
    filler = pad_id if pad_id is not None else eos_id
    cache = model.new_cache()
    tokens, step_mask = input_ids, attention_mask
    new: list[Tensor] = []
    for step in range(max_new_tokens):
        out = model(tokens, cache=cache, attention_mask=step_mask, last_only=True)
        chosen = choose(out.logits[:, -1])
        if eos_id is not None:
            chosen = chosen.masked_fill(finished, filler)
            finished = finished | (chosen == eos_id)
        new.append(chosen)
        if on_token is not None:
            on_token(step, chosen)
        if eos_id is not None and bool(finished.all()):
            break
        tokens = chosen.unsqueeze(1)
        step_mask = None  # new tokens are real; the cache holds the prompts' padding mask
    if not new:
        return input_ids.clone()
    return torch.cat([input_ids, torch.stack(new, dim=1)], dim=1)
