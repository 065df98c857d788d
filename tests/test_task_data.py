"""Task readers, label sets and featurisation: tiny files, the real shared data, MiniLM's vocab."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import SHARED_DATA

from attnlab.errors import AttnlabError
from attnlab.text.tasks import (
    IGNORE_INDEX,
    LabelSet,
    QAExample,
    TextExample,
    WordExample,
    align_labels,
    best_span,
    count_truncated_words,
    decode_answers,
    encode_squad,
    encode_texts,
    encode_words,
    read_conll,
    read_squad,
    read_table,
    split_by_article,
    to_bio,
    word_predictions,
)
from attnlab.text.tokenizer import BertTokenizer


def write(path: Path, text: str | bytes) -> Path:
    """Write text (or bytes), gzip-compressed when the name ends in .gz."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


@pytest.fixture(scope="module")
def tokenizer(minilm_dir: Path) -> BertTokenizer:
    return BertTokenizer.from_dir(minilm_dir)


# ---- read_table -------------------------------------------------------------------------


@pytest.mark.parametrize("gz", ["", ".gz"])
def test_read_tsv_keeps_quotes_and_strips_spaces(tmp_path, gz):
    path = write(tmp_path / f"t.tsv{gz}", 'sentence\tlabel\nhe said "hi \t1\n\nok .\t0\n')
    examples = read_table(path, "sentence")
    assert examples == [TextExample('he said "hi', None, "1", 2), TextExample("ok .", None, "0", 4)]


@pytest.mark.parametrize("gz", ["", ".gz"])
def test_read_csv_with_quoted_fields_counts_lines(tmp_path, gz):
    text = 'label,review,other\n1,"a, b ""c""",x\n0,"two\nlines",y\n1,last,z\n'
    examples = read_table(write(tmp_path / f"t.csv{gz}", text), "review", "other")
    assert [(e.text, e.pair, e.label, e.line) for e in examples] == [
        ('a, b "c"', "x", "1", 2),
        ("two\nlines", "y", "0", 3),
        ("last", "z", "1", 5),
    ]


@pytest.mark.parametrize(
    ("name", "text"),
    [("cr.tsv", "text\tlabel\rhi\t1\ryo\t0\r"), ("cr.csv", "text,label\nhi\rthere,1\n")],
)
def test_a_bare_carriage_return_is_named(tmp_path, name, text):
    # csv's own words ("new-line character seen in unquoted field - do you need to open the
    # file in universal-newline mode?") name a setting the user cannot reach
    path = tmp_path / name
    path.write_bytes(text.encode())
    with pytest.raises(AttnlabError, match=r"line [12]: a carriage return \(CR\) outside a quoted"):
        read_table(path)


@pytest.mark.parametrize("line", ["[" * 100_000, '{"text": "a", "label": ' + "9" * 5000 + "}"])
def test_read_jsonl_too_deep_or_too_long_a_number_is_named(tmp_path, line):
    # were a RecursionError and a ValueError traceback
    with pytest.raises(AttnlabError, match=r"t\.jsonl, line 1: not valid JSON"):
        read_table(write(tmp_path / "t.jsonl", line + "\n"))


@pytest.mark.parametrize("gz", ["", ".gz"])
def test_read_jsonl_numbers_become_floats(tmp_path, gz):
    lines = [{"text": "a", "label": 1}, {"text": "b", "label": 2.5}, {"text": "c", "label": "pos"}]
    text = "\n".join(json.dumps(line) for line in lines) + "\n\n"
    examples = read_table(write(tmp_path / f"t.jsonl{gz}", text))
    assert [e.label for e in examples] == [1.0, 2.5, "pos"]
    assert [e.line for e in examples] == [1, 2, 3]


def test_read_table_without_labels_and_without_header(tmp_path):
    path = write(tmp_path / "t.tsv", "q1\tq2\t1\nq3\tq4\t0\n")
    examples = read_table(path, "a", "b", None, columns=["a", "b", "label"])
    assert [(e.text, e.pair, e.label, e.line) for e in examples] == [
        ("q1", "q2", None, 1),
        ("q3", "q4", None, 2),
    ]


@pytest.mark.parametrize("suffix", [".tsv", ".csv"])
def test_named_columns_skip_a_header_row_that_repeats_them(tmp_path, suffix):
    # Before, the header of a file read with --columns became an example labelled "label".
    sep = "\t" if suffix == ".tsv" else ","
    rows = ["a", "b", "label"], ["q1", "q2", "1"], ["q3", "q4", "0"]
    path = write(tmp_path / f"t{suffix}", "".join(sep.join(row) + "\n" for row in rows))
    examples = read_table(path, "a", "b", "label", columns=["a", "b", "label"])
    assert [(e.text, e.pair, e.label, e.line) for e in examples] == [
        ("q1", "q2", "1", 2),
        ("q3", "q4", "0", 3),
    ]
    # a first row that names other columns is data
    examples = read_table(path, "x", "y", "z", columns=["x", "y", "z"])
    assert [e.text for e in examples] == ["a", "q1", "q3"]


def test_skip_empty_drops_rows_with_a_warning(tmp_path):
    path = write(tmp_path / "t.csv", "label,review\n1,good\n0,\n")
    with pytest.warns(UserWarning, match="skipped 1 row"):
        assert len(read_table(path, "review", skip_empty=True)) == 1


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("t.txt", "x", "unknown table format"),
        ("t.tsv", "", "is empty"),
        ("t.tsv", "text\tlabel\n", "holds no rows"),
        ("t.tsv", "sentence\tlabel\nx\t1\n", "no column 'text'; columns present: sentence, label"),
        ("t.tsv", "text\tlabel\na\t1\nb\n", r"line 3: 1 field\(s\), expected 2"),
        ("t.tsv", "text\tlabel\na\t1\n \t0\n", "line 3: empty 'text' field"),
        ("t.tsv", "text\tlabel\na\t1\nb\t\n", "line 3: empty 'label' field"),
        ("t.csv", b"text,label\na,1\n\xff\xfe,0\n", "line 3: not valid UTF-8"),
        ("t.jsonl", '{"text": "a", "label": 1}\n{"text": "b"\n', "line 2: not valid JSON"),
        ("t.jsonl", '{"text": "a", "label": 1}\n{"label": 1}\n', "line 2: no 'text' field"),
        ("t.jsonl", '{"sentence": "a"}\n', "no column 'text'; columns present: sentence"),
        ("t.jsonl", "[1, 2]\n", "line 1: expected a JSON object"),
        # JSON's \\ud800 alone is no character: a bare TypeError from the tokenizer (a text),
        # or "cannot write" after training, with a half-written --out (a label)
        ("t.jsonl", '{"text": "a \\ud800 b", "label": 1}\n', "line 1: .* surrogate pair"),
        ("t.jsonl", '{"text": "a", "label": "\\udc00"}\n', "line 1: .* surrogate pair"),
    ],
)
def test_read_table_errors_name_file_and_line(tmp_path, name, content, message):
    path = write(tmp_path / name, content)
    with pytest.raises(AttnlabError, match=message) as error:
        read_table(path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_read_table_missing_file(tmp_path):
    with pytest.raises(AttnlabError, match="not found"):
        read_table(tmp_path / "nope.tsv")


def test_real_tables():
    sst2 = read_table(SHARED_DATA / "sst2" / "dev.tsv.gz", "sentence")
    assert len(sst2) == 872
    assert {e.label for e in sst2} == {"0", "1"} and not sst2[0].text.endswith(" ")
    assert len(read_table(SHARED_DATA / "sst2" / "test.tsv.gz", "sentence", None, None)) == 1821
    stsb = read_table(SHARED_DATA / "stsb" / "dev.tsv.gz", "sentence1", "sentence2", "score")
    assert len(stsb) == 1500
    assert LabelSet.from_examples([e.label for e in stsb], "scores").kind == "scores"
    afqmc = read_table(
        SHARED_DATA / "afqmc" / "dev.tsv.gz",
        "sentence1",
        "sentence2",
        columns=["sentence1", "sentence2", "label"],
    )
    assert len(afqmc) == 4316 and sum(e.label == "1" for e in afqmc) == 1338
    senti = read_table(SHARED_DATA / "chnsenticorp" / "dev.tsv.gz", "text_a")
    assert len(senti) == 1200 and sum(e.label == "1" for e in senti) == 593


# ---- LabelSet ---------------------------------------------------------------------------


def test_label_set_classes_sort_numerically_and_round_trip():
    labels = LabelSet.from_examples(["10", "2", "1", "2", 10.0], "classes")
    assert labels.names == ["1", "2", "10"]
    assert labels.encode("10") == 2 and labels.encode(2.0) == 1 and labels.decode(0) == "1"
    config = labels.to_config()
    assert config == {
        "id2label": {"0": "1", "1": "2", "2": "10"},
        "label2id": {"1": 0, "2": 1, "10": 2},
    }
    assert LabelSet.from_config(json.loads(json.dumps(config))) == labels


def test_label_set_words_and_bio_tags():
    assert LabelSet.from_examples(["pos", "neg", "pos"], "classes").names == ["neg", "pos"]
    tags = LabelSet.from_examples(["B-PER", "O", "I-PER", "B-LOC", "O"], "classes")
    assert tags.names == ["O", "B-LOC", "B-PER", "I-PER"]


def test_label_set_scores():
    scores = LabelSet.from_examples(["5.000", 0.5, "3"], "scores")
    assert scores.num_labels == 1 and scores.encode("4.25") == 4.25
    config = scores.to_config()
    assert config["problem_type"] == "regression"
    assert LabelSet.from_config(config).kind == "scores"


@pytest.mark.parametrize(
    ("labels", "kind", "message"),
    [
        (["1.0", "2.5", "good", "bad"], "scores", "label 'good' is not a number"),
        (["0", "1", "maybe"], "classes", "mixed label types"),
        (["pos", None], "classes", "example 2 has no label"),
        (["0.5", "3.8"], "classes", "real-valued scores"),
        ([], "classes", "no labels"),
        (["a"], "tags", "label kind"),
    ],
)
def test_label_set_errors(labels, kind, message):
    with pytest.raises(AttnlabError, match=message):
        LabelSet.from_examples(labels, kind)


def test_label_set_unknown_label_lists_known():
    labels = LabelSet.from_examples(["neg", "pos"], "classes")
    with pytest.raises(AttnlabError, match=r"unknown label 'neutral'; known labels: \[neg, pos\]"):
        labels.encode("neutral")
    with pytest.raises(AttnlabError, match="out of range"):
        labels.decode(2)
    with pytest.raises(AttnlabError, match=r"ids must be 0\.\.1"):
        LabelSet.from_config({"id2label": {"0": "a", "2": "b"}})


# ---- CoNLL ------------------------------------------------------------------------------

CONLL = """-DOCSTART- -X- -X- O

EU NNP I-NP B-ORG
rejects VBZ I-VP O
German JJ I-NP B-MISC

Peter NNP I-NP B-PER
Blackburn NNP I-NP I-PER
"""


@pytest.mark.parametrize("gz", ["", ".gz"])
def test_read_conll(tmp_path, gz):
    examples = read_conll(write(tmp_path / f"t.txt{gz}", CONLL))
    assert examples == [
        WordExample(["EU", "rejects", "German"], ["B-ORG", "O", "B-MISC"], 3),
        WordExample(["Peter", "Blackburn"], ["B-PER", "I-PER"], 7),
    ]


def test_read_conll_character_per_line_and_untagged(tmp_path):
    path = write(tmp_path / "msra.txt", "中\tB-ORG\n共\tI-ORG\n\n\n我\tO\n")
    assert [e.words for e in read_conll(path)] == [["中", "共"], ["我"]]
    assert read_conll(path, tag_column=None)[1] == WordExample(["我"], None, 5)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("EU B-ORG\nrejects\n", "line 2: expected a token and a tag"),
        ("EU B-ORG\n\nrejects X-VERB\n", "line 3: tag 'X-VERB' is not O, B-TYPE or I-TYPE"),
        ("-DOCSTART- -X- O O\n\n\n", "holds no sentences"),
        (b"EU B-ORG\n\xc3\n", "line 2: not valid UTF-8"),
        ("EU NNP B-ORG\nrejects VBZ\n", "line 2: 2 columns where line 1 has 3"),
    ],
)
def test_read_conll_errors(tmp_path, content, message):
    with pytest.raises(AttnlabError, match=message):
        read_conll(write(tmp_path / "bad.txt", content))


def test_read_conll_refuses_running_text_as_tokens(tmp_path):
    # Sentences a line (no tags to read) once passed as one sentence of each line's first word.
    text = "Angela Merkel visited Paris on Monday .\nGoogle opened an office .\n"
    with pytest.raises(AttnlabError, match="line 2: 5 columns where line 1 has 7"):
        read_conll(write(tmp_path / "plain.txt", text), tag_column=None)


def test_to_bio():
    assert to_bio(["I-PER", "I-PER", "O", "I-LOC", "B-LOC", "I-LOC", "I-ORG"]) == [
        "B-PER",
        "I-PER",
        "O",
        "B-LOC",
        "B-LOC",
        "I-LOC",
        "B-ORG",
    ]


def test_real_conll_and_msra():
    test = read_conll(SHARED_DATA / "conll2003" / "test.bio.txt.gz")
    assert len(test) == 3453 and sum(len(e.words) for e in test) == 46435
    # The IOB1 file (I- starts most entities) reads as the BIO file does: the same entities.
    with gzip.open(SHARED_DATA / "conll2003" / "test.iob1.txt.gz", "rt") as raw:
        assert sum(line.split()[-1].startswith("B-") for line in raw if line.strip()) < 1000
    iob1 = read_conll(SHARED_DATA / "conll2003" / "test.iob1.txt.gz")
    assert [e.tags for e in iob1] == [e.tags for e in test]
    assert sum(tag.startswith("B-") for e in test for tag in e.tags) > 5000
    msra = read_conll(SHARED_DATA / "msra-ner" / "test.txt.gz")
    assert len(msra) == 4631 and sum(len(e.words) for e in msra) == 172601
    assert all(len(word) == 1 for e in msra[:200] for word in e.words)


# ---- SQuAD reading ----------------------------------------------------------------------


def squad_json(context: str, answers: list[dict], qid: str = "q1", title: str = "T") -> str:
    qas = [{"id": qid, "question": "Where?", "answers": answers}]
    return json.dumps(
        {"data": [{"title": title, "paragraphs": [{"context": context, "qas": qas}]}]}
    )


def test_read_squad_gz(tmp_path):
    text = squad_json("In Paris today.", [{"text": "Paris", "answer_start": 3}])
    [example] = read_squad(write(tmp_path / "s.json.gz", text))
    assert example == QAExample(
        "q1", "T", "Where?", "In Paris today.", [{"text": "Paris", "answer_start": 3}]
    )


def test_read_squad_fixes_offsets_to_nearest_occurrence(tmp_path):
    context = "ab xx ab yy ab"
    answers = [
        {"text": "ab", "answer_start": 7},  # off by one: nearest "ab" is at 6
        {"text": "zz", "answer_start": -1},  # not in the context at all
    ]
    path = write(tmp_path / "s.json", squad_json(context, answers))
    with pytest.warns(UserWarning, match="moved 1 answer offset.*1 answer"):
        [example] = read_squad(path)
    assert example.answers == [{"text": "ab", "answer_start": 6}]
    assert example.other_answers == ["zz"]
    with pytest.raises(AttnlabError, match="question 'q1': answer 'ab' is not at offset 7"):
        read_squad(path, fix_offsets=False)


def _squad_with(
    question: object = "Where?", text: object = "ab", answer_start: object = 0, qid: object = "q1"
) -> str:
    """One-question SQuAD JSON text with the given fields (answer_start may be raw JSON)."""
    answer = json.dumps({"text": text, "answer_start": 0}).replace(
        '"answer_start": 0', f'"answer_start": {answer_start}'
    )
    qa = f'{{"id": {json.dumps(qid)}, "question": {json.dumps(question)}, "answers": [{answer}]}}'
    return f'{{"data": [{{"paragraphs": [{{"context": "ab cd", "qas": [{qa}]}}]}}]}}'


UNANSWERED = _squad_with().replace('[{"text": "ab", "answer_start": 0}]', "[]")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"version": 1}', "not SQuAD-style JSON"),
        ('{"data": [{"paragraphs": [{"qas": []}]}]}', "not SQuAD-style JSON"),
        ('{"data": []}', "holds no questions"),
        ("{", "not valid JSON"),
        # each was a traceback, or trained on the text "None" / a blank answer
        ("[" * 100_000, "not valid JSON"),
        ('{"data": [' + "9" * 5000 + "]}", "not valid JSON"),
        (_squad_with(answer_start="Infinity"), "not SQuAD-style JSON"),
        (_squad_with(question=None), "question 'q1' is not a string"),
        (_squad_with(question=["a", "b"]), "question 'q1' is not a string"),
        (_squad_with(text="  "), "question 'q1' has an empty answer"),
        (_squad_with(text=["a"]), r"has an answer that is not text: \[.a.\]"),
        (_squad_with(qid=None), r"id None after .\(first question\). is neither text nor a number"),
        (_squad_with(qid=["a"]), "is neither text nor a number"),
        # each was a bare TypeError from the tokenizer
        (_squad_with(question="Wh\ud800ere?"), r"'Wh\\ud800ere\?' holds the escape \\ud800"),
        (UNANSWERED.replace('"ab cd"', "7"), "the context of question 'q1' is not text"),
    ],
)
def test_read_squad_errors(tmp_path, content, message):
    with pytest.raises(AttnlabError, match=message):
        read_squad(write(tmp_path / "s.json", content))


def test_split_by_article_alternates_sorted_titles():
    examples = [QAExample(str(i), title, "q", "c", []) for i, title in enumerate("dbcaab")]
    train, held_out = split_by_article(examples)
    # Sorted titles a, b, c, d: a and c train, b and d held out.
    assert [e.title for e in train] == ["c", "a", "a"]
    assert [e.title for e in held_out] == ["d", "b", "b"]
    with pytest.raises(AttnlabError):
        split_by_article(examples, 1)


def test_real_squad_and_cmrc(recwarn):
    squad = read_squad(SHARED_DATA / "squad1.1" / "dev-v1.1.json.gz")
    assert len(squad) == 10570 and sum(len(e.answers) for e in squad) == 34726
    assert len({e.title for e in squad}) == 48 and len(recwarn) == 0
    train, held_out = split_by_article(squad)
    assert len(train) + len(held_out) == 10570
    assert not {e.title for e in train} & {e.title for e in held_out}
    trial = read_squad(SHARED_DATA / "cmrc2018" / "cmrc2018_trial.json.gz")
    assert len(trial) == 1002
    dev = read_squad(SHARED_DATA / "cmrc2018" / "cmrc2018_dev.json.gz")
    assert len(dev) == 3219 and sum(len(e.other_answers) for e in dev) == 193
    assert all(e.answers for e in dev)  # every question keeps a trainable answer
    for e in dev + trial:
        for a in e.answers:
            assert e.context[a["answer_start"] :].startswith(a["text"])


# ---- text featurisation -----------------------------------------------------------------


def test_encode_texts_matches_tokenizer(tokenizer):
    examples = [TextExample("A short one.", "And its pair"), TextExample("word " * 50, "x y")]
    features = encode_texts(tokenizer, examples, max_length=16)
    for example, feature in zip(examples, features, strict=True):
        expected = tokenizer.encode(example.text, example.pair, max_length=16)
        assert feature == {"input_ids": expected.ids, "token_type_ids": expected.type_ids}
    assert len(features[1]["input_ids"]) == 16
    single = encode_texts(tokenizer, [TextExample("hello")], 8)[0]
    assert single["input_ids"] == [
        tokenizer.cls_id,
        *tokenizer.convert_tokens_to_ids(["hello"]),
        tokenizer.sep_id,
    ]


def test_encode_texts_rejects_mixed_pairs(tokenizer):
    with pytest.raises(AttnlabError, match="pair"):
        encode_texts(tokenizer, [TextExample("a", "b"), TextExample("c")], 8)


# ---- word featurisation -----------------------------------------------------------------


def test_align_labels_tricky_cases():
    # [CLS] word0 split in 3 pieces, word1 one piece, word2 two pieces [SEP]
    assert align_labels([-1, 0, 0, 0, 1, 2, 2, -1], [5, 6, 7]) == [
        IGNORE_INDEX,
        5,
        IGNORE_INDEX,
        IGNORE_INDEX,
        6,
        7,
        IGNORE_INDEX,
        IGNORE_INDEX,
    ]
    # Chinese: one character per word, so every token is a first sub-token.
    assert align_labels([-1, 0, 1, 2, -1], [1, 2, 0]) == [IGNORE_INDEX, 1, 2, 0, IGNORE_INDEX]
    # Truncated: word 2 is gone, word 1 lost its second piece.
    assert align_labels([-1, 0, 1, -1], [3, 4, 5]) == [IGNORE_INDEX, 3, 4, IGNORE_INDEX]


def test_word_predictions_inverts_alignment():
    word_ids = [-1, 0, 0, 1, 2, 2, -1]
    token_predictions = [9, 4, 8, 5, 6, 8, 9]
    assert word_predictions(word_ids, token_predictions, n_words=3, fill=0) == [4, 5, 6]
    # Words 2 and 3 were cut off by truncation: they get the fill label.
    assert word_predictions([-1, 0, 1, -1], [9, 4, 5, 9], n_words=4, fill=0) == [4, 5, 0, 0]


def test_encode_words_aligns_first_sub_tokens(tokenizer):
    words = ["Antidisestablishmentarianism", "\u200b", "in", "北京", "don't"]
    tags = ["B-MISC", "O", "O", "B-LOC", "O"]
    labels = LabelSet.from_examples(tags, "classes")
    [feature] = encode_words(tokenizer, [WordExample(words, tags)], labels, max_length=64)
    ids, word_ids = feature["input_ids"], feature["word_ids"]
    assert ids[0] == tokenizer.cls_id and ids[-1] == tokenizer.sep_id
    assert word_ids[0] == word_ids[-1] == -1
    # Every word keeps at least one token; the zero-width word is [UNK].
    firsts = [word_ids.index(w) for w in range(len(words))]
    assert ids[firsts[1]] == tokenizer.unk_id and word_ids.count(1) == 1
    assert word_ids.count(0) > 1 and word_ids.count(3) == 2  # long word split; 北 京
    pieces = tokenizer.tokenize("Antidisestablishmentarianism")
    assert ids[1 : 1 + len(pieces)] == tokenizer.convert_tokens_to_ids(pieces)
    # Labels sit on first sub-tokens only, and the prediction path inverts them.
    expected = [labels.encode(tag) for tag in tags]
    assert [feature["labels"][i] for i in firsts] == expected
    assert sum(label != IGNORE_INDEX for label in feature["labels"]) == len(words)
    predicted = [label if label != IGNORE_INDEX else 99 for label in feature["labels"]]
    assert word_predictions(word_ids, predicted, len(words), fill=0) == expected


def test_encode_words_matches_hf_word_ids(tokenizer, hf_tokenizer):
    examples = read_conll(SHARED_DATA / "conll2003" / "test.bio.txt.gz")[:200]
    features = encode_words(tokenizer, examples, None, max_length=512)
    for example, feature in zip(examples, features, strict=True):
        reference = hf_tokenizer(example.words, is_split_into_words=True)
        assert feature["input_ids"] == reference["input_ids"]
        assert feature["word_ids"] == [-1 if w is None else w for w in reference.word_ids()]
        assert "labels" not in feature


def test_encode_words_truncation_is_counted(tokenizer):
    examples = [WordExample(["good"] * 10, ["O"] * 10), WordExample(["a", "b"], ["O", "O"])]
    labels = LabelSet.from_examples(["O"], "classes")
    features = encode_words(tokenizer, examples, labels, max_length=6)
    assert [len(f["input_ids"]) for f in features] == [6, 4]
    assert features[0]["input_ids"][-1] == tokenizer.sep_id
    assert features[0]["word_ids"] == [-1, 0, 1, 2, 3, -1]
    assert count_truncated_words(features, examples) == 6
    with pytest.raises(AttnlabError, match="no tags"):
        encode_words(tokenizer, [WordExample(["a"], None, 7)], labels, 8)


# ---- QA featurisation -------------------------------------------------------------------


def one_token_words(tokenizer: BertTokenizer, n: int) -> list[str]:
    """n distinct lowercase words that are each one token of the vocabulary."""
    words = sorted(w for w in tokenizer.vocab if w.isascii() and w.isalpha() and len(w) > 3)
    return words[:n]


def test_windows_at_stride_boundaries(tokenizer):
    words = one_token_words(tokenizer, 80)
    context = " ".join(words)
    max_length, stride, question = 24, 6, "what"
    room = max_length - 1 - 3  # context tokens per window
    step = room - stride
    for first in range(0, 60):
        for length in (1, 2):
            text = " ".join(words[first : first + length])
            start = context.index(f" {text} ") + 1 if first else 0
            example = QAExample(
                "q", "t", question, context, [{"text": text, "answer_start": start}]
            )
            features = encode_squad(tokenizer, [example], max_length, stride)
            windows = [k for k, f in enumerate(features) if f.start_position > 0]
            # Window k covers context tokens [k * step, k * step + room).
            expected = [
                k
                for k in range(len(features))
                if k * step <= first and first + length <= k * step + room
            ]
            assert windows == expected, (first, length)
            for k in windows:
                f = features[k]
                assert f.offsets[f.start_position][0] == start
                assert f.offsets[f.end_position][1] == start + len(text)
                assert all(len(x.input_ids) <= max_length for x in features)


def test_every_gold_answer_is_located_in_each_window(tokenizer):
    # Three annotators: two agree, the third picks a span further on, which some windows
    # hold whole and some do not (those point it at [CLS]).
    words = one_token_words(tokenizer, 60)
    context = " ".join(words)
    spans = [(10, 2), (10, 2), (22, 3)]  # (first word, words)
    answers = []
    for first, length in spans:
        text = " ".join(words[first : first + length])
        answers.append({"text": text, "answer_start": context.index(f" {text} ") + 1})
    example = QAExample("q", "t", "what", context, answers)
    features = encode_squad(tokenizer, [example], max_length=24, doc_stride=6)
    assert len(features) > 3
    seen = [0, 0, 0]
    for f in features:
        assert len(f.answer_positions) == 3
        context_chars = [span for span in f.offsets if span is not None]
        for k, ((start, end), answer) in enumerate(zip(f.answer_positions, answers, strict=True)):
            begin, stop = answer["answer_start"], answer["answer_start"] + len(answer["text"])
            inside = context_chars[0][0] <= begin and stop <= context_chars[-1][1]
            if not inside:
                assert (start, end) == (0, 0)
                continue
            seen[k] += 1
            assert (f.offsets[start][0], f.offsets[end][1]) == (begin, stop)
    assert all(seen) and seen[0] == seen[1]
    [no_answer] = encode_squad(tokenizer, [QAExample("q", "t", "what", "short", [])], 24, 6)
    assert no_answer.answer_positions == [] and no_answer.start_position == 0


def test_windows_match_hf_overflow(tokenizer, hf_tokenizer):
    examples = read_squad(SHARED_DATA / "squad1.1" / "dev-v1.1.json.gz")[:60]
    features = encode_squad(tokenizer, examples, max_length=128, doc_stride=32)
    for index, example in enumerate(examples):
        reference = hf_tokenizer(
            example.question,
            example.context,
            truncation="only_second",
            max_length=128,
            stride=32,
            return_overflowing_tokens=True,
        )
        mine = [f for f in features if f.example_index == index]
        assert [f.input_ids for f in mine] == reference["input_ids"]
        assert [f.token_type_ids for f in mine] == reference["token_type_ids"]


def test_chinese_qa_offsets_are_per_character(tokenizer):
    context = "北京是中国的首都，也是一座历史名城。"
    answer = {"text": "中国的首都", "answer_start": context.index("中国的首都")}
    example = QAExample("zh", "t", "北京是什么？", context, [answer])
    [feature] = encode_squad(tokenizer, [example], max_length=64, doc_stride=8)
    spans = [span for span in feature.offsets if span is not None]
    assert all(end - start == 1 for start, end in spans)
    assert "".join(context[s:e] for s, e in spans) == context
    start, end = feature.offsets[feature.start_position], feature.offsets[feature.end_position]
    assert context[start[0] : end[1]] == "中国的首都"
    assert feature.token_type_ids.count(1) == len(spans) + 1


def test_question_is_truncated_and_room_checked(tokenizer):
    example = QAExample("q", "t", "why " * 100, "some context here", [])
    [feature] = encode_squad(
        tokenizer, [example], max_length=32, doc_stride=4, max_question_length=8
    )
    assert feature.token_type_ids.count(0) == 8 + 2
    assert feature.start_position == feature.end_position == 0
    with pytest.raises(AttnlabError, match="doc_stride"):
        encode_squad(tokenizer, [example], max_length=16, doc_stride=8, max_question_length=8)


def test_best_span_rules():
    offsets = [None, None, (0, 3), (4, 7), (8, 11), (12, 15), None]
    start = [9.0, 9.0, 1.0, 0.0, 3.0, 0.0, 9.0]  # question and special tokens score highest
    end = [9.0, 9.0, 0.0, 0.0, 0.0, 2.0, 9.0]
    assert best_span(start, end, offsets) == (8, 15, 5.0)
    # A length limit of one token forbids 4..5: the best single token wins.
    assert best_span(start, end, offsets, max_answer_length=1) == (8, 11, 3.0)
    # End before start is never chosen: 4..2 would score 9.
    assert best_span([0, 0, 0, 0, 5, 0, 0], [0, 0, 4, 0, 1, 0, 0], offsets) == (8, 11, 6.0)
    # Padding beyond the window is ignored; a window without context has no span.
    assert best_span([*start, 99.0], [*end, 99.0], offsets) == (8, 15, 5.0)
    assert best_span([1.0, 2.0], [1.0, 2.0], [None, None]) is None


def test_decode_answers_round_trips_gold_spans(tokenizer):
    squad = read_squad(SHARED_DATA / "squad1.1" / "dev-v1.1.json.gz")[:400]
    features = encode_squad(tokenizer, squad, max_length=128, doc_stride=32)
    starts, ends = [], []
    for feature in features:
        start, end = np.zeros(128), np.zeros(128)  # padded to the batch length
        start[feature.start_position] = end[feature.end_position] = 10.0
        starts.append(start)
        ends.append(end)
    predictions = decode_answers(squad, features, np.stack(starts), np.stack(ends))
    golds = [e.answers[0]["text"] for e in squad]
    exact = sum(predictions[e.id] == gold for e, gold in zip(squad, golds, strict=True))
    # The rest are answers that end inside a word ("gold" in "golden"): a token holds more.
    assert exact >= 0.97 * len(squad)
    assert all(gold in predictions[e.id] for e, gold in zip(squad, golds, strict=True))


def test_decode_answers_chinese(tokenizer):
    with pytest.warns(UserWarning, match="moved 5 answer offset"):
        cmrc = read_squad(SHARED_DATA / "cmrc2018" / "cmrc2018_trial.json.gz")
    cmrc = cmrc[:150]
    features = encode_squad(tokenizer, cmrc, max_length=384, doc_stride=128)
    starts = [np.eye(len(f.input_ids))[f.start_position] for f in features]
    ends = [np.eye(len(f.input_ids))[f.end_position] for f in features]
    predictions = decode_answers(cmrc, features, starts, ends, max_answer_length=384)
    located = {f.example_index for f in features if f.start_position > 0}
    assert len(located) > 0.9 * len(cmrc)
    for index in located:
        example = cmrc[index]
        assert predictions[example.id] == example.answers[0]["text"].strip()
