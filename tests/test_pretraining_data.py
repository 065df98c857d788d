"""Corpus reading, the memory-mapped token cache, and NSP / SOP / full-sentence examples."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import pickle
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SHARED_DATA

from attnlab.errors import AttnlabError
from attnlab.text import chinese_words, corpus_cache, pretraining
from attnlab.text import sentences as sentences_module
from attnlab.text.corpus_cache import TokenizedCorpus
from attnlab.text.pretraining import Example, ExampleBuilder
from attnlab.text.sentences import read_documents, split_sentences
from attnlab.text.tokenizer import SPECIAL_TOKENS, BertTokenizer, train_wordpiece

torch.set_num_threads(1)

ZH_REVIEWS = SHARED_DATA / "zh-corpus" / "reviews.txt.gz"


# ---- split_sentences and read_documents -----------------------------------------------------


def test_split_sentences_chinese() -> None:
    text = "今天天气很好。我们去公园吧！你来吗？他说：“好的。”然后走了；嗯……再见"
    assert split_sentences(text) == [
        "今天天气很好。",
        "我们去公园吧！",
        "你来吗？",
        "他说：“好的。”",  # the closing quote stays with its sentence
        "然后走了；",
        "嗯……",
        "再见",
    ]


def test_split_sentences_english() -> None:
    text = 'It costs 3.14 dollars. "Really?" she asked (twice.) Yes! Done'
    assert split_sentences(text) == [
        "It costs 3.14 dollars.",  # a decimal point does not end a sentence
        '"Really?"',
        "she asked (twice.)",
        "Yes!",
        "Done",
    ]


def test_split_sentences_never_returns_empty_strings() -> None:
    for text in ["", "   ", "。。。", "...", " a. ", "!?！？", "\n\t"]:
        assert all(sentence.strip() for sentence in split_sentences(text))
    assert split_sentences("。。。") == ["。。。"]
    assert split_sentences("   ") == []


def test_read_documents_blank_line_layout_and_gzip(tmp_path: Path) -> None:
    text = "第一句。\n第二句。第三句！\n\n \nOther doc one.\nOther doc two.\n\n\n"
    plain = tmp_path / "docs.txt"
    plain.write_text(text, encoding="utf-8")
    packed = tmp_path / "docs.txt.gz"
    packed.write_bytes(gzip.compress(text.encode("utf-8")))
    expected = [["第一句。", "第二句。", "第三句！"], ["Other doc one.", "Other doc two."]]
    assert list(read_documents(plain)) == expected
    assert list(read_documents(packed)) == expected


def test_read_documents_line_per_document_layout(tmp_path: Path) -> None:
    path = tmp_path / "headlines.txt"
    # A trailing blank line alone does not switch to the blank-line layout.
    path.write_text("标题一。副标题！\nSecond headline\r\n\n", encoding="utf-8")
    assert list(read_documents(path)) == [["标题一。", "副标题！"], ["Second headline"]]


def test_read_documents_layout_sees_blank_lines_as_the_reader_does(tmp_path: Path) -> None:
    # google reads a line as blank when line.strip() is empty: a line of full-width spaces
    # (U+3000, common in Chinese text) separates documents like an empty one.
    path = tmp_path / "docs.txt"
    path.write_text("第一句。\n第二句。\n\u3000\u3000\n第三句。\n第四句。\n", encoding="utf-8")
    assert list(read_documents(path)) == [["第一句。", "第二句。"], ["第三句。", "第四句。"]]
    # A first line that is only a byte-order mark is blank: no blank line stands between two
    # lines of text, so each line is a document.
    path.write_bytes("\ufeff\n\nheadline one\nheadline two\n".encode())
    assert list(read_documents(path)) == [["headline one"], ["headline two"]]


def test_read_documents_drops_a_byte_order_mark(tmp_path: Path) -> None:
    path = tmp_path / "bom.txt"
    path.write_bytes("\ufeff第一句。\n\ufeff第二句。\n".encode())
    assert list(read_documents(path)) == [["第一句。"], ["\ufeff第二句。"]]  # the file's start only


def test_read_documents_names_the_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.txt"
    path.write_bytes(b"fine line\n" + b"broken \xff byte\n")
    with pytest.raises(AttnlabError, match=r"bad\.txt, line 2: not valid UTF-8"):
        list(read_documents(path))


def test_read_documents_missing_file(tmp_path: Path) -> None:
    with pytest.raises(AttnlabError, match="not found"):
        list(read_documents(tmp_path / "absent.txt"))


SPLIT_TEXTS = [
    "今天天气很好。我们去公园吧！你来吗？他说：“好的。”然后走了；嗯……再见",
    'It costs 3.14 dollars. "Really?" she asked (twice.) Yes! Done',
    "真的吗?是的. U.S.A. is big... ok?! «yes.» 」end。」。x\n",
    "",
    "   ",
    "。。。",
    " a. ",
]


def test_a_line_split_in_pieces_gives_the_sentences_of_the_whole_line() -> None:
    # A line is read in bounded pieces: a sentence end cut by a piece's end (a run of
    # '…', a closing quote, the character after a '.') must not change the split.
    for text in SPLIT_TEXTS:
        for size in range(1, len(text) + 2):
            pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
            splitter = sentences_module._LineSplitter()
            got = [s for k, p in enumerate(pieces) for s in splitter.feed(p, k == len(pieces) - 1)]
            assert got == split_sentences(text), (text, size)


def test_a_sentence_longer_than_the_bound_is_cut_at_spaces(monkeypatch: pytest.MonkeyPatch) -> None:
    # A line with no sentence end was one sentence held whole, however long: a 32 MB line
    # took 5 GB to tokenize. Past _MAX_SENTENCE_CHARS it now comes out in pieces, cut after
    # a space (words whole) or, in text without spaces, at the bound; and whether the line
    # arrives whole or in pieces of any size, the text held between pieces stays bounded.
    monkeypatch.setattr(sentences_module, "_MAX_SENTENCE_CHARS", 10)
    assert split_sentences("aaa bbb ccc ddd eee") == ["aaa bbb", "ccc ddd", "eee"]
    assert split_sentences("一二三四五六七八九十壹贰") == ["一二三四五六七八九十", "壹贰"]
    assert split_sentences("abcdefghijklmn op") == ["abcdefghij", "klmn op"]
    text = "aaaa bbbb cccc dddd. 一二三四五六七八九十壹贰。 tail\u3000words here and more"
    whole = split_sentences(text)
    assert whole == ["aaaa bbbb", "cccc dddd.", "一二三四五六七八九", "十壹贰。", "tail",
                     "words", "here and", "more"]  # fmt: skip
    for size in range(1, len(text) + 1):
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        splitter, got = sentences_module._LineSplitter(), []
        for k, piece in enumerate(pieces):
            got += splitter.feed(piece, k == len(pieces) - 1)
            assert len(splitter.text) <= 10 + size
        assert got == whole, size


def test_read_documents_reads_lines_in_pieces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pieces of 5 bytes cut the 3-byte characters, the byte-order mark and the sentence ends.
    text = "\ufeff第一句。第二句！ a. b\n\n\u3000\u3000\nline two 中文。」。x\n  \nlast line. no newline"
    path = tmp_path / "docs.txt.gz"
    path.write_bytes(gzip.compress(text.encode("utf-8")))
    whole = list(read_documents(path))
    assert whole == [["第一句。", "第二句！", "a.", "b"], ["line two 中文。」", "。", "x"],
                     ["last line.", "no newline"]]  # fmt: skip
    monkeypatch.setattr(sentences_module, "_PIECE_BYTES", 5)
    assert list(read_documents(path)) == whole
    bad = tmp_path / "bad.txt"
    bad.write_bytes("第一行\n".encode() + b"0123456789 \xff byte\n")
    with pytest.raises(
        AttnlabError, match=r"bad\.txt, line 2: not valid UTF-8 \(byte 0xff at column 12\)"
    ):
        list(read_documents(bad))
    bad.write_bytes("ends inside a character 中".encode()[:-1])
    with pytest.raises(AttnlabError, match=r"line 1: not valid UTF-8 \(byte 0xe4 at column 25\)"):
        list(read_documents(bad))


def _build_measuring_memory(
    path: Path, tokenizer: BertTokenizer, cache: Path
) -> tuple[TokenizedCorpus, int]:
    """TokenizedCorpus.build of one file, and the peak of Python's allocations meanwhile."""
    import tracemalloc

    tracemalloc.start()
    try:
        corpus = TokenizedCorpus.build([path], tokenizer, cache)
        return corpus, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_one_line_corpus_is_read_and_tokenized_in_bounded_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A 50 MB corpus of one line (one document) took 1.93 GB to tokenize: the line, its
    # sentences and their encodings were held at once. Read in pieces and tokenized in
    # chunks, the text held at a time is bounded whatever the size of a line or document.
    monkeypatch.setattr(sentences_module, "_PIECE_BYTES", 4096)
    monkeypatch.setattr(corpus_cache, "_CHUNK_SENTENCES", 64)
    words = ["sentence", "of", "the", "one", "long", "line", ".", *"0123456789"]
    vocab = [*SPECIAL_TOKENS, *words, *(f"##{digit}" for digit in "0123456789")]
    tokenizer = BertTokenizer.from_vocab({token: i for i, token in enumerate(vocab)})
    sentences = [f"Sentence {i} of the one long line." for i in range(40_000)]
    path = tmp_path / "one-line.txt"
    path.write_text(" ".join(sentences) + "\n", encoding="utf-8")  # 1.4 MB
    sizes = []
    real_encode = corpus_cache._encode_chunk

    def encode(tokenizer: BertTokenizer, chunk: list[str]) -> list:
        sizes.append(len(chunk))
        return real_encode(tokenizer, chunk)

    monkeypatch.setattr(corpus_cache, "_encode_chunk", encode)
    corpus, peak = _build_measuring_memory(path, tokenizer, tmp_path / "cache")
    assert corpus.n_documents == 1 and corpus.n_sentences == len(sentences)
    assert max(sizes) == 64 and sum(sizes) == len(sentences)
    assert peak < 1_000_000, peak  # was 39.8 MB: the line, 40,000 strings, their encodings
    first = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(sentences[0]))
    assert corpus.sentence(0).tolist() == first
    assert int(corpus.document_offsets[-1]) == len(sentences)


def test_a_line_without_sentence_ends_is_tokenized_in_bounded_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The same for a line with no sentence end (unpunctuated text, a dump): it was one
    # sentence, held and encoded whole (a 32 MB line: 5 GB and 33 s; now 82 MB and 6 s).
    monkeypatch.setattr(sentences_module, "_PIECE_BYTES", 4096)
    monkeypatch.setattr(corpus_cache, "_CHUNK_CHARS", 16384)
    vocab = [*SPECIAL_TOKENS, *(f"w{i}" for i in range(10))]
    tokenizer = BertTokenizer.from_vocab({token: i for i, token in enumerate(vocab)})
    words = [f"w{i % 10}" for i in range(200_000)]
    path = tmp_path / "no-ends.txt"
    path.write_text(" ".join(words) + "\n", encoding="utf-8")  # 600 KB
    corpus, peak = _build_measuring_memory(path, tokenizer, tmp_path / "cache")
    assert peak < 1_000_000, peak  # 0.22 MB; was 3.5 MB: the line and its sentence held whole
    assert corpus.n_documents == 1 and corpus.n_sentences == 147  # 4,095 characters a piece
    tokens = np.concatenate([corpus.sentence(i) for i in range(corpus.n_sentences)])
    assert tokens.tolist() == tokenizer.convert_tokens_to_ids(words)  # no word cut or lost


def test_chunks_are_bounded_in_characters_too(
    tmp_path: Path, minilm_tokenizer: BertTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(corpus_cache, "_CHUNK_CHARS", 250)
    sizes = []
    real_encode = corpus_cache._encode_chunk

    def encode(tokenizer: BertTokenizer, chunk: list[str]) -> list:
        sizes.append(sum(map(len, chunk)))
        return real_encode(tokenizer, chunk)

    monkeypatch.setattr(corpus_cache, "_encode_chunk", encode)
    document = [" ".join(["word"] * 20) + "." for _ in range(10)]  # 100 characters each
    path = _write_blank_separated(tmp_path / "corpus.txt", [document, ["Another."]])
    corpus = TokenizedCorpus.build([path], minilm_tokenizer, tmp_path / "cache")
    assert corpus.n_documents == 2 and corpus.n_sentences == 11
    assert max(sizes) <= 300 and len(sizes) == 4


# ---- TokenizedCorpus ------------------------------------------------------------------------

ENGLISH_DOCS = [
    ["The quick brown fox jumps.", "Unaffable tokenization happens!"],
    ["A lonely sentence without an end"],
    ["Hamlet speaks.", "Ophelia answers?", "Polonius hides behind the arras."],
]


def _write_blank_separated(path: Path, documents: list[list[str]]) -> Path:
    path.write_text("\n\n".join("\n".join(doc) for doc in documents) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def minilm_tokenizer(minilm_dir: Path) -> BertTokenizer:
    return BertTokenizer.from_dir(minilm_dir)


def test_corpus_round_trip_matches_direct_encoding(
    tmp_path: Path, minilm_tokenizer: BertTokenizer
) -> None:
    path = _write_blank_separated(tmp_path / "corpus.txt", ENGLISH_DOCS)
    corpus = TokenizedCorpus.build([path], minilm_tokenizer, tmp_path / "cache")
    assert corpus.n_documents == 3 and corpus.n_sentences == 6
    assert corpus.tokens.dtype == np.int32 and corpus.sentence_offsets.dtype == np.int64
    total = 0
    for i, document in enumerate(ENGLISH_DOCS):
        got = corpus.document(i)
        assert len(got) == len(document)
        for sentence_ids, text in zip(got, document, strict=True):
            tokens = minilm_tokenizer.tokenize(text)
            assert sentence_ids.tolist() == minilm_tokenizer.convert_tokens_to_ids(tokens)
            total += len(tokens)
    assert corpus.n_tokens == total
    starts = [not token.startswith("##") for token in minilm_tokenizer.tokenize(ENGLISH_DOCS[0][1])]
    assert corpus.sentence_word_starts(1).astype(bool).tolist() == starts
    assert not all(starts)  # "unaffable" really has continuations

    reopened = TokenizedCorpus.open(corpus.directory)
    assert np.array_equal(reopened.tokens, corpus.tokens)
    unpickled = pickle.loads(pickle.dumps(corpus))
    assert len(pickle.dumps(corpus)) < 1000  # the directory travels, not the arrays
    assert np.array_equal(unpickled.document_offsets, corpus.document_offsets)


def test_corpus_cache_is_reused_and_invalidated(
    tmp_path: Path, minilm_tokenizer: BertTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write_blank_separated(tmp_path / "corpus.txt", ENGLISH_DOCS)
    calls = Counter()
    real_encode = corpus_cache._encode_chunk

    def counting_encode(tokenizer, sentences):
        calls["encode"] += 1
        return real_encode(tokenizer, sentences)

    monkeypatch.setattr(corpus_cache, "_encode_chunk", counting_encode)
    first = TokenizedCorpus.build([path], minilm_tokenizer, tmp_path / "cache")
    assert calls["encode"] == 1

    def refuse(tokenizer, sentences):
        raise AssertionError("the cached corpus should not be tokenized again")

    monkeypatch.setattr(corpus_cache, "_encode_chunk", refuse)
    again = TokenizedCorpus.build([str(path)], minilm_tokenizer, tmp_path / "cache")
    assert again.directory == first.directory
    assert not list((tmp_path / "cache").glob(".*.tmp"))  # no scratch directory left behind

    monkeypatch.setattr(corpus_cache, "_encode_chunk", counting_encode)
    with path.open("a", encoding="utf-8") as handle:
        handle.write("\nA fourth document appears.\n")
    changed = TokenizedCorpus.build([path], minilm_tokenizer, tmp_path / "cache")
    assert calls["encode"] == 2 and changed.directory != first.directory
    assert changed.n_documents == 4

    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # same size, touched
    touched = TokenizedCorpus.build([path], minilm_tokenizer, tmp_path / "cache")
    assert calls["encode"] == 3 and touched.directory != changed.directory

    cased = BertTokenizer.from_vocab(minilm_tokenizer.vocab, lowercase=False)
    other = TokenizedCorpus.build([path], cased, tmp_path / "cache")
    assert calls["encode"] == 4 and other.directory != touched.directory


def test_an_edit_that_restores_size_and_mtime_is_not_served_from_the_cache(
    tmp_path: Path, minilm_tokenizer: BertTokenizer
) -> None:
    # The fingerprint was path, size and mtime: the same bytes count with the mtime set back
    # (os.utime, cp -p, rsync -t) gave the old tokens. The inode change time tells.
    path = _write_blank_separated(tmp_path / "corpus.txt", ENGLISH_DOCS)
    first = TokenizedCorpus.build([path], minilm_tokenizer, tmp_path / "cache")
    before = path.stat()
    path.write_text(path.read_text(encoding="utf-8").replace("fox", "cat"), encoding="utf-8")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    if after.st_ctime_ns == before.st_ctime_ns:  # a clock too coarse to tell: wait and redo
        import time

        time.sleep(0.05)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    edited = TokenizedCorpus.build([path], minilm_tokenizer, tmp_path / "cache")
    assert edited.directory != first.directory
    cat = minilm_tokenizer.convert_tokens_to_ids(["cat"])[0]
    assert cat in edited.sentence(0).tolist() and cat not in first.sentence(0).tolist()


def test_corpus_streams_in_chunks(
    tmp_path: Path, minilm_tokenizer: BertTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Documents straddle chunk boundaries and empty-token sentences are dropped.
    monkeypatch.setattr(corpus_cache, "_CHUNK_SENTENCES", 4)
    documents = [[f"doc {d} sentence {s}." for s in range(d % 5 + 1)] for d in range(17)]
    documents[3] = ["\u200b"]  # tokenizes to nothing: the whole document disappears
    documents[4].insert(0, "\x00")
    path = _write_blank_separated(tmp_path / "corpus.txt", documents)
    corpus = TokenizedCorpus.build([path], minilm_tokenizer, tmp_path / "cache")
    kept = [[s for s in doc if minilm_tokenizer.tokenize(s)] for doc in documents]
    kept = [doc for doc in kept if doc]
    assert corpus.n_documents == len(kept) == 16
    for i, document in enumerate(kept):
        got = [ids.tolist() for ids in corpus.document(i)]
        want = [
            minilm_tokenizer.convert_tokens_to_ids(minilm_tokenizer.tokenize(s)) for s in document
        ]
        assert got == want


def _corrupt_meta(directory: Path, lengths: object) -> None:
    meta = json.loads((directory / "meta.json").read_text())
    meta["lengths"] = lengths
    (directory / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    ("damage", "detail"),
    [
        (("tokens", 2, 10**6), "a token id outside the vocabulary"),
        (("tokens", -1, -5), "a token id outside the vocabulary"),
        (("word_starts", 0, 7), "word-start flag"),
        (("sentence_offsets", 2, 10**9), "not increasing"),
        (("sentence_offsets", -1, 3), "does not run from 0"),
        (("document_offsets", 1, 0), "not increasing"),
        ("lengths-list", "lacks the arrays' lengths"),  # was an AttributeError
        ("no-meta", None),  # was 'Directory not empty' on the rename of the new build
    ],
)
def test_a_damaged_corpus_cache_is_built_again(
    tmp_path: Path,
    minilm_tokenizer: BertTokenizer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    damage: object,
    detail: str | None,
) -> None:
    # Right sizes, wrong bytes: before, examples were built from such a cache and training
    # failed mid-run (an IndexError, or an embedding lookup out of range).
    monkeypatch.setattr(corpus_cache, "_VERIFY_CHUNK", 3)  # the checks cross chunk edges
    path = _write_blank_separated(tmp_path / "corpus.txt", ENGLISH_DOCS)
    corpus = TokenizedCorpus.build([path], minilm_tokenizer, tmp_path / "cache")
    sound = {name: np.array(getattr(corpus, name)) for name in corpus_cache._ARRAYS}
    again = TokenizedCorpus.build([path], minilm_tokenizer, tmp_path / "cache")
    assert again.directory == corpus.directory and capsys.readouterr().err == ""  # reused
    if damage == "lengths-list":
        _corrupt_meta(corpus.directory, [1, 2])
    elif damage == "no-meta":
        (corpus.directory / "meta.json").unlink()
    else:
        array, index, value = damage
        data = np.fromfile(corpus.directory / f"{array}.bin", dtype=corpus_cache._ARRAYS[array])
        data[index] = value
        data.tofile(corpus.directory / f"{array}.bin")
    rebuilt = TokenizedCorpus.build([path], minilm_tokenizer, tmp_path / "cache")
    err = capsys.readouterr().err
    if detail is not None:
        assert (
            err.startswith("warning: ") and detail in err and "tokenizing the corpus again" in err
        )
    assert rebuilt.directory == corpus.directory
    for name, values in sound.items():
        assert np.array_equal(getattr(rebuilt, name), values), name
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [corpus.directory.name]


def test_a_killed_builds_scratch_folder_is_removed_by_the_next_build(
    tmp_path: Path, minilm_tokenizer: BertTokenizer
) -> None:
    # A kill while tokenizing left .<fingerprint>.<pid>.<hex>.tmp in the cache for good.
    import subprocess

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    cache = tmp_path / "cache"
    dead = cache / f".abc.{int(gone.stdout)}.{'0' * 32}.tmp"
    live = cache / f".abc.{os.getpid()}.{'1' * 32}.tmp"  # a build in progress here
    for scratch in (dead, live):
        (scratch / "tokens.bin").parent.mkdir(parents=True)
        (scratch / "tokens.bin").write_bytes(b"half")
    path = _write_blank_separated(tmp_path / "corpus.txt", ENGLISH_DOCS)
    TokenizedCorpus.build([path], minilm_tokenizer, cache)
    assert not dead.exists() and live.exists()


def test_an_edited_corpus_leaves_no_cache_behind(
    tmp_path: Path, minilm_tokenizer: BertTokenizer, capsys: pytest.CaptureFixture
) -> None:
    # Every edit left the old cache in ~/.cache/attnlab/corpora for good: a 10 GB corpus
    # edited three times held 40 GB there.
    path = _write_blank_separated(tmp_path / "corpus.txt", ENGLISH_DOCS)
    cache = tmp_path / "cache"
    first = TokenizedCorpus.build([path], minilm_tokenizer, cache)
    tokens = np.array(first.tokens)
    capsys.readouterr()
    with path.open("a", encoding="utf-8") as handle:
        handle.write("\nA fourth document appears.\n")
    edited = TokenizedCorpus.build([path], minilm_tokenizer, cache)
    assert not first.directory.exists() and edited.n_documents == 4
    assert sorted(p.name for p in cache.iterdir()) == [edited.directory.name]
    assert capsys.readouterr().err == (
        f"note: removed 1 corpus cache that no run can use again (0.0 GB) from {cache}\n"
    )
    assert np.array_equal(first.tokens, tokens)  # a run that has it mapped reads on
    TokenizedCorpus.build([path], minilm_tokenizer, cache)
    assert capsys.readouterr().err == ""  # a cache hit removes nothing and says nothing


def test_the_cache_of_a_deleted_corpus_file_is_removed(
    tmp_path: Path, minilm_tokenizer: BertTokenizer, capsys: pytest.CaptureFixture
) -> None:
    cache = tmp_path / "cache"
    gone = _write_blank_separated(tmp_path / "gone.txt", ENGLISH_DOCS)
    gone_cache = TokenizedCorpus.build([gone], minilm_tokenizer, cache).directory
    gone.unlink()
    kept = _write_blank_separated(tmp_path / "kept.txt", ENGLISH_DOCS[:2])
    kept_cache = TokenizedCorpus.build([kept], minilm_tokenizer, cache).directory
    assert not gone_cache.exists() and kept_cache.exists()
    assert "note: removed 1 corpus cache that" in capsys.readouterr().err


def test_only_caches_that_can_never_be_served_are_removed(
    tmp_path: Path, minilm_tokenizer: BertTokenizer, capsys: pytest.CaptureFixture
) -> None:
    cache = tmp_path / "cache"
    other = _write_blank_separated(tmp_path / "other.txt", ENGLISH_DOCS[:2])
    other_cache = TokenizedCorpus.build([other], minilm_tokenizer, cache).directory
    key = corpus_cache._file_key(other.resolve())

    def folder(name: str, meta: object, root: Path = cache) -> Path:
        (root / name).mkdir()
        (root / name / "tokens.bin").write_bytes(bytes(1000))
        if meta is not None:
            text = meta if isinstance(meta, str) else json.dumps(meta)
            (root / name / "meta.json").write_text(text)
        return root / name

    older = folder("0123456789abcdef0123", {"format": 3, "files": [str(other)]})
    survivors = [
        folder("1" * 20, {"format": 5}),  # a newer attnlab's, sharing the folder
        folder("2" * 20, {"format": 4, "files": [str(other)]}),  # format 4, no file keys
        folder("3" * 20, None),  # no meta.json
        folder("4" * 20, "{not json"),
        folder("5" * 20, {"format": "3"}),
        folder("6" * 20, {"format": 4, "file_keys": "/gone"}),
        folder("7" * 20, {"format": 4, "file_keys": [["gone.txt", 1, 2, 3]]}),  # relative
        folder("8" * 20, {"format": 4, "file_keys": [[*key[:3], "3"]]}),
        folder("not-a-cache", {"format": 3}),
        folder("ABCDEF0123456789ABCD", {"format": 3}),  # not a name _fingerprint gives
        folder(f".{'9' * 20}.{os.getpid()}.{'0' * 32}.tmp", {"format": 3}),  # a live build
        other_cache,  # its file is unchanged
    ]
    (cache / ("a" * 20)).write_text('{"format": 3}')  # a file, not a folder
    (cache / ("b" * 20)).symlink_to(folder("linked", {"format": 3}, tmp_path))
    survivors += [cache / ("a" * 20), cache / ("b" * 20), tmp_path / "linked" / "meta.json"]
    capsys.readouterr()

    path = _write_blank_separated(tmp_path / "corpus.txt", ENGLISH_DOCS)
    corpus = TokenizedCorpus.build([path], minilm_tokenizer, cache)
    assert not older.exists() and corpus.directory.exists()
    assert [p for p in survivors if not p.exists()] == []
    assert "note: removed 1 corpus cache that" in capsys.readouterr().err
    cased = BertTokenizer.from_vocab(minilm_tokenizer.vocab, lowercase=False)
    TokenizedCorpus.build([path], cased, cache)  # the same file under another vocabulary
    assert corpus.directory.exists() and capsys.readouterr().err == ""


def test_a_cache_that_cannot_be_removed_does_not_stop_the_run(
    tmp_path: Path,
    minilm_tokenizer: BertTokenizer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    cache = tmp_path / "cache"
    stale = cache / ("c" * 20)
    stale.mkdir(parents=True)
    (stale / "meta.json").write_text('{"format": 3}')
    real_rename = os.rename

    def refused(source: Path, destination: Path) -> None:
        if Path(source) == stale:
            raise PermissionError(13, "Permission denied", str(source))
        real_rename(source, destination)

    monkeypatch.setattr(corpus_cache.os, "rename", refused)
    path = _write_blank_separated(tmp_path / "corpus.txt", ENGLISH_DOCS)
    assert TokenizedCorpus.build([path], minilm_tokenizer, cache).n_documents == 3
    assert stale.is_dir() and capsys.readouterr().err == ""


def test_a_cache_that_cannot_be_written_says_where(
    tmp_path: Path, minilm_tokenizer: BertTokenizer, monkeypatch
) -> None:
    # Were "File exists: FILE" and, from the close of an array file on a full disk, a bare
    # "No space left on device" naming no path.
    import errno

    path = _write_blank_separated(tmp_path / "corpus.txt", ENGLISH_DOCS)
    with pytest.raises(AttnlabError, match=f"cache directory {path} is a file, not a directory"):
        TokenizedCorpus.build([path], minilm_tokenizer, path)

    def full_disk(*args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(corpus_cache, "_write_corpus", full_disk)
    cache = tmp_path / "cache"
    with pytest.raises(OSError) as caught:
        TokenizedCorpus.build([path], minilm_tokenizer, cache)
    assert list(cache.iterdir()) == []  # the scratch folder is gone
    named = Path(caught.value.filename)
    assert named.parent == cache and not named.name.startswith(".")  # the cache, not scratch

    # A cache directory that refuses new entries (read-only, or /sys as root) named the
    # scratch folder: 'Operation not permitted: /sys/kernel/.a99ca...4419.1a3d....tmp'.
    real_mkdir = Path.mkdir

    def refused(self: Path, *args: object, **kwargs: object) -> None:
        if self.name.endswith(".tmp"):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", refused)
    with pytest.raises(OSError) as caught:
        TokenizedCorpus.build([path], minilm_tokenizer, cache)
    named = Path(caught.value.filename)
    assert named.parent == cache and not named.name.startswith(".")
    assert caught.value.errno == errno.EROFS


def test_empty_corpus_is_an_error(tmp_path: Path, minilm_tokenizer: BertTokenizer) -> None:
    path = tmp_path / "empty.txt"
    path.write_text("\n  \n\n", encoding="utf-8")
    with pytest.raises(AttnlabError, match="has no text"):
        TokenizedCorpus.build([path], minilm_tokenizer, tmp_path / "cache")
    assert not list((tmp_path / "cache").iterdir())  # the failed build left nothing
    with pytest.raises(AttnlabError, match="not found"):
        TokenizedCorpus.build([tmp_path / "absent.txt"], minilm_tokenizer, tmp_path / "cache")


def test_split_holds_out_documents_drawn_from_the_whole_corpus(
    tmp_path: Path, minilm_tokenizer: BertTokenizer, tagged: tuple
) -> None:
    path = _write_blank_separated(tmp_path / "corpus.txt", ENGLISH_DOCS)
    corpus = TokenizedCorpus.build([path], minilm_tokenizer, tmp_path / "cache")
    train, held_out = corpus.split(1)
    assert train.n_documents == 2 and held_out.n_documents == 1
    (index,) = held_out.documents.tolist()
    assert [a.tolist() for a in held_out.document(0)] == [
        a.tolist() for a in corpus.document(index)
    ]
    assert train.n_sentences + held_out.n_sentences == corpus.n_sentences
    assert train.n_tokens + held_out.n_tokens == corpus.n_tokens
    with pytest.raises(AttnlabError, match="hold out"):
        corpus.split(3)
    # Across the corpus (not the last file's documents alone), disjoint, and the same draw
    # every time: it depends on no run setting.
    many = tagged[0]
    train, held_out = many.split(10)
    assert held_out.documents.tolist() == many.split(10)[1].documents.tolist()
    assert set(held_out.documents.tolist()).isdisjoint(train.documents.tolist())
    assert len(set(held_out.documents.tolist()) | set(train.documents.tolist())) == N_DOCS
    assert min(held_out.documents) < N_DOCS // 2 <= max(held_out.documents)


# ---- ExampleBuilder on a corpus whose every token names its sentence -------------------------

N_DOCS, SENTENCES_PER_DOC = 40, 24
CLS, SEP = 2, 3  # ids of train-free vocabularies below: [PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3


def _tagged_corpus(tmp_path: Path, n_docs: int = N_DOCS, seed: int = 0) -> tuple:
    """A corpus where sentence s of document d is 'dDsS' repeated 2..12 times."""
    rng = np.random.default_rng(seed)
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    documents = []
    for d in range(n_docs):
        document = []
        for s in range(SENTENCES_PER_DOC):
            tag = f"d{d}s{s}"
            vocab[tag] = len(vocab)
            document.append(" ".join([tag] * int(rng.integers(2, 13))))
        documents.append(document)
    tokenizer = BertTokenizer.from_vocab(vocab)
    path = _write_blank_separated(tmp_path / f"tagged{n_docs}.txt", documents)
    corpus = TokenizedCorpus.build([path], tokenizer, tmp_path / "cache")
    where = {i: tuple(map(int, t[1:].split("s"))) for t, i in vocab.items() if t[0] == "d"}
    return corpus, tokenizer, where


@pytest.fixture(scope="module")
def tagged(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    return _tagged_corpus(tmp_path_factory.mktemp("tagged"))


def _segments(example: Example) -> tuple[np.ndarray, np.ndarray | None]:
    """The A and B token ids of an example, checking the [CLS]/[SEP] layout and segment ids."""
    ids, types = example.input_ids, example.token_type_ids
    assert ids[0] == CLS and ids[-1] == SEP
    seps = np.flatnonzero(ids == SEP)
    assert len(seps) in (1, 2)
    first_sep = seps[0]
    assert (types[: first_sep + 1] == 0).all() and (types[first_sep + 1 :] == 1).all()
    assert example.word_starts[[0, *seps.tolist()]].all()
    if len(seps) == 1:
        return ids[1:first_sep], None
    return ids[1:first_sep], ids[first_sep + 1 : -1]


def _sentences(ids: np.ndarray, where: dict) -> tuple[set[int], list[int]]:
    """Documents and sentence numbers (in order) that a segment's tokens come from."""
    places = [where[int(i)] for i in ids]
    return {d for d, _ in places}, [s for _, s in places]


def test_nsp_examples_are_laid_out_and_labelled(tagged: tuple) -> None:
    corpus, _, where = tagged
    builder = ExampleBuilder(corpus, CLS, SEP, max_seq_len=64, objective="mlm+nsp", seed=1)
    examples = [e for epoch in range(4) for e in builder.epoch(epoch)]
    labels = np.array([e.label for e in examples])
    assert set(labels.tolist()) == {0, 1}
    # Single-sentence chunks are always NotNext (google), so the rate sits a little above
    # 1/2; with ~2,000 examples its standard deviation is about 0.011.
    assert 0.47 < labels.mean() < 0.58, labels.mean()
    untruncated_next = 0
    for example in examples:
        assert len(example.input_ids) <= 64 and example.input_ids.dtype == np.int32
        a, b = _segments(example)
        assert b is not None and len(a) >= 1 and len(b) >= 1
        a_docs, a_sentences = _sentences(a, where)
        b_docs, b_sentences = _sentences(b, where)
        assert len(a_docs) == 1 and len(b_docs) == 1
        assert a_sentences == sorted(a_sentences) and b_sentences == sorted(b_sentences)
        if example.label == 0:  # IsNext: B continues A in the same document
            assert a_docs == b_docs
            if len(a) + len(b) < 61:  # untruncated: B starts with the very next sentence
                assert b_sentences[0] == a_sentences[-1] + 1
                untruncated_next += 1
            else:  # truncation may cut B's first few short sentences from its front
                assert a_sentences[-1] < b_sentences[0] <= a_sentences[-1] + 6
        else:  # NotNext: B from another document
            assert a_docs != b_docs
    assert untruncated_next > 100


def test_sop_examples_come_from_one_document(tagged: tuple) -> None:
    corpus, _, where = tagged
    builder = ExampleBuilder(corpus, CLS, SEP, max_seq_len=64, objective="mlm+sop", seed=2)
    examples = [e for epoch in range(4) for e in builder.epoch(epoch)]
    labels = np.array([e.label for e in examples])
    assert abs(labels.mean() - 0.5) < 0.05, labels.mean()  # std ~0.012
    for example in examples:
        assert len(example.input_ids) <= 64
        a, b = _segments(example)
        a_docs, a_sentences = _sentences(a, where)
        b_docs, b_sentences = _sentences(b, where)
        assert a_docs == b_docs and len(a_docs) == 1
        if example.label == 0:
            assert a_sentences[-1] <= b_sentences[0]
        else:  # swapped: the later segment comes first
            assert a_sentences[0] >= b_sentences[-1]


def test_mlm_examples_pack_whole_sentences_across_documents(tagged: tuple) -> None:
    # RoBERTa's FULL-SENTENCES: whole sentences packed up to the length, a document's end
    # marked by an extra [SEP] and followed by the next document's sentences.
    corpus, _, where = tagged
    builder = ExampleBuilder(corpus, CLS, SEP, max_seq_len=48, objective="mlm")
    examples = list(builder.epoch(0))
    seen = Counter()
    crossing = 0
    for example in examples:
        ids = example.input_ids
        assert example.label == -1 and len(ids) <= 48 and (example.token_type_ids == 0).all()
        assert ids[0] == CLS and ids[-1] == SEP and ids[1] != SEP and ids[-2] != SEP
        assert example.word_starts[ids == SEP].all()
        parts = np.split(ids[1:-1], np.flatnonzero(ids[1:-1] == SEP))
        parts = [p[1:] if i else p for i, p in enumerate(parts)]  # drop each part's [SEP]
        crossing += len(parts) > 1
        docs_seen = []
        for part in parts:
            docs, sentences = _sentences(part, where)
            assert len(docs) == 1  # a part is one document's text
            docs_seen.append(next(iter(docs)))
            # whole sentences, in order: every sentence a part touches is in it whole
            assert sentences == sorted(sentences)
            seen.update((docs_seen[-1], s) for s in set(sentences))
        assert len(set(docs_seen)) == len(docs_seen)  # a separator moves to another document
    # most document ends fall inside an example (not only where one was full anyway)
    assert crossing >= (corpus.n_documents - 1) // 2, (crossing, corpus.n_documents)
    # Every sentence appears exactly once per epoch (no sentence is longer than 46 tokens),
    # and the examples hold the corpus's tokens plus one [SEP] per document boundary.
    assert set(seen.values()) == {1} and len(seen) == corpus.n_sentences
    separators = sum(int((e.input_ids[1:-1] == SEP).sum()) for e in examples)
    assert sum(len(e.input_ids) - 2 for e in examples) == corpus.n_tokens + separators
    # Fuller examples: 91% of the length here, where packing that stopped at each document's
    # end filled 84% (this corpus's documents are long; short ones lose more).
    assert np.mean([len(e.input_ids) for e in examples]) > 0.88 * 48


def test_epochs_mix_examples_across_documents(tagged: tuple) -> None:
    # google shuffles all of a run's instances: consecutive examples (a batch) come from
    # many documents, not one long document's run of examples.
    corpus, _, where = tagged
    builder = ExampleBuilder(corpus, CLS, SEP, max_seq_len=64, objective="mlm+nsp", seed=3)
    examples = list(builder.epoch(0))
    first_docs = [min(_sentences(_segments(e)[0], where)[0]) for e in examples]
    runs = sum(a == b for a, b in itertools.pairwise(first_docs))
    assert runs < 0.1 * len(examples), runs  # in document order most neighbours share one
    assert sorted(map(_key, examples)) == sorted(map(_key, _unshuffled(builder, 0)))


def _key(example: Example) -> tuple:
    return (tuple(example.input_ids.tolist()), example.label)


def _unshuffled(builder: ExampleBuilder, epoch: int) -> list[Example]:
    """The epoch's examples before mixing (the shuffle buffer made a no-op)."""
    original = pretraining._shuffled
    try:
        pretraining._shuffled = lambda items, size, rng, max_len: items
        return list(builder.epoch(epoch))
    finally:
        pretraining._shuffled = original


def test_examples_are_deterministic_per_seed_and_epoch(tagged: tuple) -> None:
    corpus = tagged[0]

    def ids(seed: int, epoch: int) -> list[list[int]]:
        builder = ExampleBuilder(corpus, CLS, SEP, max_seq_len=64, seed=seed)
        return [[*e.input_ids.tolist(), e.label] for e in builder.epoch(epoch)]

    assert ids(0, 3) == ids(0, 3)
    assert ids(0, 3) != ids(0, 4)
    assert ids(0, 3) != ids(1, 3)
    builder = ExampleBuilder(corpus, CLS, SEP, max_seq_len=64)
    assert builder.count_epoch(2) == len(list(builder.epoch(2)))


def test_sentences_longer_than_the_target_are_cut(tmp_path: Path) -> None:
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, "a", "##b", "c"])}
    tokenizer = BertTokenizer.from_vocab(vocab)
    documents = [["a " * 300, "c c c"], ["ab " * 150], ["c"], ["a c " * 40 + "a"]]
    path = _write_blank_separated(tmp_path / "long.txt", documents)
    corpus = TokenizedCorpus.build([path], tokenizer, tmp_path / "cache")
    for objective, short in itertools.product(("mlm", "mlm+nsp", "mlm+sop"), (0.0, 0.5)):
        builder = ExampleBuilder(
            corpus, CLS, SEP, max_seq_len=16, objective=objective, short_seq_prob=short
        )
        for epoch in range(5):
            for example in builder.epoch(epoch):
                assert 3 <= len(example.input_ids) <= 16
                if objective == "mlm":  # one segment, with a [SEP] where a document ends
                    ids = example.input_ids
                    a, b = ids[1:-1], None
                    assert ids[0] == CLS and ids[-1] == SEP and ids[1] != SEP
                else:
                    a, b = _segments(example)
                assert len(a) >= 1 and (b is None or len(b) >= 1)
                # A segment cut inside a word still begins a word.
                assert example.word_starts[1]


def test_truncation_matches_googles_loop() -> None:
    # google's truncate_seq_pair removes one token at a time from the longer segment.
    rng = np.random.default_rng(0)
    for la, lb, limit in itertools.product(range(1, 12), range(1, 12), range(2, 14)):
        a = (np.arange(la), np.ones(la, bool))
        b = (np.arange(100, 100 + lb), np.ones(lb, bool))
        new_a, new_b = pretraining._truncate_pair(a, b, limit, rng)
        ga, gb = la, lb
        while ga + gb > limit:
            if ga > gb:
                ga -= 1
            else:
                gb -= 1
        assert (len(new_a[0]), len(new_b[0])) == (ga, gb)
        # What is left is one contiguous run of each segment.
        assert np.all(np.diff(new_a[0]) == 1) and np.all(np.diff(new_b[0]) == 1)


def _synthetic_corpus(directory: Path, sentences_per_document: list[int]) -> TokenizedCorpus:
    """A cache written directly: sentence s (of any document) is the one token 5 + s % 100."""
    n = sum(sentences_per_document)
    arrays = {
        "tokens": (5 + np.arange(n) % 100).astype(np.int32),
        "word_starts": np.ones(n, np.uint8),
        "sentence_offsets": np.arange(n + 1, dtype=np.int64),
        "document_offsets": np.concatenate([[0], np.cumsum(sentences_per_document)]),
    }
    directory.mkdir()
    for name, values in arrays.items():
        values.astype(corpus_cache._ARRAYS[name]).tofile(directory / f"{name}.bin")
    lengths = {name: len(values) for name, values in arrays.items()}
    meta = {"format": corpus_cache._CACHE_FORMAT, "lengths": lengths}
    (directory / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    return TokenizedCorpus.open(directory)


@pytest.mark.parametrize("objective", ["mlm+nsp", "mlm+sop"])
def test_pair_examples_of_a_huge_document_hold_one_chunk(tmp_path: Path, objective: str) -> None:
    # The spans of a whole document were listed before its first example: 129 MB (traced)
    # for a document of a million sentences, 1.4 s before the first example.
    import tracemalloc

    corpus = _synthetic_corpus(tmp_path / "cache", [200_000, 3])
    builder = ExampleBuilder(corpus, CLS, SEP, max_seq_len=16, objective=objective, seed=0)
    next(builder._pair_examples(1, np.random.default_rng(0)))  # numpy's first-call set-up
    tracemalloc.start()
    try:
        examples = builder._pair_examples(0, np.random.default_rng(0))
        first = next(examples)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 200_000, peak  # was 26 MB
    assert len(first.input_ids) <= 16
    a, b = _segments(first)
    assert b is not None and len(a) + len(b) <= 13


def test_single_document_corpus(tmp_path: Path, minilm_tokenizer: BertTokenizer) -> None:
    # One line without blank lines is one document (whose sentences split_sentences finds).
    path = tmp_path / "one.txt"
    path.write_text("First sentence here. Second one follows! And a third.\n", encoding="utf-8")
    corpus = TokenizedCorpus.build([path], minilm_tokenizer, tmp_path / "cache")
    assert (corpus.n_documents, corpus.n_sentences) == (1, 3)
    cls, sep = minilm_tokenizer.cls_id, minilm_tokenizer.sep_id
    with pytest.raises(AttnlabError, match=r"single document.*\(use objective mlm\)"):
        ExampleBuilder(corpus, cls, sep, objective="mlm+nsp")
    assert list(ExampleBuilder(corpus, cls, sep, objective="mlm").epoch(0))
    assert list(ExampleBuilder(corpus, cls, sep, objective="mlm+sop").epoch(0))
    with pytest.raises(AttnlabError, match="unknown pretraining objective"):
        ExampleBuilder(corpus, cls, sep, objective="nsp")


def test_views_keep_examples_inside_their_documents(tagged: tuple) -> None:
    corpus, _, where = tagged
    train, held_out = corpus.split(5)
    held_docs = set(held_out.documents.tolist())
    for view, allowed in ((train, set(range(N_DOCS)) - held_docs), (held_out, held_docs)):
        builder = ExampleBuilder(view, CLS, SEP, max_seq_len=64)
        for example in builder.epoch(0):
            a, b = _segments(example)
            assert _sentences(np.concatenate([a, b]), where)[0] <= allowed


# ---- Chinese: jieba word starts on the real review corpus -----------------------------------


def test_chinese_corpus_with_jieba_word_starts(tmp_path: Path) -> None:
    import jieba  # a test dependency (the dev extra): never skipped

    with gzip.open(ZH_REVIEWS, "rt", encoding="utf-8") as stream:
        lines = list(itertools.islice(stream, 2000))
    path = tmp_path / "reviews.txt"
    path.write_text("".join(lines), encoding="utf-8")
    tokenizer = train_wordpiece([path], vocab_size=3000)
    corpus = TokenizedCorpus.build([path], tokenizer, tmp_path / "cache", chinese_words=True)
    documents = list(read_documents(path))
    assert corpus.n_documents == len(documents)

    # For a sample of sentences, the word starts of Chinese characters are jieba's.
    sentence = 0
    checked_multi_char_words = 0
    for document in documents[:60]:
        for text in document:
            starts = corpus.sentence_word_starts(sentence).astype(bool)
            encoding = tokenizer.backend.encode(text, add_special_tokens=False)
            assert corpus.sentence(sentence).tolist() == encoding.ids
            jieba_starts = {start for _, start, _ in jieba.tokenize(text)}
            for flag, (begin, _) in zip(starts, encoding.offsets, strict=True):
                if chinese_words._is_cjk(text[begin]):
                    assert flag == (begin in jieba_starts)
            checked_multi_char_words += sum(len(w) > 1 for w, _, _ in jieba.tokenize(text))
            sentence += 1
    assert checked_multi_char_words > 100
    assert corpus.word_starts.mean() < 0.9  # words of several characters are common

    for objective in ("mlm", "mlm+nsp", "mlm+sop"):
        builder = ExampleBuilder(corpus, tokenizer.cls_id, tokenizer.sep_id, 128, objective)
        examples = list(itertools.islice(builder.epoch(0), 200))
        assert examples and all(len(e.input_ids) <= 128 for e in examples)


def test_jieba_never_splits_a_wordpiece_word(tmp_path: Path) -> None:
    # With tokenize_chinese_chars off (a checkpoint's tokenizer_config.json may say so),
    # "我们中国人" is one WordPiece word: 我 ##们 ##中 ##国 ##人. jieba's 我们|中国|人 may
    # join ideographs into words but never make a '##' piece start one, or whole-word
    # masking would mask ##中 ##国 and leave the rest of the word (HF's reference ids only
    # add continuations).
    import jieba  # noqa: F401  (the dev extra: a missing jieba fails, never skips)

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for token in ["我", "##们", "##中", "##国", "##人", "们", "中", "国", "人"]:
        vocab[token] = len(vocab)
    path = tmp_path / "corpus.txt"
    path.write_text("我们中国人\n", encoding="utf-8")
    for chinese_chars, starts in ((False, [1, 0, 0, 0, 0]), (True, [1, 0, 1, 0, 1])):
        tokenizer = BertTokenizer.from_vocab(vocab, tokenize_chinese_chars=chinese_chars)
        corpus = TokenizedCorpus.build([path], tokenizer, tmp_path / "cache", chinese_words=True)
        # (ideographs of their own, True, still start words where jieba starts one)
        assert corpus.sentence_word_starts(0).tolist() == starts


def test_chinese_words_without_jieba_is_a_clear_error(
    tmp_path: Path, minilm_tokenizer: BertTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "jieba", None)  # makes `import jieba` fail
    path = _write_blank_separated(tmp_path / "corpus.txt", [["中文句子。"]])
    with pytest.raises(AttnlabError, match="pip install jieba"):
        TokenizedCorpus.build([path], minilm_tokenizer, tmp_path / "cache", chinese_words=True)


def test_whole_word_masking_of_english_needs_no_jieba(
    tmp_path: Path, minilm_tokenizer: BertTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # jieba only joins ideographs: a corpus without any builds without it, and its word
    # starts are the '##' rule's, as without chinese_words.
    path = _write_blank_separated(tmp_path / "corpus.txt", [["Unaffable words.", "Two."]])
    plain = TokenizedCorpus.build([path], minilm_tokenizer, tmp_path / "plain")
    monkeypatch.setitem(sys.modules, "jieba", None)  # makes `import jieba` fail
    words = TokenizedCorpus.build([path], minilm_tokenizer, tmp_path / "w", chinese_words=True)
    assert words.word_starts.tolist() == plain.word_starts.tolist()
    assert 0 in words.word_starts.tolist()  # a '##' piece is in there


def test_the_ideograph_pattern_is_is_cjk() -> None:
    edges = [0x3400, 0x4DBF, 0x4E00, 0x9FFF, 0xF900, 0xFAFF, 0x20000, 0x2A6DF, 0x2A700]
    edges += [0x2B73F, 0x2B740, 0x2B81F, 0x2B820, 0x2CEAF, 0x2F800, 0x2FA1F]
    codes = {c + d for c in edges for d in (-1, 0, 1)} | set(range(0x3000, 0x3500))
    for code in sorted(codes):
        char = chr(code)
        assert bool(chinese_words._IDEOGRAPH.match(char)) == chinese_words._is_cjk(char), hex(code)
