"""Statistical and structural properties of BERT's masked-LM corruption."""

from __future__ import annotations

import gzip
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SHARED_DATA

from attnlab.errors import AttnlabError
from attnlab.text.corpus_cache import TokenizedCorpus
from attnlab.text.masking import IGNORE_INDEX, MaskingCollator, mask_tokens, static_generator
from attnlab.text.pretraining import Example
from attnlab.text.tokenizer import BertTokenizer

torch.set_num_threads(1)

SHAKESPEARE = SHARED_DATA / "tinyshakespeare" / "input.txt.gz"
NEWS = SHARED_DATA / "zh-corpus" / "news-headlines.txt.gz"

# BERT-base-uncased's layout: [PAD]=0, [UNK]=100, [CLS]=101, [SEP]=102, [MASK]=103.
PAD, UNK, CLS, SEP, MASK = 0, 100, 101, 102, 103
SPECIALS = {PAD, UNK, CLS, SEP, MASK}
VOCAB_SIZE = 30522


def _random_examples(n: int, seed: int = 0) -> list[Example]:
    """Sentence pairs of random ids with [UNK]s mixed in, lengths 20..128 (so padding varies)."""
    rng = np.random.default_rng(seed)
    examples = []
    for _ in range(n):
        length = int(rng.integers(20, 129))
        ids = rng.integers(999, VOCAB_SIZE, size=length).astype(np.int32)
        ids[rng.random(length) < 0.02] = UNK
        split = int(rng.integers(3, length - 2))
        ids[0], ids[split], ids[-1] = CLS, SEP, SEP
        types = np.zeros(length, dtype=np.int8)
        types[split + 1 :] = 1
        starts = rng.random(length) < 0.7
        examples.append(Example(ids, types, starts, label=int(rng.integers(0, 2))))
    return examples


def _collator(**options) -> MaskingCollator:
    return MaskingCollator(PAD, MASK, VOCAB_SIZE, SPECIALS, **options)


def _originals(examples: list[Example], seq: int) -> torch.Tensor:
    ids = torch.full((len(examples), seq), PAD, dtype=torch.long)
    for row, example in enumerate(examples):
        ids[row, : len(example.input_ids)] = torch.from_numpy(example.input_ids.astype(np.int64))
    return ids


@pytest.fixture(scope="module")
def masked_corpus() -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """About 100k real tokens masked in batches of 64: (originals, maskable, batch fields)."""
    examples = _random_examples(1500)
    collator = _collator()
    generator = torch.Generator().manual_seed(1234)
    originals, batches = [], []
    for start in range(0, len(examples), 64):
        chunk = examples[start : start + 64]
        batch = collator(chunk, generator)
        batches.append(batch)
        originals.append(_originals(chunk, batch["input_ids"].shape[1]))
    # Flatten every batch to one long row of positions.
    fields = {key: torch.cat([b[key].flatten() for b in batches]) for key in batches[0]}
    flat = torch.cat([o.flatten() for o in originals])
    maskable = (fields["attention_mask"] == 1) & ~torch.isin(flat, torch.tensor(sorted(SPECIALS)))
    return flat, maskable, fields


def test_fifteen_percent_of_maskable_tokens_are_chosen(masked_corpus) -> None:
    _, maskable, fields = masked_corpus
    n_maskable = int(maskable.sum())
    assert n_maskable > 100_000
    chosen = fields["mlm_labels"] != IGNORE_INDEX
    # Per sequence the count is round(0.15 n), so the total misses 15% only by rounding;
    # even independent Bernoulli(0.15) choices would have std sqrt(.15*.85/1e5) = 0.11%,
    # so ±0.5% is a 4.5-sigma band.
    assert abs(chosen.sum().item() / n_maskable - 0.15) < 0.005
    assert not (chosen & ~maskable).any()  # never a special token or padding


def test_each_sequence_gets_googles_count() -> None:
    examples = _random_examples(200, seed=3)
    batch = _collator()(examples, torch.Generator().manual_seed(0))
    for row, example in enumerate(examples):
        n = int(np.sum(~np.isin(example.input_ids, list(SPECIALS))))
        chosen = int((batch["mlm_labels"][row] != IGNORE_INDEX).sum())
        assert chosen == min(n, max(1, round(n * 0.15)))
    capped = _collator(max_predictions=5)(examples, torch.Generator().manual_seed(0))
    counts = (capped["mlm_labels"] != IGNORE_INDEX).sum(dim=1)
    uncapped = (batch["mlm_labels"] != IGNORE_INDEX).sum(dim=1)
    assert torch.equal(counts, torch.clamp(uncapped, max=5)) and (counts == 5).any()
    # a cap at or past the length caps nothing; past 2**63 it was torch's OverflowError
    # (pretrain --max-predictions 99999999999999999999)
    for cap in (max(e.input_ids.size for e in examples), 10**20):
        loose = _collator(max_predictions=cap)(examples, torch.Generator().manual_seed(0))
        assert torch.equal(loose["mlm_labels"], batch["mlm_labels"])


def test_chosen_tokens_split_80_10_10(masked_corpus) -> None:
    originals, _, fields = masked_corpus
    chosen = fields["mlm_labels"] != IGNORE_INDEX
    corrupted, kept = fields["input_ids"][chosen], originals[chosen]
    n = len(kept)
    masked = (corrupted == MASK).float().mean().item()
    unchanged = (corrupted == kept).float().mean().item()
    replaced = corrupted[(corrupted != MASK) & (corrupted != kept)]
    # n is about 15k: std of the 80% share sqrt(.8*.2/n) = 0.33%, of a 10% share 0.25%,
    # so ±1.5% is beyond 4.5 sigma. A random token equal to the original counts as kept.
    assert abs(masked - 0.8) < 0.015
    assert abs(unchanged - 0.1) < 0.015
    assert abs(len(replaced) / n - 0.1) < 0.015
    assert not torch.isin(replaced, torch.tensor(sorted(SPECIALS))).any()
    assert len(torch.unique(replaced)) > 0.9 * len(replaced)  # spread over the vocabulary


def test_labels_hold_originals_and_the_rest_is_untouched(masked_corpus) -> None:
    originals, _, fields = masked_corpus
    labels, corrupted = fields["mlm_labels"], fields["input_ids"]
    chosen = labels != IGNORE_INDEX
    assert torch.equal(labels[chosen], originals[chosen])
    assert torch.equal(corrupted[~chosen], originals[~chosen])
    assert (fields["attention_mask"] == (originals != PAD).long()).all()


def test_batch_fields_and_types() -> None:
    examples = _random_examples(5, seed=4)
    batch = _collator(pad_to_multiple_of=32)(examples, torch.Generator().manual_seed(0))
    seq = max(len(e.input_ids) for e in examples)
    assert batch["input_ids"].shape == (5, -(-seq // 32) * 32)
    for key in ("input_ids", "attention_mask", "token_type_ids", "mlm_labels", "nsp_labels"):
        assert batch[key].dtype == torch.long
    assert batch["nsp_labels"].tolist() == [e.label for e in examples]
    assert batch["token_type_ids"][0, : len(examples[0].token_type_ids)].tolist() == (
        examples[0].token_type_ids.tolist()
    )
    unlabelled = [Example(e.input_ids, e.token_type_ids, e.word_starts, -1) for e in examples]
    assert "nsp_labels" not in _collator()(unlabelled, torch.Generator())
    with pytest.raises(AttnlabError, match="mixes"):
        _collator()([examples[0], unlabelled[1]], torch.Generator())


def test_random_token_low_bounds_replacements() -> None:
    examples = _random_examples(300, seed=5)
    batch = _collator(random_token_low=29_000)(examples, torch.Generator().manual_seed(0))
    originals = _originals(examples, batch["input_ids"].shape[1])
    chosen = batch["mlm_labels"] != IGNORE_INDEX
    corrupted = batch["input_ids"][chosen]
    replaced = corrupted[(corrupted != MASK) & (corrupted != originals[chosen])]
    assert len(replaced) > 100 and (replaced >= 29_000).all()
    with pytest.raises(AttnlabError, match="eligible"):
        MaskingCollator(PAD, MASK, 5, {0, 1, 2, 3, 4})


def test_same_seed_same_batch_and_different_seed_differs() -> None:
    examples = _random_examples(32, seed=6)
    collator = _collator()

    def run(seed: int) -> dict[str, torch.Tensor]:
        return collator(examples, torch.Generator().manual_seed(seed))

    first, again, other = run(7), run(7), run(8)
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert not torch.equal(first["mlm_labels"], other["mlm_labels"])
    # A generator carried on (dynamic masking) masks the next epoch differently.
    generator = torch.Generator().manual_seed(7)
    collator(examples, generator)
    assert not torch.equal(collator(examples, generator)["mlm_labels"], first["mlm_labels"])


def test_static_masks_repeat_across_epochs_and_batches() -> None:
    examples = _random_examples(48, seed=9)
    collator = _collator(whole_word=True)
    rows: dict[int, list[tuple[list[int], list[int]]]] = {}
    for epoch in range(3):
        order = np.random.default_rng(epoch).permutation(len(examples))
        for start in range(0, len(order), 16 - 3 * epoch):  # batch size and padding vary
            indices = order[start : start + 16 - 3 * epoch].tolist()
            batch = collator(
                [examples[i] for i in indices], [static_generator(42, i) for i in indices]
            )
            for row, index in enumerate(indices):
                length = len(examples[index].input_ids)
                ids = batch["input_ids"][row, :length].tolist()
                labels = batch["mlm_labels"][row, :length].tolist()
                rows.setdefault(index, []).append((ids, labels))
    assert all(len(seen) == 3 and seen[0] == seen[1] == seen[2] for seen in rows.values())
    assert rows[0][0] != rows[1][0]
    first = static_generator(42, 0).initial_seed()
    assert first != static_generator(42, 1).initial_seed() != static_generator(43, 0).initial_seed()


def _assert_words_whole(examples: list[Example], batch: dict[str, torch.Tensor]) -> int:
    """Check that every word is chosen entirely or not at all; return multi-token words chosen."""
    whole_chosen = 0
    for row, example in enumerate(examples):
        chosen = (batch["mlm_labels"][row, : len(example.input_ids)] != IGNORE_INDEX).numpy()
        word_of = np.cumsum(example.word_starts) - 1
        for word in np.unique(word_of):
            flags = chosen[word_of == word]
            assert flags.all() or not flags.any()
            whole_chosen += bool(flags.all() and len(flags) > 1)
        n = int(np.sum(~np.isin(example.input_ids, list(SPECIALS))))
        assert chosen.sum() <= max(1, round(n * 0.15))  # google skips words that overflow
    return whole_chosen


def test_whole_word_masking_on_english_wordpiece(minilm_dir: Path) -> None:
    tokenizer = BertTokenizer.from_dir(minilm_dir)
    with gzip.open(SHAKESPEARE, "rt", encoding="utf-8") as stream:
        lines = [line.strip() for line in itertools.islice(stream, 4000) if line.strip()]
    texts = [" ".join(lines[i : i + 4]) for i in range(0, len(lines), 4)]
    continuation = np.array(
        [t.startswith("##") for t in sorted(tokenizer.vocab, key=tokenizer.vocab.get)]
    )
    examples = []
    for encoding in tokenizer.encode_batch(texts, max_length=128):
        ids = np.array(encoding.ids, dtype=np.int32)
        examples.append(Example(ids, np.zeros(len(ids), np.int8), ~continuation[ids], -1))
    assert sum(int((~e.word_starts).sum()) for e in examples) > 500  # real multi-piece words

    collator = MaskingCollator(
        tokenizer.pad_id, tokenizer.mask_id, tokenizer.vocab_size, tokenizer.special_ids,
        whole_word=True,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    chosen_words = 0
    total_chosen = total_maskable = 0
    for start in range(0, len(examples), 128):
        chunk = examples[start : start + 128]
        batch = collator(chunk, generator)
        chosen_words += _assert_words_whole(chunk, batch)
        total_chosen += int((batch["mlm_labels"] != IGNORE_INDEX).sum())
        special = torch.isin(batch["mlm_labels"], torch.tensor(sorted(tokenizer.special_ids)))
        assert not special.any()
        total_maskable += sum(
            int(np.sum(~np.isin(e.input_ids, list(tokenizer.special_ids)))) for e in chunk
        )
    assert chosen_words > 50
    # Skipping words that would overflow the count leaves the rate only slightly below 15%.
    assert 0.14 < total_chosen / total_maskable <= 0.15


def test_whole_word_masking_on_chinese_jieba_words(tmp_path: Path) -> None:
    import jieba  # noqa: F401  (the dev extra: a missing jieba fails, never skips)

    with gzip.open(NEWS, "rt", encoding="utf-8") as stream:
        lines = list(itertools.islice(stream, 400))
    path = tmp_path / "news.txt"
    path.write_text("".join(lines), encoding="utf-8")
    characters = sorted({c for line in lines for c in line.strip() if not c.isspace()})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *characters]
    tokenizer = BertTokenizer.from_vocab({token: i for i, token in enumerate(vocab)})
    corpus = TokenizedCorpus.build([path], tokenizer, tmp_path / "cache", chinese_words=True)
    examples = []
    for document in range(corpus.n_documents):
        ids = np.concatenate([[tokenizer.cls_id], corpus.tokens[_span(corpus, document)]])
        starts = np.concatenate([[1], corpus.word_starts[_span(corpus, document)]])
        ids = np.append(ids, tokenizer.sep_id).astype(np.int32)
        starts = np.append(starts, 1).astype(bool)
        examples.append(Example(ids, np.zeros(len(ids), np.int8), starts, -1))
    assert sum(int((~e.word_starts).sum()) for e in examples) > 1000  # multi-character words

    collator = MaskingCollator(
        tokenizer.pad_id, tokenizer.mask_id, tokenizer.vocab_size, tokenizer.special_ids,
        whole_word=True,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    chosen_words = sum(
        _assert_words_whole(examples[i : i + 100], collator(examples[i : i + 100], generator))
        for i in range(0, len(examples), 100)
    )
    assert chosen_words > 100


def _span(corpus: TokenizedCorpus, document: int) -> slice:
    sentences = corpus.sentence_ids(document)
    offsets = corpus.sentence_offsets
    return slice(int(offsets[sentences.start]), int(offsets[sentences.stop]))


def test_mask_tokens_functional_core() -> None:
    input_ids = torch.tensor([[CLS, 2000, 2001, 2002, SEP, PAD], [CLS, 3000, SEP, PAD, PAD, PAD]])
    maskable = (input_ids != PAD) & (input_ids != CLS) & (input_ids != SEP)
    corrupted, labels = mask_tokens(
        input_ids,
        maskable,
        torch.Generator().manual_seed(0),
        MASK,
        torch.arange(1000, 1010),
        mask_prob=0.5,
        lengths=[5, 3],
    )
    # round(3 * 0.5) = 2 of row 0; row 1 has one maskable token, and at least one is chosen.
    assert (labels != IGNORE_INDEX).sum(dim=1).tolist() == [2, 1]
    assert labels[1, 1] == 3000
    assert torch.equal(corrupted[~maskable], input_ids[~maskable])
    with pytest.raises(AttnlabError, match="one generator"):
        mask_tokens(input_ids, maskable, [torch.Generator()], MASK, torch.arange(5))


def test_the_count_rounds_n_times_p_as_python_does() -> None:
    # google: max(1, int(round(n * p))) with n * p in double precision. In float32, 190 * 0.15
    # is 28.500002 and rounded to 29 (Python: 28.499999999999996, so 28); likewise 350, 390.
    lengths = list(range(1, 513))
    rows, seq = len(lengths), max(lengths)
    ids = torch.full((rows, seq), 1000, dtype=torch.long)
    maskable = torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]
    for p in (0.15, 0.3):
        _, labels = mask_tokens(
            ids, maskable, torch.Generator().manual_seed(0), MASK, torch.arange(999, 2000), p
        )
        counts = (labels != IGNORE_INDEX).sum(dim=1).tolist()
        assert counts == [max(1, round(n * p)) for n in lengths]
