"""Parallel data: reading pairs (two files or TSV) with clear errors, truncation, and the
token-count BatchSource: budget kept, every pair once per epoch, seeded, resumable, sharded."""

from __future__ import annotations

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
    assert state == {"epoch": 1, "batch_index": 5}
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
            source.load_state_dict({"epoch": 0, "batch_index": source.batches_per_epoch(0) - 2})
    step = [batch for source in ranks for batch in itertools.islice(iter(source), 3)]
    assert ranks[0].state_dict() == ({"epoch": 0, "batch_index": 3} if start == 0 else
                                     {"epoch": 1, "batch_index": 1})  # fmt: skip
    tokens = sum(int((batch["tgt_out"] != PAD).sum()) for batch in step)
    assert all(float(batch["tgt_normalizer"]) == pytest.approx(tokens / 6) for batch in step)
    with torch.no_grad():
        averaged = sum(float(model(**batch)["loss"]) for batch in step) / 6
        plain = [model(**{k: v for k, v in b.items() if k != "tgt_normalizer"}) for b in step]
    per_token = sum(float(out["loss"]) * int(out["n_tokens"]) for out in plain) / tokens
    assert averaged == pytest.approx(per_token, rel=1e-5)
    mean_of_means = sum(float(out["loss"]) for out in plain) / 6
    assert abs(mean_of_means - per_token) > 1e-4  # what the loss was before: not the same
