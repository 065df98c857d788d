"""Greedy and beam search over the encoder-decoder Transformer (Vaswani et al. 2017, section 6.1).

The paper decodes with beam size 4 and length penalty alpha = 0.6, "terminating early when
possible". Both searches here are batched and incremental: the encoder runs once, the
cross-attention keys/values of each source are computed once (at the first step) and kept in
the KV cache (decode/cache.py), and each step feeds the decoder only the newest token.
``use_cache=False`` re-runs the decoder over the whole prefix each step: the reference path,
tested equal.

Lengths: each sentence may emit at most ``max_len = int(a * src_len + b)`` tokens (its own
source length, not the batch's padded one) before an end-of-sentence token is forced.
Returned ids carry no bos/eos/pad.

Beam search scores a hypothesis by its summed log-probability divided by GNMT's length penalty
``lp(L) = ((5 + L) / 6) ** alpha`` (Wu et al. 2016, eq. 14), L counting the eos token: the
paper's alpha = 0.6 was tuned for that formula (``L ** alpha`` would penalise differently).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.decode.cache import KVCache
from attnlab.decode.options import SearchOptions
from attnlab.errors import check_token_batch
from attnlab.models.seq2seq import Transformer
from attnlab.nn.mode import eval_mode


def gnmt_length_penalty(length: Tensor | float, alpha: float) -> Tensor | float:
    """GNMT's lp(L) = ((5 + L) / 6) ** alpha; a hypothesis scores log P(y) / lp(|y|)."""
    return ((5.0 + length) / 6.0) ** alpha


def search_options(options: SearchOptions | None, overrides: dict[str, Any]) -> SearchOptions:
    """options (default SearchOptions()) with the fields named in overrides replaced, checked."""
    return replace(options or SearchOptions(), **overrides)


@contextmanager
def decoding(model: Transformer) -> Iterator[None]:
    """Evaluation mode (no dropout) without autograd inside the block; the caller's mode after."""
    with eval_mode(model), torch.inference_mode():
        yield


def _prepare(
    model: Transformer, src_ids: Tensor, src_mask: Tensor | None, options: SearchOptions
) -> tuple[Tensor, Tensor]:
    """The source mask (batch, src_len) and each sentence's max output length (batch,)."""
    check_token_batch(src_ids, "src_ids", src_mask=src_mask)
    if src_mask is None:
        src_mask = src_ids != model.config.pad_id
    src_mask = src_mask.to(torch.bool)
    # The last step reads positions 0..max_len (bos + max_len tokens). Clamped before the
    # cast: a huge a or b would overflow int64 (to the minimum, clamped to 0: empty outputs).
    lengths = src_mask.sum(-1).double()
    max_lens = (options.max_len_a * lengths + options.max_len_b).clamp(
        0, model.config.max_positions - 1
    )
    return src_mask, max_lens.long()


def _banned_tokens(model: Transformer) -> list[int]:
    # pad and bos are never outputs; blocking them keeps every search on real sentences.
    return sorted({model.config.pad_id, model.config.bos_id} - {model.config.eos_id})


def _strip(row: list[int], eos_id: int) -> list[int]:
    return row[: row.index(eos_id)] if eos_id in row else row


# --- greedy search -----------------------------------------------------------------------------


def greedy_search(
    model: Transformer,
    src_ids: Tensor,
    src_mask: Tensor | None = None,
    options: SearchOptions | None = None,
    **overrides: Any,
) -> list[list[int]]:
    """The most probable next token at every step, for each source sentence (batch, src_len).

    ``overrides`` replace fields of ``options`` (SearchOptions), e.g. ``max_len_b=20``.
    """
    options = search_options(options, overrides)
    cfg = model.config
    with decoding(model):
        src_mask, max_lens = _prepare(model, src_ids, src_mask, options)
        memory = model.encode(src_ids, src_mask)
        banned = _banned_tokens(model)
        rows = torch.arange(src_ids.shape[0], device=src_ids.device)  # sentence of each live row
        tokens = torch.full((len(rows), 1), cfg.bos_id, device=src_ids.device)  # (live, t + 1)
        outputs: list[list[int]] = [[] for _ in range(len(rows))]
        cache = KVCache(cfg.n_decoder_layers) if options.use_cache else None
        step = 0
        while len(rows):
            new = tokens[:, -1:] if cache is not None else tokens
            logits = model.decode(new, memory, src_mask, cache)[:, -1]  # (live, vocab)
            logits[:, banned] = float("-inf")
            next_token = logits.argmax(-1)
            next_token.masked_fill_(step >= max_lens, cfg.eos_id)  # out of length: end here
            tokens = torch.cat((tokens, next_token.unsqueeze(1)), 1)
            ended = next_token == cfg.eos_id
            if bool(ended.any()):
                for row, ids in zip(
                    rows[ended].tolist(), tokens[ended, 1:-1].tolist(), strict=True
                ):
                    outputs[row] = ids
                # Drop finished sentences so later steps compute only live ones.
                live = (~ended).nonzero().squeeze(1)
                rows, tokens, max_lens = rows[live], tokens[live], max_lens[live]
                memory, src_mask = memory[live], src_mask[live]
                if cache is not None:
                    cache.reorder(live, live)
            step += 1
        return outputs


# --- beam search: the bookkeeping --------------------------------------------------------------


def top_k_rows(x: Tensor, k: int, chunk: int = 64) -> tuple[Tensor, Tensor]:
    """The k largest values of each row of x (rows, n) and their indices, as ``x.topk(k, -1)``.

    A vocabulary-wide top-k costs a selection pass over every logit. Here each row is cut
    into chunks of ``chunk`` values and only the k chunks with the largest maxima are searched:
    a value among the k largest lies in such a chunk (otherwise k chunks each hold a larger
    value). The row's tail that fills no whole chunk is always searched. Ties may pick
    different indices than ``topk``; the values are the same.
    """
    rows, n = x.shape
    whole = n - n % chunk
    if whole // chunk <= k:  # too few chunks to skip any
        return x.topk(k, dim=-1)
    chunk_max = x[:, :whole].view(rows, whole // chunk, chunk).amax(-1)  # (rows, n // chunk)
    best_chunks = chunk_max.topk(k, dim=-1).indices  # (rows, k)
    offsets = torch.arange(chunk, device=x.device)
    index = (best_chunks.unsqueeze(-1) * chunk + offsets).view(rows, k * chunk)
    if whole < n:
        index = torch.cat((index, torch.arange(whole, n, device=x.device).expand(rows, -1)), 1)
    values, where = x.gather(1, index).topk(k, dim=-1)
    return values, index.gather(1, where)


def keep_rows(parent: Tensor) -> Tensor:
    """The beam slot (n, k) each new beam takes, given its parent's slot (n, k): a permutation.

    The first child of each parent takes its parent's slot, so its cached keys/values stay
    where they are; the other children take, in order, the slots of parents that left no
    child. Only those need copying.
    """
    k = parent.shape[1]
    earlier = torch.ones(k, k, dtype=torch.bool, device=parent.device).tril(-1)
    later_child = ((parent.unsqueeze(2) == parent.unsqueeze(1)) & earlier).any(2)  # (n, k)
    has_child = torch.zeros_like(later_child).scatter_(1, parent, True)
    free = has_child.to(torch.uint8).argsort(dim=1, stable=True)  # childless slots first
    nth_later = (later_child.long().cumsum(1) - 1).clamp(min=0)
    return torch.where(later_child, free.gather(1, nth_later), parent)


@dataclass
class _Beams:
    """The live sentences of a beam search and their beams; row = sentence * beams + beam.

    All beams start as the same "<bos>", so step 0 has one row per sentence; from step 1 on
    there are k rows per sentence. The source (memory, src_mask) keeps one row per sentence,
    shared by its beams.
    """

    sent: Tensor  # (n,) original index of each live sentence
    tokens: Tensor  # (n * beams, t + 1)
    scores: Tensor  # (n, beams) summed log-probabilities; -inf for no beam
    max_lens: Tensor  # (n,)
    memory: Tensor  # (n, src_len, d_model)
    src_mask: Tensor  # (n, src_len)
    cache: KVCache | None


@dataclass
class _Finished:
    """Per original sentence: how many hypotheses ended, the best one's score and tokens."""

    count: Tensor  # (sentences,)
    best_score: Tensor  # (sentences,)
    best_tokens: Tensor  # (sentences, longest + 2): bos, tokens, eos, pad
    pad_id: int


@dataclass
class _Candidates:
    """The 2k best extensions of each sentence's beams, best first: (n, 2k) each."""

    scores: Tensor
    from_beam: Tensor
    token: Tensor


def _next_log_probs(model: Transformer, beams: _Beams, banned: list[int], step: int) -> Tensor:
    """log p(next token) of every live beam (n * beams, vocab); eos forced at the length limit."""
    eos = model.config.eos_id
    new = beams.tokens[:, -1:] if beams.cache is not None else beams.tokens
    logits = model.decode(new, beams.memory, beams.src_mask, beams.cache)[:, -1]
    logits = logits.float().contiguous()
    # In place: a second (n * beams, vocab) array would be more memory traffic every step.
    logp = torch.log_softmax(logits, -1, out=logits)
    logp[:, banned] = float("-inf")
    at_max = step >= beams.max_lens  # (n,): these must end now
    if bool(at_max.any()):
        rows_at_max = at_max.repeat_interleave(beams.scores.shape[1])
        eos_logp = logp[:, eos].clone()
        logp[rows_at_max] = float("-inf")
        logp[:, eos] = eos_logp
    return logp


def _best_candidates(logp: Tensor, scores: Tensor, k: int, pad_id: int) -> _Candidates:
    """Each sentence's 2k best (beam, token) extensions from the beams' log-probabilities."""
    n, beams = scores.shape
    # Only a beam's 2k best tokens can be among its sentence's 2k best candidates: one
    # top-k per beam, then one over the k * 2k survivors (not one over k * vocab).
    width = min(2 * k, logp.shape[-1])
    beam_top, beam_token = top_k_rows(logp, width)  # (n * beams, width)
    candidates = (scores.view(-1, 1) + beam_top).view(n, beams * width)
    beam_token = beam_token.view(n, beams * width)
    if candidates.shape[1] < 2 * k:  # step 0 over a vocabulary smaller than 2k
        short = 2 * k - candidates.shape[1]
        candidates = F.pad(candidates, (0, short), value=float("-inf"))
        beam_token = F.pad(beam_token, (0, short), value=pad_id)
    top_scores, pick = candidates.topk(2 * k, dim=1)  # (n, 2k), best first
    from_beam = (pick // width).clamp(max=beams - 1)
    return _Candidates(top_scores, from_beam, beam_token.gather(1, pick))


def _record_finished(
    beams: _Beams, cand: _Candidates, done: _Finished, k: int, alpha: float, eos: int, step: int
) -> None:
    """Eos candidates among the first k ranks end; keep each sentence's best hypothesis."""
    ranks = torch.arange(2 * k, device=cand.scores.device)
    ends = (cand.token == eos) & (ranks < k) & (cand.scores > float("-inf"))
    done.count[beams.sent] += ends.sum(1)
    normalised = cand.scores / gnmt_length_penalty(step + 1, alpha)  # length incl. eos
    normalised = normalised.masked_fill(~ends, float("-inf"))
    cand_best, cand_rank = normalised.max(1)  # (n,)
    improved = cand_best > done.best_score[beams.sent]
    if bool(improved.any()):
        which = improved.nonzero().squeeze(1)
        rows = which * beams.scores.shape[1] + cand.from_beam[which, cand_rank[which]]
        sent = beams.sent[which]
        done.best_score[sent] = cand_best[which]
        done.best_tokens[sent] = done.pad_id
        done.best_tokens[sent, : step + 1] = beams.tokens[rows]
        done.best_tokens[sent, step + 1] = eos


def _advance(beams: _Beams, cand: _Candidates, k: int, eos: int) -> None:
    """The k best candidates that do not end become the beams; the cache follows them."""
    n, width = beams.scores.shape
    ranks = torch.arange(2 * k, device=cand.scores.device)
    is_eos = cand.token == eos
    order = (is_eos.long() * 2 * k + ranks).argsort(dim=1)[:, :k]  # (n, k), eos ones last
    parent = cand.from_beam.gather(1, order)
    if width == k:  # each surviving beam keeps its row: only dead beams' rows change
        by_row = keep_rows(parent).argsort(dim=1)
        order, parent = order.gather(1, by_row), parent.gather(1, by_row)
    scores = cand.scores.gather(1, order)
    beams.scores = scores.masked_fill(is_eos.gather(1, order), float("-inf"))
    rows = (torch.arange(n, device=parent.device).unsqueeze(1) * width + parent).view(-1)
    previous = beams.tokens
    beams.tokens = torch.cat((previous[rows], cand.token.gather(1, order).view(-1, 1)), 1)
    if beams.cache is None:
        return
    if width == k:  # beams stay within their sentence: the source rows are unchanged
        moved = rows != torch.arange(n * k, device=rows.device)
        dst, src = moved.nonzero().squeeze(1), rows[moved]
        # Copy each moved row only from where its old and new prefixes differ.
        shared = (previous[dst] == previous[src]).cumprod(1).sum(1)
        beams.cache.copy_rows(dst, src, start=shared)
    else:
        beams.cache.reorder(rows)


def _drop_done(beams: _Beams, done: _Finished, k: int, alpha: float, step: int) -> None:
    """Remove the sentences that have k finished hypotheses or cannot improve their best.

    Log-probabilities are <= 0, so a beam of score s ends at best with s / lp(max_len + 1)
    (for alpha >= 0; with alpha < 0, at the next step).
    """
    best_live = beams.scores.max(1).values  # (n,)
    longest = (beams.max_lens + 1).to(best_live.dtype) if alpha >= 0 else float(step + 2)
    bound = best_live / gnmt_length_penalty(longest, alpha)
    stop = (
        (done.count[beams.sent] >= k)
        | (done.best_score[beams.sent] >= bound)
        | (best_live == float("-inf"))
    )
    if not bool(stop.any()):
        return
    live = (~stop).nonzero().squeeze(1)
    beam_rows = (live.unsqueeze(1) * k + torch.arange(k, device=live.device)).view(-1)
    beams.sent, beams.scores, beams.max_lens = (
        beams.sent[live],
        beams.scores[live],
        beams.max_lens[live],
    )
    beams.tokens, beams.memory = beams.tokens[beam_rows], beams.memory[live]
    beams.src_mask = beams.src_mask[live]
    if beams.cache is not None:
        beams.cache.reorder(beam_rows, live)


# --- beam search -------------------------------------------------------------------------------


def beam_search(
    model: Transformer,
    src_ids: Tensor,
    src_mask: Tensor | None = None,
    options: SearchOptions | None = None,
    **overrides: Any,
) -> list[list[int]]:
    """The best hypothesis of a width-beam_size search for each source sentence (batch, src_len).

    Each step extends every live beam by every token, keeps the 2k best candidates (k =
    beam_size) of each sentence, moves those ending in eos and ranked among the first k to
    the sentence's finished hypotheses, and continues with the k best that do not end. A
    sentence stops when k hypotheses have ended (the beam's budget, as in fairseq and Marian),
    or when no live beam can beat its best finished one any more. The search stops when every
    sentence has. ``overrides`` replace fields of ``options`` (SearchOptions).
    """
    options = search_options(options, overrides)
    if len(src_ids) == 0:
        return []
    cfg, k, alpha = model.config, options.beam_size, options.length_penalty
    with decoding(model):
        src_mask, max_lens = _prepare(model, src_ids, src_mask, options)
        device, n_sent = src_ids.device, src_ids.shape[0]
        beams = _Beams(
            sent=torch.arange(n_sent, device=device),
            tokens=torch.full((n_sent, 1), cfg.bos_id, device=device),
            scores=torch.zeros(n_sent, 1, device=device),
            max_lens=max_lens,
            memory=model.encode(src_ids, src_mask),  # once per source, not copied per beam
            src_mask=src_mask,
            cache=KVCache(cfg.n_decoder_layers) if options.use_cache else None,
        )
        longest = int(max_lens.max()) + 2
        done = _Finished(
            count=torch.zeros(n_sent, dtype=torch.long, device=device),
            best_score=torch.full((n_sent,), float("-inf"), device=device),
            best_tokens=torch.full((n_sent, longest), cfg.pad_id, dtype=torch.long, device=device),
            pad_id=cfg.pad_id,
        )
        banned, step = _banned_tokens(model), 0
        while len(beams.sent):
            logp = _next_log_probs(model, beams, banned, step)
            cand = _best_candidates(logp, beams.scores, k, cfg.pad_id)
            _record_finished(beams, cand, done, k, alpha, cfg.eos_id, step)
            _advance(beams, cand, k, cfg.eos_id)
            _drop_done(beams, done, k, alpha, step)
            step += 1
        return [_strip(row[1:], cfg.eos_id) for row in done.best_tokens.tolist()]


def translate_ids(
    model: Transformer,
    src_ids: Tensor,
    src_mask: Tensor | None = None,
    options: SearchOptions | None = None,
    **overrides: Any,
) -> list[list[int]]:
    """Greedy search when beam_size is 1 (the same result, less bookkeeping), else beam search."""
    options = search_options(options, overrides)
    search = greedy_search if options.beam_size == 1 else beam_search
    return search(model, src_ids, src_mask, options)
