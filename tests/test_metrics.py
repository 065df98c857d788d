"""Metrics against small cases worked out by hand (or by the textbook formula in numpy)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from attnlab.errors import AttnlabError
from attnlab.metrics import (
    accuracy,
    classification_metrics,
    entity_metrics,
    macro_f1,
    mcc,
    normalize_answer,
    pearson,
    regression_metrics,
    segment_chinese,
    spearman,
    squad_metrics,
)
from attnlab.text.tasks import QAExample


def test_accuracy_is_the_fraction_correct():
    assert accuracy([1, 0, 1, 1], [1, 0, 0, 1]) == 0.75
    assert accuracy(["a", "b"], ["a", "b"]) == 1.0


def test_macro_f1_by_hand():
    # class 0: tp 1, fp 1, fn 1 -> F1 1/2; class 1: tp 2, fp 1, fn 0 -> P 2/3, R 1, F1 4/5;
    # class 2: tp 0 -> F1 0.  Macro = (1/2 + 4/5 + 0) / 3.
    y_true, y_pred = [0, 0, 1, 1, 2], [0, 1, 1, 1, 0]
    assert macro_f1(y_true, y_pred) == pytest.approx((0.5 + 0.8 + 0.0) / 3)


def test_mcc_matches_the_formula():
    y_true = [1, 1, 1, 0, 0, 0, 0, 1, 0, 1]
    y_pred = [1, 0, 1, 0, 0, 1, 0, 1, 0, 0]
    tp, tn, fp, fn = 3, 4, 1, 2
    expected = (tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    assert mcc(y_true, y_pred) == pytest.approx(expected)
    assert mcc([0, 1, 0, 1], [1, 0, 1, 0]) == pytest.approx(-1.0)


def test_mcc_of_a_single_class_is_zero_without_a_warning(recwarn):
    # The formula's denominator is 0; the documented value is 0, and sklearn's warning about
    # its confusion matrix reached the command line as two lines at every evaluation.
    assert mcc([1, 1, 1], [1, 1, 1]) == 0.0
    assert mcc([1, 1, 1], [0, 1, 1]) == 0.0
    assert [str(w.message) for w in recwarn] == []


def test_classification_metrics_adds_mcc_only_for_binary_tasks():
    binary = classification_metrics([0, 1, 1, 0], [0, 1, 0, 0], n_classes=2)
    assert set(binary) == {"accuracy", "f1", "mcc"}
    assert binary["accuracy"] == 0.75
    assert all(isinstance(value, float) for value in binary.values())
    three = classification_metrics([0, 1, 2], [0, 1, 1], n_classes=3)
    assert set(three) == {"accuracy", "f1"}


def test_mismatched_or_empty_inputs_are_errors():
    with pytest.raises(AttnlabError, match="3 predictions for 2"):
        accuracy([0, 1], [0, 1, 1])
    with pytest.raises(AttnlabError, match="no examples"):
        macro_f1([], [])


def _ranks(values: np.ndarray) -> np.ndarray:
    return np.argsort(np.argsort(values)).astype(float)


def test_correlations_match_numpy_formulas():
    rng = np.random.default_rng(0)
    x = rng.normal(size=50)
    y = 0.5 * x + rng.normal(size=50)
    xc, yc = x - x.mean(), y - y.mean()
    expected_pearson = (xc @ yc) / math.sqrt((xc @ xc) * (yc @ yc))
    rx, ry = _ranks(x) - _ranks(x).mean(), _ranks(y) - _ranks(y).mean()
    expected_spearman = (rx @ ry) / math.sqrt((rx @ rx) * (ry @ ry))
    assert pearson(x, y) == pytest.approx(expected_pearson)
    assert spearman(x, y) == pytest.approx(expected_spearman)
    result = regression_metrics(list(x), list(y))
    assert result == pytest.approx({"pearson": expected_pearson, "spearman": expected_spearman})
    assert all(type(value) is float for value in result.values())


def test_spearman_is_one_for_any_increasing_map():
    x = [0.1, 0.5, 0.2, 3.0, 1.0]
    assert spearman(x, [v**3 for v in x]) == pytest.approx(1.0)
    assert pearson(x, [v**3 for v in x]) < 0.99


def test_correlation_of_a_constant_prediction_is_nan_without_warning(recwarn):
    assert math.isnan(pearson([1.0, 1.0, 1.0], [0.0, 1.0, 2.0]))
    assert len(recwarn) == 0


def test_entity_metrics_count_type_errors_as_both_fp_and_fn():
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O"]]
    # The LOC is predicted as ORG: one false positive and one false negative.
    pred = [["B-PER", "I-PER", "O", "B-ORG"], ["B-ORG", "O"]]
    result = entity_metrics(gold, pred)
    assert result == pytest.approx({"precision": 2 / 3, "recall": 2 / 3, "f1": 2 / 3})


def test_entity_metrics_span_must_match_exactly():
    gold = [["B-PER", "I-PER", "O", "O"]]
    pred = [["B-PER", "O", "B-MISC", "O"]]  # PER too short; one spurious MISC
    result = entity_metrics(gold, pred)
    assert result == pytest.approx({"precision": 0.0, "recall": 0.0, "f1": 0.0})
    # conlleval reads an I- after O as the start of an entity.
    assert entity_metrics([["O", "B-LOC", "I-LOC"]], [["O", "I-LOC", "I-LOC"]])["f1"] == 1.0


def test_entity_metrics_without_entities_are_zero_and_silent(recwarn):
    # seqeval warned (two lines on stderr) when no gold or no predicted entity existed
    assert entity_metrics([["O", "O"]], [["O", "B-PER"]]) == {"precision": 0.0, "recall": 0.0,
                                                              "f1": 0.0}  # fmt: skip
    assert entity_metrics([["B-PER", "O"]], [["O", "O"]])["precision"] == 0.0
    assert len(recwarn) == 0


def test_entity_metrics_rejects_length_mismatch():
    with pytest.raises(AttnlabError, match="sentence 0: 1 predicted tags for 2 words"):
        entity_metrics([["O", "O"]], [["O"]])


def test_normalize_answer_follows_squad_definition():
    assert normalize_answer("The  Denver Broncos!") == "denver broncos"
    assert normalize_answer("an apple, a pear") == "apple pear"
    assert normalize_answer("theatre") == "theatre"  # articles only as whole words


def _question(qid: str, *golds: str) -> QAExample:
    answers = [{"text": gold, "answer_start": 0} for gold in golds]
    return QAExample(qid, "t", "q?", "context", answers)


def test_squad_metrics_by_hand():
    examples = [
        _question("1", "Denver Broncos"),
        _question("2", "Denver Broncos"),
        _question("3", "the fourth quarter", "fourth"),
        _question("4", "Carolina"),
    ]
    predictions = {
        "1": "the Denver Broncos.",  # exact after normalisation
        "2": "Denver",  # P 1, R 1/2 -> F1 2/3
        "3": "fourth quarter",  # exact against the first gold
        # "4" has no prediction: 0, as in the official script
    }
    result = squad_metrics(predictions, examples)
    assert result["exact_match"] == pytest.approx(100 * 2 / 4)
    assert result["f1"] == pytest.approx(100 * (1 + 2 / 3 + 1 + 0) / 4)


def test_squad_metrics_takes_the_best_gold_per_question():
    examples = [_question("1", "red car", "a big red car", "blue")]
    result = squad_metrics({"1": "big red car"}, examples)
    assert result == pytest.approx({"exact_match": 100.0, "f1": 100.0})
    result = squad_metrics({"1": "red"}, examples)
    assert result["f1"] == pytest.approx(100 * 2 / 3)  # against "red car": P 1, R 1/2


def test_squad_metrics_scores_answers_not_in_context():
    example = QAExample("1", "t", "q?", "context", [], other_answers=["39764.0"])
    assert squad_metrics({"1": "39764.0"}, [example])["exact_match"] == 100.0


def test_chinese_segmentation_is_per_character_with_words_kept():
    # The official CMRC 2018 script's tokens: its marks dropped (ASCII "!" is not one of them),
    # NLTK words between Chinese characters, a dropped mark not ending a word.
    assert segment_chinese("北京，iPhone 手机!") == ["北", "京", "iphone", "手", "机", "!"]
    assert segment_chinese("ω-force") == ["ωforce"]
    assert segment_chinese("0.37美元") == ["0.37", "美", "元"]
    assert segment_chinese("don't") == ["do", "n't"]


@pytest.mark.parametrize(
    ("prediction", "gold", "exact", "f1"),
    [
        # (EM, F1) from a Python 3 port of ymcui/cmrc2018's cmrc2018_evaluate.py
        ("3.5%", "35%", 0.0, 0.5),  # "." and "%" are not among its marks
        ("(北京)", "北京", 0.0, 2 / 3),  # nor are ASCII brackets
        ("北京…", "北京", 0.0, 0.8),  # nor a lone "…"
        ("A-B型", "AB型", 1.0, 1.0),  # "-" is, and leaves the word "ab"
        ("don't", "do not", 0.0, 0.5),  # Treebank words: do n't / do not
        ("（北京）～", "北京", 1.0, 1.0),  # full-width brackets and tilde are marks
    ],
)
def test_cmrc_metrics_follow_the_official_script(prediction, gold, exact, f1):
    result = squad_metrics({"1": prediction}, [_question("1", gold)], language="zh")
    assert result == pytest.approx({"exact_match": 100 * exact, "f1": 100 * f1})


def test_cmrc_metrics_by_hand():
    examples = [
        _question("1", "北京"),
        _question("2", "北京"),
        _question("3", "北京"),
        _question("4", "iphone手机"),
    ]
    predictions = {
        "1": "北京市",  # LCS 2: P 2/3, R 1 -> F1 4/5
        "2": "北京。",  # punctuation ignored: exact
        "3": "京北",  # longest common run is 1 character: P 1/2, R 1/2 (a bag would give 1)
        "4": "iPhone 手机",  # same tokens (F1 1), but not the same string (EM 0)
    }
    result = squad_metrics(predictions, examples, language="zh")
    assert result["exact_match"] == pytest.approx(100 * 1 / 4)
    assert result["f1"] == pytest.approx(100 * (0.8 + 1 + 0.5 + 1) / 4)


def test_squad_metrics_errors():
    with pytest.raises(AttnlabError, match="language"):
        squad_metrics({}, [_question("1", "x")], language="fr")
    with pytest.raises(AttnlabError, match="no gold answer"):
        squad_metrics({}, [QAExample("1", "t", "q", "c", [])])


def test_corpus_bleu_is_papinenis_formula():
    # BLEU = BP * exp(mean over n = 1..4 of log p_n), p_n the clipped n-gram precisions summed
    # over the corpus, BP = exp(1 - r / c) when the output is shorter (Papineni et al. 2002).
    # Plain lowercase words, so sacreBLEU's 13a tokenizer splits on spaces alone.
    from collections import Counter

    from attnlab.metrics import corpus_bleu

    hyps = ["the cat sat on the mat today", "a dog ran in the big park", "it is a small house"]
    refs = [
        "the cat sat on the mat",
        "the dog ran in the big green park",
        "it is a very small house",
    ]

    def grams(words: list[str], n: int) -> Counter:
        return Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1))

    log_p = 0.0
    for n in range(1, 5):
        matched = total = 0
        for hyp, ref in zip(hyps, refs, strict=True):
            h, r = grams(hyp.split(), n), grams(ref.split(), n)
            matched += sum(min(count, r[g]) for g, count in h.items())
            total += sum(h.values())
        log_p += math.log(matched / total) / 4
    c, r = sum(len(h.split()) for h in hyps), sum(len(x.split()) for x in refs)
    brevity = 1.0 if c > r else math.exp(1 - r / c)
    assert corpus_bleu(hyps, refs)["bleu"] == pytest.approx(
        100 * brevity * math.exp(log_p), rel=1e-9
    )


@pytest.mark.parametrize(
    "hyps, refs",
    [("a cat sat", "a cat sat"), (["a cat"], [["a cat"]]), (["a cat", None], ["a", "b"])],
)
def test_corpus_bleu_refuses_what_is_not_a_list_of_sentences(hyps, refs):
    # A str scored as one sentence per character (BLEU 0.0); sacreBLEU's list of reference
    # lists gave its own TypeError.
    from attnlab.metrics import corpus_bleu

    with pytest.raises(AttnlabError, match="must be a list of sentences"):
        corpus_bleu(hyps, refs)


def test_bleu_of_chinese_references_uses_sacrebleus_zh_tokenizer():
    # 13a takes an unspaced Chinese sentence for one word: a near miss scores 0 there.
    from attnlab.metrics import bleu_tokenizer_for, corpus_bleu

    refs = ["我们今天去公园散步，天气很好！", "他明天要去北京开会。"]
    hyps = ["我们今天去公园散步，天气很好。", "他明天去北京开会。"]
    assert bleu_tokenizer_for(refs) == "zh"
    assert bleu_tokenizer_for(["A man rides a bike, 好."]) == "13a"
    auto = corpus_bleu(hyps, refs)
    assert "tok:zh" in auto["signature"] and auto["bleu"] > 40
    assert corpus_bleu(hyps, refs, tokenize="13a")["bleu"] == 0.0
