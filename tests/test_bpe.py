"""The joint BPE tokenizer of translation: ids of the specials, exact round trips (Chinese
without spaces included), save/load, clear errors, and `attnlab tokenizer train --type bpe`."""

from __future__ import annotations

import json

import pytest

from attnlab.cli import main
from attnlab.errors import AttnlabError
from attnlab.text.bpe import BpeTokenizer, train_bpe, train_bpe_from_texts
from attnlab.text.tokenizer import train_wordpiece

CORPUS = [
    "Ein Mann fährt mit dem Fahrrad durch die Stadt.",
    "A man rides his bike through the city.",
    "Zwei Kinder spielen im Garten.",
    "Two children are playing in the garden.",
    "今天天气很好，我们去公园散步吧。",
    "我们明天去公园看花。",
    "The weather is nice today, let's walk in the park.",
    "他说：“Hello!” 然后走了。",
    "Note: wait… what? 好！然后……",
] * 5

ROUND_TRIP = [
    "Ein Mann fährt mit dem Fahrrad.",
    "我们去公园散步吧。",  # unspaced Chinese
    "他说: “Hello!” 然后走了。",  # mixed scripts, spacing kept exactly
    "Two  spaces here, said the man.",
    "Two new words: Gartenstadtkinder.",
]


@pytest.fixture(scope="module")
def tokenizer() -> BpeTokenizer:
    return train_bpe_from_texts(CORPUS, vocab_size=200, min_frequency=1)


def test_special_token_ids(tokenizer):
    assert (tokenizer.pad_id, tokenizer.sos_id, tokenizer.eos_id, tokenizer.unk_id) == (0, 1, 2, 3)
    assert tokenizer.vocab_size <= 200


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip_is_exact(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_unspaced_chinese_is_split_into_learnt_subwords(tokenizer):
    tokens = tokenizer.tokenize("我们去公园散步吧。")
    assert len(tokens) > 1  # BPE cuts the space-less run
    assert any(len(t.lstrip("▁")) > 1 for t in tokens)  # and merged frequent characters
    assert tokenizer.unk_id not in tokenizer.encode("我们去公园散步吧。")


def test_unseen_characters_become_unk(tokenizer):
    ids = tokenizer.encode("我们 龘")
    assert ids[-1] == tokenizer.unk_id
    assert tokenizer.decode(ids) == "我们 "  # <unk> is dropped, like the other specials


def test_full_width_punctuation_and_ellipses_round_trip(tokenizer, tmp_path):
    # Chinese references keep ，！？ and English ones …: a decoded output must too, or BLEU
    # counts every such token wrong (NFKC folded them to ,!? and ...).
    text = "他说：“好！”，然后走了……"
    assert tokenizer.normalize(text) == text
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.decode(tokenizer.encode("wait… what?")) == "wait… what?"
    # A tokenizer saved with NFKC (before 2026-12-02) keeps it: its merges were learnt on it.
    tokenizer.save(tmp_path)
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    data["normalizer"] = {"type": "NFKC"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    assert BpeTokenizer.from_dir(tmp_path).normalize("，") == ","


def test_specials_are_dropped_on_decode(tokenizer):
    ids = [tokenizer.sos_id, *tokenizer.encode("Zwei Kinder"), tokenizer.eos_id, tokenizer.pad_id]
    assert tokenizer.decode(ids) == "Zwei Kinder"
    assert tokenizer.decode_batch([ids, []]) == ["Zwei Kinder", ""]
    with pytest.raises(AttnlabError, match="outside the vocabulary"):
        tokenizer.decode([tokenizer.vocab_size])


def test_save_and_load_give_the_same_ids(tokenizer, tmp_path):
    tokenizer.save(tmp_path)
    loaded = BpeTokenizer.from_dir(tmp_path)
    for text in ROUND_TRIP:
        assert loaded.encode(text) == tokenizer.encode(text)
    assert loaded.encode_batch(ROUND_TRIP) == [tokenizer.encode(t) for t in ROUND_TRIP]


def test_train_from_files_tsv_and_gz(tmp_path):
    import gzip

    tsv = tmp_path / "pairs.tsv"
    tsv.write_text("".join(f"{a}\t{b}\n" for a, b in zip(CORPUS[::2], CORPUS[1::2], strict=False)))
    gz = tmp_path / "more.txt.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        f.write("Noch ein Satz.\n")
    tok = train_bpe([tsv, gz], vocab_size=150, min_frequency=1)
    assert not any("\t" in t for t in tok.backend.get_vocab())
    assert tok.decode(tok.encode("Noch ein Satz.")) == "Noch ein Satz."


def test_line_endings_are_not_learnt(tmp_path):
    # Sentences are encoded without their line ending: a vocabulary learnt on files must not
    # spend entries on "word.\n" pieces, which no sentence can use.
    pairs = list(zip(CORPUS[::2], CORPUS[1::2], strict=False))
    corpus = tmp_path / "corpus.tsv"
    corpus.write_bytes("".join(f"{a} \t {b}\r\n" for a, b in pairs).encode())
    tok = train_bpe([corpus], vocab_size=150, min_frequency=1)
    assert not any("\n" in t or "\r" in t for t in tok.backend.get_vocab())


def test_a_byte_order_mark_is_not_learnt(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(("\ufeff" + "\n".join(CORPUS) + "\n").encode())
    tok = train_bpe([corpus], vocab_size=150, min_frequency=1)
    assert not any("\ufeff" in t for t in tok.backend.get_vocab())


def test_errors(tmp_path):
    with pytest.raises(AttnlabError, match="not found"):
        train_bpe([tmp_path / "missing.txt"], 100)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(AttnlabError, match="no text"):
        train_bpe([empty], 100)
    with pytest.raises(AttnlabError, match="vocab_size"):
        train_bpe_from_texts(CORPUS, 3)
    with pytest.raises(AttnlabError, match=r"no tokenizer\.json"):
        BpeTokenizer.from_dir(tmp_path)
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(CORPUS))
    train_wordpiece([corpus], 100).save(tmp_path / "wp")
    with pytest.raises(AttnlabError, match="not BPE"):
        BpeTokenizer.from_dir(tmp_path / "wp")


def test_cli_tokenizer_train_bpe(tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(CORPUS) + "\n")
    out = tmp_path / "bpe"
    assert main(["tokenizer", "train", "--type", "bpe", "--vocab-size", "120", "--out", str(out), str(corpus)]) == 0  # fmt: skip
    assert "BPE" in capsys.readouterr().err
    tok = BpeTokenizer.from_dir(out)
    assert tok.vocab_size <= 120
    assert tok.decode(tok.encode(CORPUS[4])) == tok.normalize(CORPUS[4])
    # the same output again is refused (nothing overwritten) unless --overwrite
    before = (out / "tokenizer.json").read_bytes()
    assert main(["tokenizer", "train", "--type", "bpe", "--out", str(out), str(corpus)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("attnlab: error:") and "--overwrite" in err
    assert (out / "tokenizer.json").read_bytes() == before
    # no corpus at all
    assert main(["tokenizer", "train", "--type", "bpe", "--out", str(tmp_path / "x")]) == 2
    assert "corpus" in capsys.readouterr().err
