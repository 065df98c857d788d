"""Language-model tokenizers (text/lm_tokenizer.py) against independent references: HF
transformers' GPT2Tokenizer (its pure-Python BPE) and GPT2TokenizerFast, and nanoGPT's rule
for a character vocabulary (sorted(set(text)))."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnlab.cli import main
from attnlab.errors import AttnlabError
from attnlab.text.lm_tokenizer import LMTokenizer, train_byte_bpe, train_char

TEXT = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
    "All:\nSpeak, speak.\n  Indented   line\twith tab\r\n"
    "Über café naïve — 今天天气很好，我们去公园。 😀🤖 3.14159 don't it's\n"
)
SAMPLES = [
    "Hello world!",
    "  leading and trailing spaces  ",
    "line one\n\nline two\n",
    "今天 😀 café <|endoftext|> after",
    "zzqx unseen-words 12345",
    "",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text(TEXT * 20, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def bpe_dir(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bpe") / "tok"
    train_byte_bpe([corpus], 400).save(out)
    return out


def test_char_vocabulary_is_nanogpts_sorted_set_and_round_trips(corpus):
    tok = train_char([corpus])
    chars = sorted(set(TEXT))  # nanoGPT's shakespeare_char: stoi = {c: i for c in sorted(set)}
    stoi = {c: i for i, c in enumerate(chars)}
    assert tok.kind == "char" and tok.vocab_size == len(chars) and tok.eos_id is None
    assert tok.encode(TEXT) == [stoi[c] for c in TEXT]
    assert tok.decode(tok.encode(TEXT)) == TEXT  # \r, \t, runs of spaces, emoji kept


def test_char_vocabulary_names_unknown_characters(corpus):
    tok = train_char([corpus])
    with pytest.raises(AttnlabError, match=r"2 character\(s\) outside .*'Q', 'Z'"):
        tok.encode("Quiz Z")
    assert tok.unknown_characters("Quiz Z") == ["Q", "Z"]


def test_char_tokenizer_saves_and_loads(corpus, tmp_path):
    tok = train_char([corpus])
    tok.save(tmp_path / "tok")
    again = LMTokenizer.from_dir(tmp_path / "tok")
    assert again.kind == "char" and again.encode(TEXT) == tok.encode(TEXT)
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert config["attnlab_tokenizer"] == "char"


@pytest.mark.parametrize("text", [*SAMPLES, TEXT])
def test_byte_bpe_files_encode_as_hf_gpt2_tokenizers(bpe_dir, text):
    from transformers import GPT2Tokenizer, GPT2TokenizerFast

    ours = LMTokenizer.from_dir(bpe_dir)
    fast = GPT2TokenizerFast.from_pretrained(str(bpe_dir))
    slow = GPT2Tokenizer(str(bpe_dir / "vocab.json"), str(bpe_dir / "merges.txt"))
    ids = ours.encode(text)
    assert ids == fast(text)["input_ids"] == slow(text)["input_ids"]
    assert ours.decode(ids, skip_special_tokens=False) == text  # bytes: no unknown token


def test_byte_bpe_from_gpt2_files_only_and_from_an_hf_saved_folder(bpe_dir, tmp_path):
    from transformers import GPT2TokenizerFast

    reference = LMTokenizer.from_dir(bpe_dir)
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("vocab.json", "merges.txt"):
        (bare / name).write_bytes((bpe_dir / name).read_bytes())
    hf = tmp_path / "hf"
    GPT2TokenizerFast(str(bare / "vocab.json"), str(bare / "merges.txt")).save_pretrained(str(hf))
    for folder in (bare, hf):
        tok = LMTokenizer.from_dir(folder)
        assert tok.kind == "byte-bpe" and tok.vocab_size == reference.vocab_size
        assert tok.eos_id == reference.eos_id
        for text in SAMPLES:
            assert tok.encode(text) == reference.encode(text), (folder.name, text)


def test_byte_bpe_stream_decoding_equals_whole_decoding(bpe_dir):
    tok = LMTokenizer.from_dir(bpe_dir)
    text = "今天 😀 café — naïve"
    stream = tok.stream()
    next(stream)
    pieces = [stream.send(i) for i in tok.encode(text)]
    assert "".join(pieces) == text
    assert any(piece == "" for piece in pieces)  # a character split over byte tokens waits


def test_end_of_text_is_one_special_token(bpe_dir):
    tok = LMTokenizer.from_dir(bpe_dir)
    ids = tok.encode("a<|endoftext|>b")
    assert tok.eos_id in ids and len([i for i in ids if i == tok.eos_id]) == 1
    assert tok.decode(ids) == "ab"


def test_a_bert_folder_is_refused(tmp_path):
    (tmp_path / "vocab.txt").write_text("[PAD]\n[UNK]\n")
    with pytest.raises(AttnlabError, match=r"WordPiece vocab\.txt"):
        LMTokenizer.from_dir(tmp_path)


def test_byte_bpe_vocab_size_below_the_byte_alphabet_is_refused(corpus):
    with pytest.raises(AttnlabError, match="from 257"):
        train_byte_bpe([corpus], 100)


def test_cli_trains_both_kinds(corpus, tmp_path, capsys):
    from transformers import GPT2TokenizerFast

    out = tmp_path / "bpe"
    assert main(["tokenizer", "train", str(corpus), "--type", "byte-bpe",
                 "--vocab-size", "300", "--out", str(out)]) == 0  # fmt: skip
    assert {"vocab.json", "merges.txt", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    hf = GPT2TokenizerFast.from_pretrained(str(out))
    assert hf("speak, speak")["input_ids"] == LMTokenizer.from_dir(out).encode("speak, speak")
    assert (
        main(["tokenizer", "train", str(corpus), "--type", "char", "--out", str(tmp_path / "c")])
        == 0
    )
    assert LMTokenizer.from_dir(tmp_path / "c").vocab_size == len(set(TEXT))
    capsys.readouterr()
    code = main(["tokenizer", "train", str(corpus), "--type", "char", "--vocab-size", "50",
                 "--out", str(tmp_path / "d")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--vocab-size does not apply" in err
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert (
        main(["tokenizer", "train", str(empty), "--type", "char", "--out", str(tmp_path / "e")])
        == 2
    )
    assert "has no text" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()
