"""Language modelling (tasks/lm.py, text/token_stream.py): token streams equal to the whole
text's encoding, nanoGPT's split and windows, `lm train` (metrics, held-out perplexity =
exp(loss), warm-up planning, bit-identical resume after SIGKILL, torchrun DDP = one process),
and `lm eval` against hand-computed negative log-likelihoods."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from attnlab.errors import AttnlabError
from attnlab.text import token_stream
from attnlab.text.lm_tokenizer import train_byte_bpe, train_char
from attnlab.text.token_stream import (
    TokenStream,
    WindowBatches,
    evaluation_windows,
    held_out_split,
    text_chunks,
)

LINES = [
    "First Citizen:",
    "Before we proceed any further, hear me speak.",
    "",
    "All:",
    "Speak, speak.   ",
    "  You are all resolved rather to die than to famish?",
    "Resolved. resolved.",
]
TEXT = "\n".join(LINES * 30) + "\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("lm") / "corpus.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------- token streams


@pytest.mark.parametrize("kind", ["char", "byte-bpe"])
def test_a_stream_in_chunks_equals_the_whole_texts_encoding(corpus, kind, tmp_path):
    tokenizer = train_char([corpus]) if kind == "char" else train_byte_bpe([corpus], 300)
    chunks = list(text_chunks(corpus, chunk_chars=40, exact_anywhere=kind == "char"))
    assert len(chunks) > 10 and "".join(chunks) == TEXT
    ids = [i for chunk in chunks for i in tokenizer.encode(chunk)]
    assert ids == tokenizer.encode(TEXT)  # GPT-2's split regex cut only where it is exact


def test_a_stream_is_cached_once_and_closes_files_with_end_of_text(corpus, tmp_path, monkeypatch):
    tokenizer = train_byte_bpe([corpus], 300)
    stream = TokenStream.build([corpus, corpus], tokenizer, tmp_path / "cache")
    whole = tokenizer.encode(TEXT)
    assert list(stream.tokens) == [*whole, tokenizer.eos_id, *whole, tokenizer.eos_id]
    assert stream.tokens.dtype == np.uint16

    def refuse(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(token_stream, "_write_stream", refuse)
    again = TokenStream.build([corpus, corpus], tokenizer, tmp_path / "cache")
    assert again.directory == stream.directory


def test_an_empty_corpus_is_refused(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(AttnlabError, match="has no text"):
        train_char([empty])
    tokenizer = train_byte_bpe([Path(__file__)], 300)
    with pytest.raises(AttnlabError, match="has no text"):
        TokenStream.build([empty], tokenizer, tmp_path / "cache")
    assert not list((tmp_path / "cache" / "lm").iterdir())  # no cache left behind


def test_held_out_split_is_nanogpts_last_ten_percent():
    tokens = np.arange(1000)
    train, held = held_out_split(tokens)
    assert list(train) == list(range(900)) and list(held) == list(range(900, 1000))


def test_windows_predict_the_next_token_and_split_over_ranks_and_steps():
    tokens = np.arange(500, dtype=np.uint16)
    one = WindowBatches(tokens, seq_len=8, batch_size=6, grad_accum=2, seed=5)
    batches = iter(one)
    first = [next(batches) for _ in range(4)]  # two steps of two micro-batches
    assert one.step == 2
    for batch in first:
        assert torch.equal(batch["targets"], batch["input_ids"] + 1)
        assert batch["input_ids"].shape == (3, 8)
    ranks = []
    for rank in range(3):  # three processes read the rows one process reads
        source = WindowBatches(tokens, seq_len=8, batch_size=6, grad_accum=2, seed=5)
        source.set_rank(rank, 3)
        it = iter(source)
        ranks.append([next(it) for _ in range(4)])
    for i, batch in enumerate(first):
        joined = torch.cat([ranks[r][i]["input_ids"] for r in range(3)])
        assert torch.equal(joined, batch["input_ids"])
    resumed = WindowBatches(tokens, seq_len=8, batch_size=6, grad_accum=2, seed=5)
    resumed.load_state_dict({"step": 1})
    assert torch.equal(next(iter(resumed))["input_ids"], first[2]["input_ids"])


def test_evaluation_windows_tile_the_held_out_stream():
    assert evaluation_windows(np.arange(50), 16, 0) == [(0, 16), (16, 16), (32, 16)]
    assert evaluation_windows(np.arange(50), 16, 20) == [(0, 16)]
    assert evaluation_windows(np.arange(5), 16, 0) == [(0, 4)]
