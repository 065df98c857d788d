"""Greedy and beam search over the encoder-decoder Transformer (Vaswani et al. 2017, section 6.1).

The paper decodes with beam size 4 and length penalty alpha = 0.6, "terminating early when
possible". Both searches here are batched and incremental: the encoder runs once, the
cross-attention keys/values of each source are computed once (at the first step) and kept in
the KV cache, and each step feeds the decoder only the newest token. ``use_cache=False``
re-runs the decoder over the whole prefix each step: the reference path, tested equal.

Lengths: each sentence may emit at most ``max_len = int(a * src_len + b)`` tokens (its own
source length, not the batch's padded one) before an end-of-sentence token is forced.
Returned ids carry no bos/eos/pad.

Beam search scores a hypothesis by its summed log-probability divided by GNMT's length penalty
``lp(L) = ((5 + L) / 6) ** alpha`` (Wu et al. 2016, eq. 14), L counting the eos token: the
paper's alpha = 0.6 was tuned for that formula (``L ** alpha`` would penalise differently).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.errors import AttnlabError, check_token_batch
from attnlab.models.seq2seq import Transformer
from attnlab.decode.cache import KVCache
from attnlab.nn.mode import eval_mode

Batch = TypeVar("Batch")
Result = TypeVar("Result")


def gnmt_length_penalty(length: Tensor | float, alpha: float) -> Tensor | float:
    """GNMT's lp(L) = ((5 + L) / 6) ** alpha; a hypothesis scores log P(y) / lp(|y|)."""
    return ((5.0 + length) / 6.0) ** alpha


@contextmanager
def _eval_mode(model: Transformer) -> Iterator[None]:
    # Decoding must not drop out; restore the caller's mode afterwards (it may be training).
    # The weights are fixed while decoding, so the projections run on packed weights.
    with eval_mode(model), torch.inference_mode():
        yield


# GNMT's alpha is about 0.6-1 in practice; ((5 + L) / 6) ** alpha overflows a float (an
# OverflowError) from about alpha 100 at a thousand tokens.
MAX_LENGTH_PENALTY = 50.0
MAX_BEAM = 1024  # beyond any useful search; a larger one only runs out of memory


def check_search_options(
    beam_size: int, length_penalty: float, max_len_a: float, max_len_b: float
) -> None:
    """Refuse search settings that give no real sentences (named as the CLI's options)."""
    if not 1 <= beam_size <= MAX_BEAM:
        raise AttnlabError(f"--beam must be from 1 to {MAX_BEAM}, got {beam_size}")
    # A one-token source must be allowed one output token: a + b >= 1 (NaN fails every test).
    if not (0 <= max_len_a < math.inf and 0 <= max_len_b < math.inf and max_len_a + max_len_b >= 1):
        raise AttnlabError(
            f"--max-len-a and --max-len-b must be finite, >= 0 and sum to at least 1 "
            f"(got {max_len_a}, {max_len_b})"
        )
    if not -MAX_LENGTH_PENALTY <= length_penalty <= MAX_LENGTH_PENALTY:  # NaN fails too
        raise AttnlabError(
            f"--length-penalty must be from {-MAX_LENGTH_PENALTY} to {MAX_LENGTH_PENALTY}, "
            f"got {length_penalty}"
        )


def _prepare(
    model: Transformer, src_ids: Tensor, src_mask: Tensor | None, a: float, b: float
) -> tuple[Tensor, Tensor]:
    """The source mask (batch, src_len) and each sentence's max output length (batch,)."""
    check_token_batch(src_ids, "src_ids", src_mask=src_mask)
    if src_mask is None:
        src_mask = src_ids != model.config.pad_id
    src_mask = src_mask.to(torch.bool)
    # The last step reads positions 0..max_len (bos + max_len tokens). Clamped before the
    # cast: a huge a or b would overflow int64 (to the minimum, clamped to 0: empty outputs).
    max_lens = (a * src_mask.sum(-1).double() + b).clamp(0, model.config.max_positions - 1)
    return src_mask, max_lens.long()


def _banned_tokens(model: Transformer) -> list[int]:
    # pad and bos are never outputs; blocking them keeps every search on real sentences.
    return sorted({model.config.pad_id, model.config.bos_id} - {model.config.eos_id})


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


def _strip(row: list[int], eos_id: int) -> list[int]:
    return row[: row.index(eos_id)] if eos_id in row else row


def greedy_search(
    model: Transformer,
    src_ids: Tensor,
    src_mask: Tensor | None = None,
    max_len_a: float = 1.2,
    max_len_b: float = 10,
    use_cache: bool = True,
) -> list[list[int]]:
    """The most probable next token at every step, for each source sentence (batch, src_len)."""
    check_search_options(1, 0.0, max_len_a, max_len_b)
    cfg = model.config
    with _eval_mode(model):
        src_mask, max_lens = _prepare(model, src_ids, src_mask, max_len_a, max_len_b)
        memory = model.encode(src_ids, src_mask)
        banned = _banned_tokens(model)
        rows = torch.arange(src_ids.shape[0], device=src_ids.device)  # sentence of each live row
        tokens = torch.full((len(rows), 1), cfg.bos_id, device=src_ids.device)  # (live, t + 1)
        outputs: list[list[int]] = [[] for _ in range(len(rows))]
        cache = KVCache(model.config.n_decoder_layers) if use_cache else None
        step = 0
        while len(rows):
            new = tokens[:, -1:] if use_cache else tokens
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


def beam_search(
    model: Transformer,
    src_ids: Tensor,
    src_mask: Tensor | None = None,
    beam_size: int = 4,
    length_penalty: float = 0.6,
    max_len_a: float = 1.2,
    max_len_b: float = 10,
    use_cache: bool = True,
) -> list[list[int]]:
    """The best hypothesis of a width-beam_size search for each source sentence (batch, src_len).

    Each step extends every live beam by every token, keeps the 2k best candidates (k =
    beam_size) of each sentence, moves those ending in eos and ranked among the first k to
    the sentence's finished hypotheses, and continues with the k best that do not end. A
    sentence stops when k hypotheses have ended (the beam's budget, as in fairseq and Marian),
    or when no live beam can beat its best finished one any more: log-probabilities are <= 0,
    so a beam of score s ends at best with s / lp(max_len + 1) (for alpha >= 0). The search
    stops when every sentence has.
    """
    check_search_options(beam_size, length_penalty, max_len_a, max_len_b)
    if len(src_ids) == 0:
        return []
    cfg, k, alpha = model.config, beam_size, length_penalty
    with _eval_mode(model):
        src_mask, max_lens = _prepare(model, src_ids, src_mask, max_len_a, max_len_b)
        device, n_sent = src_ids.device, src_ids.shape[0]
        # Once per source, and not copied per beam: beams of a sentence sit next to each other
        # (row = sentence * k + beam), and cross-attention lets those k rows share one memory row.
        memory = model.encode(src_ids, src_mask)
        banned = _banned_tokens(model)
        sent = torch.arange(n_sent, device=device)  # original index of each live sentence
        # All beams start as the same "<bos>", so step 0 decodes one row per sentence; from
        # step 1 on there are k rows per sentence (row = sentence * k + beam).
        tokens = torch.full((n_sent, 1), cfg.bos_id, device=device)  # (n * beams, t + 1)
        scores = torch.zeros(n_sent, 1, device=device)  # (n, beams)
        n_finished = torch.zeros(n_sent, dtype=torch.long, device=device)
        best_score = torch.full((n_sent,), float("-inf"), device=device)
        best_tokens = torch.full(
            (n_sent, int(max_lens.max()) + 2), cfg.pad_id, dtype=torch.long, device=device
        )
        cache = KVCache(model.config.n_decoder_layers) if use_cache else None
        ranks = torch.arange(2 * k, device=device)
        step = 0
        while len(sent):
            n, beams = scores.shape
            new = tokens[:, -1:] if use_cache else tokens
            logits = model.decode(new, memory, src_mask, cache)[:, -1].float().contiguous()
            # In place: a second (n * beams, vocab) array is 4 MB more memory traffic a step at
            # 128 x 8,000 (whole searches 3-5% faster; tests check in place = out of place).
            logp = torch.log_softmax(logits, -1, out=logits)
            logp[:, banned] = float("-inf")
            at_max = step >= max_lens  # (n,): these must end now
            if bool(at_max.any()):
                rows_at_max = at_max.repeat_interleave(beams)
                eos_logp = logp[:, cfg.eos_id].clone()
                logp[rows_at_max] = float("-inf")
                logp[:, cfg.eos_id] = eos_logp
            # Only a beam's 2k best tokens can be among its sentence's 2k best candidates: one
            # top-k per beam, then one over the k * 2k survivors (not one over k * vocab).
            width = min(2 * k, logp.shape[-1])
            beam_top, beam_token = top_k_rows(logp, width)  # (n * beams, width)
            candidates = (scores.view(-1, 1) + beam_top).view(n, beams * width)
            beam_token = beam_token.view(n, beams * width)
            if candidates.shape[1] < 2 * k:  # step 0 over a vocabulary smaller than 2k
                short = 2 * k - candidates.shape[1]
                candidates = F.pad(candidates, (0, short), value=float("-inf"))
                beam_token = F.pad(beam_token, (0, short), value=cfg.pad_id)
            top_scores, pick = candidates.topk(2 * k, dim=1)  # (n, 2k), best first
            from_beam = (pick // width).clamp(max=beams - 1)
            token = beam_token.gather(1, pick)

            # Finished: eos candidates among the first k ranks (a real score, not -inf).
            is_eos = token == cfg.eos_id
            ends = is_eos & (ranks < k) & (top_scores > float("-inf"))
            n_finished[sent] += ends.sum(1)
            normalised = top_scores / gnmt_length_penalty(step + 1, alpha)  # length incl. eos
            normalised = normalised.masked_fill(~ends, float("-inf"))
            cand_best, cand_rank = normalised.max(1)  # (n,)
            improved = cand_best > best_score[sent]
            if bool(improved.any()):
                which = improved.nonzero().squeeze(1)
                rows = which * beams + from_beam[which, cand_rank[which]]
                best_score[sent[which]] = cand_best[which]
                best_tokens[sent[which]] = cfg.pad_id
                best_tokens[sent[which], : step + 1] = tokens[rows]
                best_tokens[sent[which], step + 1] = cfg.eos_id

            # Live: the k best candidates that do not end (stable order: eos ones sort last).
            order = (is_eos.long() * 2 * k + ranks).argsort(dim=1)[:, :k]  # (n, k)
            parent = from_beam.gather(1, order)
            if beams == k:  # each surviving beam keeps its row: only dead beams' rows change
                by_row = keep_rows(parent).argsort(dim=1)
                order, parent = order.gather(1, by_row), parent.gather(1, by_row)
            scores = top_scores.gather(1, order)
            scores = scores.masked_fill(is_eos.gather(1, order), float("-inf"))
            rows = (torch.arange(n, device=device).unsqueeze(1) * beams + parent).view(-1)
            previous = tokens
            tokens = torch.cat((tokens[rows], token.gather(1, order).view(-1, 1)), 1)
            if cache is not None:  # beams stay within their sentence: memory rows unchanged
                if beams == k:
                    moved = rows != torch.arange(n * k, device=device)
                    dst, src = moved.nonzero().squeeze(1), rows[moved]
                    # Copy each moved row only from where its old and new prefixes differ.
                    shared = (previous[dst] == previous[src]).cumprod(1).sum(1)
                    cache.copy_rows(dst, src, start=shared)
                else:
                    cache.reorder(rows)

            # Which sentences are done?
            best_live = scores.max(1).values  # (n,)
            bound = best_live / gnmt_length_penalty(
                (max_lens + 1).to(scores.dtype) if alpha >= 0 else float(step + 2), alpha
            )
            done = (
                (n_finished[sent] >= k) | (best_score[sent] >= bound) | (best_live == float("-inf"))
            )
            if bool(done.any()):
                live = (~done).nonzero().squeeze(1)
                beam_rows = (live.unsqueeze(1) * k + torch.arange(k, device=device)).view(-1)
                sent, scores, max_lens = sent[live], scores[live], max_lens[live]
                tokens, memory, src_mask = tokens[beam_rows], memory[live], src_mask[live]
                if cache is not None:
                    cache.reorder(beam_rows, live)
            step += 1
        return [_strip(row[1:], cfg.eos_id) for row in best_tokens.tolist()]


def translate_ids(
    model: Transformer,
    src_ids: Tensor,
    src_mask: Tensor | None = None,
    beam_size: int = 4,
    length_penalty: float = 0.6,
    max_len_a: float = 1.2,
    max_len_b: float = 10,
    use_cache: bool = True,
) -> list[list[int]]:
    """Greedy search when beam_size is 1 (the same result, less bookkeeping), else beam search."""
    if beam_size == 1:
        return greedy_search(model, src_ids, src_mask, max_len_a, max_len_b, use_cache)
    return beam_search(
        model, src_ids, src_mask, beam_size, length_penalty, max_len_a, max_len_b, use_cache
    )


def map_batches(
    fn: Callable[[Batch], Result], batches: Sequence[Batch], workers: int = 1
) -> list[Result]:
    """[fn(b) for b in batches], with up to ``workers`` batches in flight at once; results in order.

    A decoding step is many small operations, which a CPU's cores share poorly: on the 2-core
    benchmark machine one batch decodes ~1.6x faster on two threads than on one (RESULTS.md). Two
    batches at once, one thread each, keep both cores busy instead (as Marian's and
    CTranslate2's CPU translators do). The torch threads are split between the workers; each
    worker is a Python thread (torch releases the GIL inside its operations). Each batch's
    result is what fn gives on that many threads alone: decoding is deterministic per thread
    count, whatever runs beside it. There are at most as many workers as torch threads: more
    would only take turns on the cores (4 workers on 2 threads decoded 8-10% slower than 2,
    RESULTS.md).
    """
    if workers < 1:
        raise AttnlabError(f"workers must be at least 1, got {workers}")
    total = torch.get_num_threads()
    workers = min(workers, len(batches), total)
    if workers <= 1:
        return [fn(batch) for batch in batches]
    # The thread count is per OS thread: a new thread would otherwise use every core itself.
    try:
        with ThreadPoolExecutor(
            workers, initializer=torch.set_num_threads, initargs=(max(1, total // workers),)
        ) as pool:
            return list(pool.map(fn, batches))  # an error cancels the batches not started
    finally:  # torch also sets MKL's thread count, which is process-wide: set it back
        torch.set_num_threads(total)


def translate_batches(
    model: Transformer,
    batches: Sequence[tuple[Tensor, Tensor | None]],
    workers: int = 1,
    beam_size: int = 4,
    length_penalty: float = 0.6,
    max_len_a: float = 1.2,
    max_len_b: float = 10,
    use_cache: bool = True,
) -> list[list[list[int]]]:
    """translate_ids on each (src_ids, src_mask) batch, ``workers`` batches at a time (map_batches)."""

    def one(batch: tuple[Tensor, Tensor | None]) -> list[list[int]]:
        src_ids, src_mask = batch
        return translate_ids(
            model, src_ids, src_mask, beam_size, length_penalty, max_len_a, max_len_b, use_cache
        )

    # Eval mode and packed weights once, here: workers entering and leaving them on their own
    # would switch the shared model's mode under each other.
    with _eval_mode(model):
        return map_batches(one, batches, workers)
