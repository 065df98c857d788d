"""Evaluation metrics of the fine-tuning tasks, as the benchmarks define them.

- classification: accuracy, macro F1 and Matthews correlation (GLUE's CoLA metric),
  from scikit-learn;
- regression: Pearson and Spearman correlation (GLUE's STS-B metrics), from SciPy;
- NER: entity-level precision / recall / F1 as conlleval counts them, from seqeval;
- extractive QA: exact match and token F1 of the official SQuAD v1.1 evaluation script,
  and, with `language="zh"`, the CMRC 2018 rule (see `squad_metrics`);
- translation: corpus BLEU from sacreBLEU (detokenized input, signature reported).

The libraries are imported where they are used: scikit-learn alone takes seconds to import,
and `attnlab translate` should not wait for it.

Every function returns plain Python floats so results drop straight into JSON. SQuAD
scores are on 0..100 as the official scripts print them; the others are on 0..1.
"""

from __future__ import annotations

import logging
import re
import string
import warnings
from collections import Counter
from collections.abc import Sequence
from difflib import SequenceMatcher
from typing import Any

import numpy as np

from attnlab.errors import AttnlabError
from attnlab.text.tasks import QAExample

# ---- classification ---------------------------------------------------------------------


def _check_pairs(y_true: Sequence, y_pred: Sequence) -> None:
    """Raise unless predictions and gold labels are non-empty and equally many."""
    if len(y_true) != len(y_pred):
        raise AttnlabError(f"got {len(y_pred)} predictions for {len(y_true)} gold labels")
    if len(y_true) == 0:
        raise AttnlabError("no examples to score")


def accuracy(y_true: Sequence, y_pred: Sequence) -> float:
    """Fraction of predictions equal to the gold label (0..1)."""
    _check_pairs(y_true, y_pred)
    from sklearn import metrics as sk_metrics

    return float(sk_metrics.accuracy_score(y_true, y_pred))


def macro_f1(y_true: Sequence, y_pred: Sequence) -> float:
    """Unweighted mean of the per-class F1 over the classes seen in gold or predictions."""
    _check_pairs(y_true, y_pred)
    from sklearn import metrics as sk_metrics

    return float(sk_metrics.f1_score(y_true, y_pred, average="macro", zero_division=0))


def mcc(y_true: Sequence, y_pred: Sequence) -> float:
    """Matthews correlation coefficient (-1..1; 0 when either side has a single class)."""
    _check_pairs(y_true, y_pred)
    from sklearn import metrics as sk_metrics

    with warnings.catch_warnings():
        # One class on both sides (a one-class dev set, a model that predicts one class):
        # sklearn warns about its confusion matrix's shape, then gives the documented 0.
        warnings.filterwarnings("ignore", "A single label was found", UserWarning)
        return float(sk_metrics.matthews_corrcoef(y_true, y_pred))


def classification_metrics(y_true: Sequence, y_pred: Sequence, n_classes: int) -> dict:
    """{"accuracy", "f1" (macro)}, plus "mcc" for a binary task."""
    result = {"accuracy": accuracy(y_true, y_pred), "f1": macro_f1(y_true, y_pred)}
    if n_classes == 2:
        result["mcc"] = mcc(y_true, y_pred)
    return result


# ---- regression -------------------------------------------------------------------------


def _correlation(name: str, x: Sequence[float], y: Sequence[float]) -> float:
    """SciPy's pearsonr / spearmanr of two equally long series; NaN when either is constant."""
    from scipy import stats

    _check_pairs(x, y)
    if len(x) < 2:
        raise AttnlabError("a correlation needs at least 2 examples")
    with warnings.catch_warnings():
        # A constant series (e.g. a model that has not learned yet) has no correlation:
        # NaN says so without a warning per evaluation.
        warnings.simplefilter("ignore", stats.ConstantInputWarning)
        value = getattr(stats, name)(
            np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
        )
    return float(value[0])


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson (linear) correlation coefficient."""
    return _correlation("pearsonr", x, y)


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman rank correlation coefficient."""
    return _correlation("spearmanr", x, y)


def regression_metrics(pred: Sequence[float], gold: Sequence[float]) -> dict:
    """{"pearson", "spearman"} correlations (-1..1) of predictions with gold scores."""
    return {"pearson": pearson(pred, gold), "spearman": spearman(pred, gold)}


# ---- NER --------------------------------------------------------------------------------


def entity_metrics(true_tags: list[list[str]], pred_tags: list[list[str]]) -> dict:
    """Entity-level {"precision", "recall", "f1"} (an entity counts if span and type match)."""
    _check_pairs(true_tags, pred_tags)
    for index, (gold, pred) in enumerate(zip(true_tags, pred_tags, strict=True)):
        if len(gold) != len(pred):
            raise AttnlabError(
                f"sentence {index}: {len(pred)} predicted tags for {len(gold)} words"
            )
    from seqeval import metrics as seqeval_metrics

    # seqeval's default mode reads chunks as conlleval does (I- after O starts an entity).
    # No gold or no predicted entity gives 0, as conlleval does, without seqeval's warning
    # (two lines on stderr).
    return {
        name: float(score(true_tags, pred_tags, zero_division=0))
        for name, score in (
            ("precision", seqeval_metrics.precision_score),
            ("recall", seqeval_metrics.recall_score),
            ("f1", seqeval_metrics.f1_score),
        )
    }


# ---- extractive QA ----------------------------------------------------------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ENGLISH_PUNCTUATION = frozenset(string.punctuation)
# CMRC 2018's official script (ymcui/cmrc2018, cmrc2018_evaluate.py) drops these marks, one
# character each; its list also holds "……", which never equals a single character, so a lone
# "…" is kept there and here. Chinese characters are its range U+4E00-U+9FA5.
_CMRC_MARKS = frozenset("-:_*^/\\~`+=，。：？！“”；’《》·、「」（）－～『』")
_CMRC_CHINESE = re.compile(r"[\u4e00-\u9fa5]")


def normalize_answer(text: str) -> str:
    """SQuAD v1.1 normalisation: lowercase, drop punctuation and a/an/the, collapse spaces."""
    text = "".join(char for char in text.lower() if char not in _ENGLISH_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _without_marks(text: str) -> str:
    """`text` lowercased and stripped, CMRC's marks removed (what CMRC 2018's EM compares)."""
    return "".join(char for char in text.lower().strip() if char not in _CMRC_MARKS)


def segment_chinese(text: str) -> list[str]:
    """CMRC 2018's F1 tokens: lowercased, its marks dropped, one per Chinese character, and
    the runs between them split into words by NLTK's Treebank tokenizer, as the official
    script does (a dropped mark does not end a run: "A-B" is the word "ab")."""
    from nltk.tokenize import word_tokenize

    def words(run: list[str]) -> list[str]:
        # preserve_line: no sentence splitting first, which would need NLTK's punkt data
        return word_tokenize("".join(run), preserve_line=True) if run else []

    tokens: list[str] = []
    run: list[str] = []
    for char in text.lower().strip():
        if char in _CMRC_MARKS:
            continue
        if _CMRC_CHINESE.match(char):
            tokens.extend(words(run))
            run.clear()
            tokens.append(char)
        else:
            run.append(char)
    return tokens + words(run)


def _english_scores(prediction: str, gold: str) -> tuple[float, float]:
    """(exact match, token-bag F1) of one prediction against one gold answer, SQuAD v1.1."""
    pred_normal, gold_normal = normalize_answer(prediction), normalize_answer(gold)
    exact = float(pred_normal == gold_normal)
    pred_tokens, gold_tokens = pred_normal.split(), gold_normal.split()
    same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if same == 0:
        return exact, 0.0
    precision, recall = same / len(pred_tokens), same / len(gold_tokens)
    return exact, 2 * precision * recall / (precision + recall)


def _chinese_scores(prediction: str, gold: str) -> tuple[float, float]:
    """(exact match, F1) of one prediction against one gold answer, CMRC 2018 rule."""
    exact = float(_without_marks(prediction) == _without_marks(gold))
    pred_tokens, gold_tokens = segment_chinese(prediction), segment_chinese(gold)
    # CMRC's F1 counts the longest common *contiguous* run of tokens, not a bag overlap.
    matcher = SequenceMatcher(None, pred_tokens, gold_tokens, autojunk=False)
    same = matcher.find_longest_match(0, len(pred_tokens), 0, len(gold_tokens)).size
    if same == 0:
        return exact, 0.0
    precision, recall = same / len(pred_tokens), same / len(gold_tokens)
    return exact, 2 * precision * recall / (precision + recall)


def squad_metrics(
    predictions: dict[str, str], examples: Sequence[QAExample], language: str = "en"
) -> dict:
    """{"exact_match", "f1"} on 0..100, each the best over a question's gold answers.

    `language="en"` is the official SQuAD v1.1 script: answers normalised by
    `normalize_answer`, F1 over the bag of words. `language="zh"` is the official CMRC 2018
    script's rule: lowercase, the script's list of marks removed, EM on what is left, F1 from
    the longest common run of tokens, a token being one Chinese character or an NLTK word of
    the text between them (`segment_chinese`). A question with no prediction scores 0, as in
    both scripts.
    """
    scorers = {"en": _english_scores, "zh": _chinese_scores}
    if language not in scorers:
        raise AttnlabError(f"language must be 'en' or 'zh', got {language!r}")
    if not examples:
        raise AttnlabError("no questions to score")
    score = scorers[language]
    exact_total = f1_total = 0.0
    for example in examples:
        golds = [answer["text"] for answer in example.answers] + list(example.other_answers)
        if not golds:
            raise AttnlabError(f"question {example.id!r} has no gold answer to score against")
        prediction = predictions.get(example.id)
        if prediction is None:
            continue
        pairs = [score(prediction, gold) for gold in golds]
        exact_total += max(exact for exact, _ in pairs)
        f1_total += max(f1 for _, f1 in pairs)
    return {
        "exact_match": 100.0 * exact_total / len(examples),
        "f1": 100.0 * f1_total / len(examples),
    }


# ---- translation ------------------------------------------------------------------------


def bleu_metric(tokenize: str = "13a") -> Any:
    """sacreBLEU's BLEU with this tokenizer, or a one-line reason it cannot be had here."""
    from sacrebleu.metrics import BLEU

    logger = logging.getLogger("sacrebleu")  # it logs that 'spm' is now 'flores101': a
    level = logger.level  # second stderr line, before a refusal of ours or sacreBLEU's
    logger.setLevel(logging.ERROR)
    try:
        return BLEU(tokenize=tokenize)
    except KeyError:  # sacreBLEU's answer to an unknown tokenizer name
        raise AttnlabError(
            f"unknown BLEU tokenizer {tokenize!r} (sacreBLEU has {', '.join(BLEU.TOKENIZERS)})"
        ) from None
    except Exception as err:  # one it knows but cannot load (ja-mecab without MeCab, say)
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        hint = f": {' '.join(lines)}" if lines else ""
        raise AttnlabError(f"BLEU tokenizer {tokenize!r} cannot run here{hint}") from None
    finally:
        logger.setLevel(level)


def bleu_tokenizer_for(references: Sequence[str]) -> str:
    """sacreBLEU's tokenizer for references: "zh" if most letters are Chinese, else "13a".

    sacreBLEU picks "zh" for a Chinese target language; 13a would take a whole unspaced
    Chinese sentence for one word (a near miss scores 0).
    """
    letters = cjk = 0
    for text in references:
        for char in text:
            if char.isalpha():
                letters += 1
                cjk += "\u3400" <= char <= "\u9fff" or "\uf900" <= char <= "\ufaff"
    return "zh" if letters and cjk >= letters / 2 else "13a"


def corpus_bleu(
    hypotheses: Sequence[str], references: Sequence[str], tokenize: str | None = None
) -> dict:
    """sacreBLEU of detokenized hypotheses against one reference each: score, signature, details.

    ``tokenize`` None: "zh" for mostly Chinese references, else "13a" (bleu_tokenizer_for).
    """
    for name, texts in (("hypotheses", hypotheses), ("references", references)):
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise AttnlabError(f"{name} must be a list of sentences (strings), one per line")
    if len(hypotheses) != len(references):
        raise AttnlabError(
            f"{len(hypotheses)} translations but {len(references)} references: "
            "the files must have the same number of lines"
        )
    if not references:
        raise AttnlabError("no sentences to score: the files are empty")
    bleu = bleu_metric(tokenize or bleu_tokenizer_for(references))
    result = bleu.corpus_score(list(hypotheses), [list(references)])
    return {
        "bleu": result.score,
        "signature": str(bleu.get_signature()),
        "text": str(result),
        "precisions": result.precisions,
        "bp": result.bp,
        "sys_len": result.sys_len,
        "ref_len": result.ref_len,
        "sentences": len(hypotheses),
    }
