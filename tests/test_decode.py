"""Greedy and beam search (attnlab.decode): cached == uncached, beam 1 == greedy, beam search
against an exhaustive search, and a tiny model that learns to reverse and decodes exactly."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

from attnlab import decode, fast
from attnlab.config import TransformerConfig
from attnlab.decode import (
    SearchOptions,
    beam_search,
    gnmt_length_penalty,
    greedy_search,
    keep_rows,
    top_k_rows,
    translate_ids,
)
from attnlab.errors import AttnlabError
from attnlab.models.seq2seq import Transformer

PAD, BOS, EOS = 0, 1, 2


pytestmark = pytest.mark.usefixtures("one_thread")


def peaky_model(seed: int = 0, vocab: int = 15, **overrides) -> Transformer:
    """A random model whose next-token distributions are sharp and vary (as a trained one's do).

    An untied, scaled-up output projection spreads the logits; a raised eos logit makes
    sentences end at different steps instead of all running to the length limit.
    """
    args = dict(
        src_vocab_size=vocab,
        tgt_vocab_size=vocab,
        d_model=32,
        n_heads=4,
        d_ff=64,
        n_encoder_layers=2,
        n_decoder_layers=2,
        max_positions=64,
        tie_output=False,
        position_encoding="learned",
    )
    torch.manual_seed(seed)
    model = Transformer(TransformerConfig(**{**args, **overrides})).eval()
    with torch.no_grad():
        model.output_proj.weight.mul_(8.0)
        model.output_proj.weight[EOS] *= 0.3
        model.output_proj.weight[EOS] += 0.4 * model.output_proj.weight[3:].mean(0)
    return model


def sources(n: int = 6, vocab: int = 15, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """n right-padded sources of different lengths (1..8) and their mask."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (n,), generator=g)
    lengths[0] = 8
    src = torch.randint(3, vocab, (n, 8), generator=g)
    mask = torch.arange(8)[None] < lengths[:, None]
    return src.masked_fill(~mask, PAD), mask


def score(model: Transformer, src: torch.Tensor, ids: list[int], alpha: float) -> float:
    """log P(ids + eos | src) / lp(len + 1), from one teacher-forced pass (beam's scoring)."""
    tgt_in = torch.tensor([[BOS, *ids]])
    tgt_out = torch.tensor([[*ids, EOS]])
    with torch.no_grad():
        logits = model(src.unsqueeze(0), tgt_in)["logits"]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, tgt_out.unsqueeze(-1)).sum()
    return logp.item() / gnmt_length_penalty(len(ids) + 1, alpha)


@pytest.mark.parametrize(
    "norm_position, position_encoding",
    [
        ("post", "sinusoidal"), ("pre", "rope"), ("post", "learned"), ("pre", "relative_bias"),
        ("post", "alibi"), ("pre", "integer"), ("post", "none"),
    ],  # every scheme but the normalized baseline, whose codes change as the output grows
)  # fmt: skip
def test_cached_and_uncached_searches_agree(norm_position: str, position_encoding: str) -> None:
    model = peaky_model(norm_position=norm_position, position_encoding=position_encoding)
    src, mask = sources()
    greedy = greedy_search(model, src, mask)
    assert greedy == greedy_search(model, src, mask, use_cache=False)
    assert len({len(ids) for ids in greedy}) > 2  # sentences end at different steps
    beam = beam_search(model, src, mask, beam_size=4)
    assert beam == beam_search(model, src, mask, beam_size=4, use_cache=False)


@pytest.mark.parametrize(
    ("norm_position", "position_encoding"), [("post", "sinusoidal"), ("pre", "rope")]
)
def test_searches_with_the_fast_twins_equal_the_plain_model(
    norm_position: str, position_encoding: str
) -> None:
    # The inference twins (CPU attention routes, beams sharing their sentence's
    # cross-attention keys) find the same outputs as the plain model, with and without the
    # cache.
    model = peaky_model(norm_position=norm_position, position_encoding=position_encoding)
    src, mask = sources()
    greedy = greedy_search(model, src, mask)
    beam = beam_search(model, src, mask, beam_size=4)
    with fast.inference_twins(model):
        assert any(type(m).__name__.startswith("Fast") for m in model.modules())
        for use_cache in (True, False):
            assert greedy_search(model, src, mask, use_cache=use_cache) == greedy
            assert beam_search(model, src, mask, beam_size=4, use_cache=use_cache) == beam


def test_log_softmax_in_place_equals_out_of_place() -> None:
    # beam_search normalises the logits in place (out= the input): torch must read each row
    # before it writes it.
    x = torch.randn(130, 8003, generator=torch.Generator().manual_seed(0)) * 5
    x[3, 7:4000] = float("-inf")
    expected = torch.log_softmax(x, -1)
    assert torch.equal(torch.log_softmax(x, -1, out=x), expected) and torch.equal(x, expected)


@pytest.mark.parametrize("n", [640, 1000, 8003])
def test_chunked_top_k_equals_torch_topk(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(37, n, generator=g)
    x[0, :] = float("-inf")  # a row with nothing allowed but
    x[0, n - 1] = 0.0  # one value in the tail that fills no whole chunk
    x[1, 100:108] = 50.0 + torch.arange(8.0)  # the best values all in one or two chunks
    x[2, ::64] = 9.0 + torch.arange(len(range(0, n, 64))) / n  # each in a different chunk
    for k in (1, 8, 9):
        values, index = top_k_rows(x, k)
        expected = x.topk(k, dim=-1)
        assert torch.equal(values, expected.values)
        assert torch.equal(x.gather(1, index), values)
        assert all(len(set(row)) == k for row in index.tolist())


def test_beam_search_with_chunked_top_k_equals_plain_top_k(monkeypatch) -> None:
    # a vocabulary large enough for the chunked path (more chunks than 2 * beam)
    model = peaky_model(seed=5, vocab=700)
    src, mask = sources(vocab=700, seed=6)
    fast = beam_search(model, src, mask, beam_size=4)
    monkeypatch.setattr(decode.search, "top_k_rows", lambda x, k: x.topk(k, dim=-1))
    assert beam_search(model, src, mask, beam_size=4) == fast


def test_outputs_are_clean_and_within_each_sentences_length_limit() -> None:
    model = peaky_model(seed=3)
    src, mask = sources(seed=4)
    a, b = 0.5, 2
    limits = (a * mask.sum(-1) + b).long().tolist()
    greedy = greedy_search(model, src, mask, max_len_a=a, max_len_b=b)
    beam = beam_search(model, src, mask, beam_size=3, length_penalty=0.6, max_len_a=a, max_len_b=b)
    for out in (greedy, beam):
        for ids, limit in zip(out, limits, strict=True):
            assert len(ids) <= limit
            assert not {PAD, BOS, EOS} & set(ids)
    assert model.training is False
    model.train()
    greedy_search(model, src, mask)
    assert model.training  # the caller's mode is restored


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beam_size_one_is_greedy(seed: int) -> None:
    model = peaky_model(seed=seed)
    src, mask = sources(seed=seed + 10)
    greedy = greedy_search(model, src, mask)
    assert beam_search(model, src, mask, beam_size=1) == greedy
    assert translate_ids(model, src, mask, beam_size=1) == greedy


def test_map_batches_runs_workers_at_once_on_their_share_of_threads() -> None:
    both_running = threading.Barrier(2, timeout=30)  # broken if the batches ran one by one
    seen: list[int] = []

    def fn(i: int) -> int:
        if i < 2:
            both_running.wait()
        seen.append(torch.get_num_threads())
        return i * i

    torch.set_num_threads(4)
    try:
        assert decode.map_batches(fn, list(range(7)), workers=2) == [i * i for i in range(7)]
        assert seen == [2] * 7 and torch.get_num_threads() == 4
        seen.clear()
        assert decode.map_batches(fn, [5], workers=3) == [25]  # one batch: all threads
        assert seen == [4]
    finally:
        torch.set_num_threads(1)
    with pytest.raises(AttnlabError, match="workers must be at least 1"):
        decode.map_batches(fn, [5], workers=0)


def test_map_batches_runs_no_more_workers_than_threads() -> None:
    # Workers beyond the thread count would only take turns on the cores: at most 2 here.
    lock = threading.Lock()
    two_running = threading.Barrier(2, timeout=30)  # so at least two overlap, however slow
    running, most, seen = [0], [0], []

    def fn(i: int) -> int:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            seen.append(torch.get_num_threads())
        if i < 2:
            two_running.wait()
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        return -i

    torch.set_num_threads(2)
    try:
        assert decode.map_batches(fn, list(range(8)), workers=4) == [-i for i in range(8)]
    finally:
        torch.set_num_threads(1)
    assert most[0] == 2 and seen == [1] * 8


def test_map_batches_stops_at_an_error_without_running_the_rest() -> None:
    started: list[int] = []

    def fn(i: int) -> int:
        started.append(i)
        if i == 0:
            raise AttnlabError("batch 0 is bad")
        time.sleep(0.02)
        return i

    with pytest.raises(AttnlabError, match="batch 0 is bad"):
        decode.map_batches(fn, list(range(50)), workers=2)
    assert len(started) < 10  # the batches still queued were dropped
    assert torch.get_num_threads() == 1


def test_batches_decoded_at_once_equal_each_decoded_alone() -> None:
    model = peaky_model(seed=3)
    batches = [sources(n=5, seed=seed) for seed in range(4)]
    alone = [beam_search(model, src, mask, beam_size=3) for src, mask in batches]  # 1 thread
    model.train()  # the workers decode in eval mode all the same, and leave the mode as it was
    torch.set_num_threads(2)
    try:
        together = decode.translate_batches(model, batches, workers=2, beam_size=3)
    finally:
        torch.set_num_threads(1)
    assert together == alone and model.training


def test_beam_scores_at_least_as_well_as_greedy() -> None:
    better = 0
    for seed in range(3):
        model = peaky_model(seed=seed)
        src, mask = sources(seed=seed + 20)
        greedy = greedy_search(model, src, mask)
        beam = beam_search(model, src, mask, beam_size=5, length_penalty=0.6)
        for s, g, b in zip(src, greedy, beam, strict=True):
            assert score(model, s, b, 0.6) >= score(model, s, g, 0.6) - 1e-5
            better += b != g
    assert better > 0  # the wider search does find other (better) outputs


def test_keep_rows_keeps_each_parents_first_child_in_place() -> None:
    # Reference: a plain loop over every parent assignment of 4 beams (4^4 = 256 cases).
    k = 4
    parents = torch.tensor(list(itertools.product(range(k), repeat=k)))  # (256, k)
    slots = keep_rows(parents)
    for parent, slot in zip(parents.tolist(), slots.tolist(), strict=True):
        assert sorted(slot) == list(range(k))  # a permutation of the beam rows
        childless = [p for p in range(k) if p not in parent]
        seen: set[int] = set()
        for child, p in enumerate(parent):
            if p not in seen:  # first child: stays in its parent's row
                assert slot[child] == p
                seen.add(p)
            else:  # later children fill the childless rows in order
                assert slot[child] == childless.pop(0)
        # rows that change = beams that left no child
        assert sum(s != p for s, p in zip(slot, parent, strict=True)) == k - len(set(parent))


@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
def test_wide_beam_equals_exhaustive_search(alpha: float) -> None:
    # Tokens {a, b} and at most 3 of them: 15 possible outputs. A beam of 16 loses none, so
    # its answer must be the best of all (the early stop included).
    vocab, max_len = 5, 3
    model = peaky_model(seed=7, vocab=vocab)
    src, mask = sources(n=5, vocab=vocab, seed=8)
    options = SearchOptions(beam_size=16, length_penalty=alpha, max_len_a=0.0, max_len_b=max_len)
    found = beam_search(model, src, mask, options)
    for s, ids in zip(src, found, strict=True):
        every = [list(c) for n in range(max_len + 1) for c in itertools.product((3, 4), repeat=n)]
        scores = [score(model, s, c, alpha) for c in every]
        best = max(scores)
        assert abs(score(model, s, ids, alpha) - best) < 1e-5
    # the usual narrow beam may miss the optimum, but never outputs past the length limit
    assert all(
        len(ids) <= max_len
        for ids in beam_search(
            model, src, mask, beam_size=2, length_penalty=alpha, max_len_a=0.0, max_len_b=3
        )
    )


def reversal_batch(n: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Sources of 3-6 tokens and their reversal: (src, tgt_in = bos + y, tgt_out = y + eos)."""
    lengths = torch.randint(3, 7, (n,), generator=g)
    width = int(lengths.max())
    src = torch.randint(3, 13, (n, width), generator=g)
    real = torch.arange(width)[None] < lengths[:, None]
    src = src.masked_fill(~real, PAD)
    tgt_out = torch.full((n, width + 1), PAD)
    for i, length in enumerate(lengths.tolist()):
        tgt_out[i, :length] = src[i, :length].flip(0)
        tgt_out[i, length] = EOS
    tgt_in = torch.cat((torch.full((n, 1), BOS), tgt_out[:, :-1]), 1)
    tgt_in = tgt_in.masked_fill(tgt_in == EOS, PAD)
    return src, tgt_in, tgt_out


def test_tiny_model_learns_to_reverse_and_decodes_exactly() -> None:
    torch.manual_seed(0)
    config = TransformerConfig(
        src_vocab_size=13,
        tgt_vocab_size=13,
        d_model=32,
        n_heads=2,
        d_ff=64,
        n_encoder_layers=1,
        n_decoder_layers=1,
        dropout=0.0,
        label_smoothing=0.0,
        norm_position="pre",
        max_positions=16,
    )
    model = Transformer(config)
    steps = 400
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.9, 0.98))
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - step / steps)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        src, tgt_in, tgt_out = reversal_batch(64, g)
        loss = model(src, tgt_in, tgt_out)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
    assert loss.item() < 0.05
    src, _, tgt_out = reversal_batch(32, torch.Generator().manual_seed(1))
    expected = [[t for t in row if t not in (PAD, EOS)] for row in tgt_out.tolist()]
    assert greedy_search(model, src) == expected
    assert beam_search(model, src, beam_size=4) == expected


@pytest.mark.parametrize(
    "search, options, fragment",
    [
        ("beam", {"length_penalty": float("nan")}, "length_penalty"),  # gave pad-id outputs
        ("greedy", {"max_len_a": -5.0, "max_len_b": 0.0}, "max_len_a and max_len_b"),
        ("greedy", {"max_len_b": float("nan")}, "max_len_a and max_len_b"),  # gave []
        ("beam", {"beam_size": 0}, "beam_size must be from 1"),
    ],
)
def test_searches_refuse_settings_that_give_no_sentences(search, options, fragment) -> None:
    model = peaky_model()
    src, mask = sources(2)
    run = beam_search if search == "beam" else greedy_search
    with pytest.raises(AttnlabError, match=fragment):
        run(model, src, mask, **options)


def test_searches_refuse_malformed_sources_and_take_an_empty_batch() -> None:
    model = peaky_model()
    src, mask = sources(2)
    for run in (greedy_search, beam_search):
        assert run(model, src[:0], mask[:0]) == []
        with pytest.raises(AttnlabError, match="src_mask must be a tensor shaped like src_ids"):
            run(model, src, mask[:, :2])  # was ignored by attention, yet set the output lengths
        with pytest.raises(AttnlabError, match="src_mask must be a tensor shaped like src_ids"):
            run(model, src, mask[:1])
        with pytest.raises(AttnlabError, match=r"\(batch, seq\) tensor of integer token ids"):
            run(model, src[0])
    with pytest.raises(AttnlabError, match="tgt_in has 4 rows but src_ids 2"):
        model(src, torch.ones(4, 3, dtype=torch.long))  # was broadcast as beams sharing a source
    with pytest.raises(AttnlabError, match="tgt_out must be a tensor shaped like tgt_in"):
        model(src, torch.ones(2, 3, dtype=torch.long), torch.ones(2, 4, dtype=torch.long))
