"""Parallel data: reading pairs (two files or TSV) with clear errors, truncation, and the
token-count BatchSource: budget kept, every pair once per epoch, seeded, resumable, sharded."""

from __future__ import annotations

import collections
import gzip
import itertools
import random

import pytest
import torch

from attnlab.errors import AttnlabError
from attnlab.text.parallel import (
    EncodedPairs,
    ParallelText,
    TokenBatches,
    collate,
    decode_lines,
    encode_pairs,
    read_parallel,
)
from attnlab.train.data import BatchSource

PAD, SOS, EOS = 0, 1, 2


def random_pairs(n: int = 300, seed: int = 0) -> EncodedPairs:
    rng = random.Random(seed)
    src = [[rng.randrange(4, 50) for _ in range(rng.randint(1, 30))] + [EOS] for _ in range(n)]
    tgt = [[rng.randrange(4, 50) for _ in range(rng.randint(1, 30))] for _ in range(n)]
    return EncodedPairs(src, tgt)


def make(pairs: EncodedPairs, max_tokens: int = 200, **kw) -> TokenBatches:
    return TokenBatches(pairs, max_tokens, PAD, SOS, EOS, **kw)


# ---- reading -------------------------------------------------------------------------------


def test_read_two_files_skips_empty_pairs(tmp_path):
    (tmp_path / "s.de").write_text("Hallo Welt.\n\nZwei\n  \nDrei\r\n")
    (tmp_path / "t.en").write_text("Hello world.\nEmpty source\n\nx\nThree\n")
    pairs = read_parallel([tmp_path / "s.de", tmp_path / "t.en"])
    assert pairs.src == ["Hallo Welt.", "Drei"]
    assert pairs.tgt == ["Hello world.", "Three"]
    assert pairs.skipped == 3


def test_read_gzip_and_tsv(tmp_path):
    with gzip.open(tmp_path / "s.gz", "wt") as f:
        f.write("a\nb\n")
    with gzip.open(tmp_path / "t.gz", "wt") as f:
        f.write("A\nB\n")
    assert read_parallel([tmp_path / "s.gz", tmp_path / "t.gz"]).tgt == ["A", "B"]
    (tmp_path / "p.tsv").write_text("Guten Tag.\tGood day.\n\n今天\tToday\n \tx\n")
    pairs = read_parallel([tmp_path / "p.tsv"])
    assert pairs.src == ["Guten Tag.", "今天"] and pairs.tgt == ["Good day.", "Today"]
    assert pairs.skipped == 2


def test_a_byte_order_mark_is_not_text(tmp_path):
    # Windows editors start a UTF-8 file with U+FEFF; it must not stick to the first word.
    (tmp_path / "s.de").write_bytes("\ufeffZwei Hunde.\r\nEin Mann.\r\n".encode())
    (tmp_path / "t.en").write_bytes("\ufeffTwo dogs.\nA man.\n".encode())
    pairs = read_parallel([tmp_path / "s.de", tmp_path / "t.en"])
    assert pairs.src == ["Zwei Hunde.", "Ein Mann."] and pairs.tgt == ["Two dogs.", "A man."]
    with gzip.open(tmp_path / "p.tsv.gz", "wb") as f:
        f.write("\ufeffZwei Hunde.\tTwo dogs.\n".encode())
    assert read_parallel([tmp_path / "p.tsv.gz"]).src == ["Zwei Hunde."]
    # standard input (PowerShell pipes add one) and only at the start of the text
    assert decode_lines("\ufeffa\n\ufeffb\n".encode(), "stdin") == ["a", "\ufeffb"]


def test_read_errors(tmp_path):
    (tmp_path / "s").write_text("a\nb\nc\n")
    (tmp_path / "t").write_text("A\nB\n")
    with pytest.raises(AttnlabError, match=r"has 3 lines but target .* has 2"):
        read_parallel([tmp_path / "s", tmp_path / "t"])
    (tmp_path / "bad.tsv").write_text("a\tA\nno tab here\n")
    with pytest.raises(AttnlabError, match=r"line 2: expected 'source<TAB>target', found 0 TABs"):
        read_parallel([tmp_path / "bad.tsv"])
    (tmp_path / "bin").write_bytes(b"ok\n\xff\xfe\n")
    with pytest.raises(AttnlabError, match="line 2: not valid UTF-8"):
        read_parallel([tmp_path / "bin", tmp_path / "s"])
    with pytest.raises(AttnlabError, match="not found"):
        read_parallel([tmp_path / "missing.tsv"])
    with pytest.raises(AttnlabError, match="got 3 files"):
        read_parallel([tmp_path / "s"] * 3)


def test_encode_pairs_truncates_to_max_positions():
    class Chars:  # one id per character
        eos_id = EOS

        def encode_batch(self, texts):
            return [[4 + ord(c) % 40 for c in t] for t in texts]

    pairs = ParallelText(["abc", "x" * 20], ["de", "y" * 30])
    encoded = encode_pairs(Chars(), pairs, max_positions=8)
    assert encoded.truncated == 1
    assert encoded.src[0][-1] == EOS and len(encoded.src[0]) == 4
    assert len(encoded.src[1]) == 8 and encoded.src[1][-1] == EOS
    assert len(encoded.tgt[1]) == 7  # + <sos> (or <eos>) = 8 positions


def test_collate_shifts_the_target_right():
    batch = collate([[5, 6, EOS], [7, EOS]], [[8, 9, 10], [11]], PAD, SOS, EOS)
    assert batch["src_ids"].tolist() == [[5, 6, EOS], [7, EOS, PAD]]
    assert batch["tgt_in"].tolist() == [[SOS, 8, 9, 10], [SOS, 11, PAD, PAD]]
    assert batch["tgt_out"].tolist() == [[8, 9, 10, EOS], [11, EOS, PAD, PAD]]


# ---- token batches ---------------------------------------------------------------------------


def test_batches_keep_the_budget_and_cover_every_pair_once():
    pairs = random_pairs()
    source = make(pairs, max_tokens=128)
    assert isinstance(source, BatchSource)
    for epoch in range(3):
        batches = source.epoch_batches(epoch)
        seen = sorted(i for batch in batches for i in batch)
        assert seen == list(range(len(pairs)))
        for batch in batches:
            width = max(max(len(pairs.src[i]), len(pairs.tgt[i]) + 1) for i in batch)
            assert len(batch) * width <= 128
            collated = source.collate(batch)
            assert collated["src_ids"].numel() <= 128 and collated["tgt_in"].numel() <= 128
    # sorted by length: batches are mostly real tokens, not padding
    real = sum(len(s) for s in pairs.src)
    padded = sum(source.collate(b)["src_ids"].numel() for b in source.epoch_batches(0))
    assert real / padded > 0.6


def test_epochs_are_seeded_and_differ():
    pairs = random_pairs()
    a, b, c = make(pairs), make(pairs), make(pairs, seed=1)
    assert a.epoch_batches(0) == b.epoch_batches(0)
    assert a.epoch_batches(0) != a.epoch_batches(1)
    assert a.epoch_batches(0) != c.epoch_batches(0)


def test_iteration_crosses_epochs_and_resumes_mid_epoch():
    pairs = random_pairs()
    source = make(pairs)
    per_epoch = source.batches_per_epoch(0)
    stream = iter(source)
    first = [next(stream) for _ in range(per_epoch + 5)]
    state = source.state_dict()
    assert state == {"epoch": 1, "next_batch": 5}
    rest = [next(stream) for _ in range(4)]

    resumed = make(pairs)
    resumed.load_state_dict(state)
    again = iter(resumed)
    for expected in rest:
        got = next(again)
        assert all(torch.equal(got[k], expected[k]) for k in expected)
    # the first epoch holds every pair once (order of batches shuffled)
    rows = sum(batch["src_ids"].shape[0] for batch in first[:per_epoch])
    assert rows == len(pairs)


def test_ranks_split_each_global_step():
    pairs = random_pairs()
    single = make(pairs)
    ranks = [make(pairs), make(pairs)]
    for r, source in enumerate(ranks):
        source.set_rank(r, 2)
    streams = [iter(s) for s in ranks]
    global_batches = single.epoch_batches(0)
    for step in range(single.batches_per_epoch(0) // 2):
        for r in range(2):
            got = next(streams[r])
            expected = single.collate(global_batches[step * 2 + r])
            assert torch.equal(got["src_ids"], expected["src_ids"])


def _ranks(pairs: EncodedPairs, world_size: int, saved: list[dict] | None = None, **kw) -> list:
    """One TokenBatches per rank, each given a saved state as Trainer._restore gives them."""
    # Round-robin (rank % saving ranks): how a run with another number of processes reads them.
    sources = [make(pairs, **kw) for _ in range(world_size)]
    for rank, source in enumerate(sources):
        source.set_rank(rank, world_size)
        if saved is not None:
            source.load_state_dict(saved[rank % len(saved)])
    return sources


def _identity(batch: dict) -> tuple:
    return tuple(batch["src_ids"].shape), batch["src_ids"].numpy().tobytes()


def _read_steps(sources: list, steps: int) -> list[list[tuple[int, int]]]:
    """(epoch, index in epoch_batches) of each batch every rank reads in `steps` steps."""
    names = {}  # a batch's tensors -> where it stands in its epoch
    for epoch in range(3):
        for index, batch in enumerate(sources[0].epoch_batches(epoch)):
            names[_identity(sources[0].collate(batch)), epoch] = index
    assert len(names) == sum(len(sources[0].epoch_batches(e)) for e in range(3))
    reads: list[list[tuple[int, int]]] = []
    for source in sources:
        stream, reads_of_rank = iter(source), []
        for _ in range(steps * source.grad_accum):
            batch = next(stream)  # source.epoch is now this batch's epoch
            reads_of_rank.append((source.epoch, names[_identity(batch), source.epoch]))
        reads.append(reads_of_rank)
    return reads


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2), (3, 2), (2, 3), (2, 2)])
def test_resuming_with_another_number_of_processes_reads_each_batch_of_the_epoch_once(
    before, after
):
    # Each rank reads batches of its own, so an epoch's position is a count of batches, not of
    # steps. Before, it was kept in steps: 2 processes had read 12 batches in 6 reads each, and
    # 1 process resumed from batch 6, reading 6 of them twice; 2 after 1 skipped 6.
    pairs = random_pairs(305)
    saving = _ranks(pairs, before, max_tokens=190, grad_accum=2)
    n_batches = len(saving[0].epoch_batches(0))  # 37: some resumes leave one batch over
    steps = 3  # the checkpoint's step: 3 x 2 batches read by each of the `before` ranks
    first = _read_steps(saving, steps)
    saved = [source.state_dict() for source in saving]
    resumed = _ranks(pairs, after, saved, max_tokens=190, grad_accum=2)
    rest = _read_steps(resumed, n_batches // (2 * after) + 2)  # into epoch 1
    counts = collections.Counter(
        index for rank in first + rest for epoch, index in rank if epoch == 0
    )
    twice = sorted(i for i, n in counts.items() if n > 1)
    never = sorted(set(range(n_batches)) - set(counts))
    # As in a run on `after` processes from the start, the epoch's last batches, too few to
    # give every rank one, are left out.
    left_over = list(range(n_batches - (n_batches - steps * 2 * before) % after, n_batches))
    skipped = sorted(set(never) - set(left_over))
    assert (twice, never) == ([], left_over), (
        f"resumed on {after} after {before}: of {n_batches} batches of epoch 0, {len(twice)} "
        f"read twice {twice}, {len(skipped)} skipped {skipped}"
    )
    # The next epoch is read as a run on `after` processes from the start reads it; with as
    # many processes as before, the whole run is.
    fresh = _ranks(pairs, after, max_tokens=190, grad_accum=2)
    fresh = _read_steps(fresh, 3 * n_batches // (2 * after))
    if before == after:
        for rank_first, rank_rest, rank_fresh in zip(first, rest, fresh, strict=True):
            assert rank_first + rank_rest == rank_fresh[: len(rank_first + rank_rest)]
    for rank_rest, rank_fresh in zip(rest, fresh, strict=True):
        epoch_1 = [read for read in rank_rest if read[0] == 1]
        assert epoch_1 and epoch_1 == [read for read in rank_fresh if read[0] == 1][: len(epoch_1)]


def test_a_checkpoint_that_counted_steps_resumes_where_it_stood():
    # Checkpoints of before 2026-12-05 kept the steps read of the epoch (one batch per rank
    # each), taken to be of as many processes as the resumed run has.
    pairs = random_pairs()
    old, new = _ranks(pairs, 2), _ranks(pairs, 2)
    for source in old:
        source.load_state_dict({"epoch": 0, "batch_index": 3})
    for source in new:
        source.load_state_dict({"epoch": 0, "next_batch": 6})
    assert _read_steps(old, 2) == _read_steps(new, 2)
    assert old[1].state_dict() == {"epoch": 0, "next_batch": 10}


def test_tokens_in_counts_target_tokens():
    source = make(random_pairs(10))
    batch = source.collate([0, 1])
    assert source.tokens_in(batch) == len(source.pairs.tgt[0]) + len(source.pairs.tgt[1]) + 2


def test_errors():
    with pytest.raises(AttnlabError, match="below the longest"):
        make(random_pairs(), max_tokens=20)
    with pytest.raises(AttnlabError, match="no sentence pairs"):
        make(EncodedPairs([], []))
    source = make(random_pairs(5), max_tokens=1000)
    with pytest.raises(AttnlabError, match="fewer than the 2 processes"):
        source.set_rank(0, 2)


@pytest.mark.parametrize("start", [0, "last"], ids=["mid-epoch", "across-epochs"])
def test_a_steps_loss_is_the_mean_over_every_target_token_of_the_step(start):
    # grad_accum 3 on 2 ranks: the six batches' averaged losses (each divided by the step's
    # normaliser) equal the per-token mean over all six, as one batch of them all would give.
    from attnlab.config import TransformerConfig
    from attnlab.models.seq2seq import Transformer

    torch.manual_seed(0)
    config = TransformerConfig(src_vocab_size=50, tgt_vocab_size=50, d_model=32, n_heads=4,
                               d_ff=64, n_encoder_layers=1, n_decoder_layers=1,
                               max_positions=64, pad_id=PAD, bos_id=SOS, eos_id=EOS)  # fmt: skip
    model = Transformer(config).eval()
    pairs = random_pairs()
    ranks = [make(pairs, grad_accum=3), make(pairs, grad_accum=3)]
    for r, source in enumerate(ranks):
        source.set_rank(r, 2)
        if start == "last":  # two reads left in epoch 0: the step ends in epoch 1
            source.load_state_dict({"epoch": 0, "next_batch": 2 * source.batches_per_epoch(0) - 4})
    step = [batch for source in ranks for batch in itertools.islice(iter(source), 3)]
    assert ranks[0].state_dict() == ({"epoch": 0, "next_batch": 6} if start == 0 else
                                     {"epoch": 1, "next_batch": 2})  # fmt: skip
    tokens = sum(int((batch["tgt_out"] != PAD).sum()) for batch in step)
    assert all(float(batch["tgt_normalizer"]) == pytest.approx(tokens / 6) for batch in step)
    with torch.no_grad():
        averaged = sum(float(model(**batch)["loss"]) for batch in step) / 6
        plain = [model(**{k: v for k, v in b.items() if k != "tgt_normalizer"}) for b in step]
    per_token = sum(float(out["loss"]) * int(out["n_tokens"]) for out in plain) / tokens
    assert averaged == pytest.approx(per_token, rel=1e-5)
    mean_of_means = sum(float(out["loss"]) for out in plain) / 6
    assert abs(mean_of_means - per_token) > 1e-4  # what the loss was before: not the same
