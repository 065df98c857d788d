"""Fine-tuning data: task file readers, label sets, and featurisation for BERT's task heads.

Devlin et al. (2019) §4 fine-tune one pretrained encoder on three input shapes, and this
module turns files into each of them:

- sentence or sentence-pair tables (GLUE / CLUE style TSV, CSV, JSONL) for classification
  and regression (§4.1): `read_table`, `LabelSet`, `encode_texts`;
- CoNLL column files for token tagging (§5.3, NER): `read_conll`, `encode_words`, with
  the label on each word's first sub-token as in the paper, and `word_predictions` back;
- SQuAD-style JSON for extractive QA (§4.2): `read_squad`, `encode_squad`, which slides
  overlapping windows over long contexts, and `decode_answers`, which picks the best
  start/end span (score S·T_i + E·T_j, j >= i) over all windows of a question.

Everything here is a pure function of its inputs; nothing trains or prints.
"""

from __future__ import annotations

import csv
import json
import math
import re
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from attnlab.errors import AttnlabError
from attnlab.io import check_input_file, check_no_lone_surrogates, text_lines
from attnlab.text.tokenizer import UNK, BertTokenizer

# Label id that PyTorch's cross-entropy ignores: special tokens and non-first sub-tokens.
IGNORE_INDEX = -100
TABLE_FORMATS = (".tsv", ".csv", ".jsonl")
LABEL_KINDS = ("classes", "scores")
_TAG = re.compile(r"O|[BI]-\S+")
_SHOWN_LABELS = 20  # an unknown-label error lists at most this many known ones


# ---- reading files ----------------------------------------------------------------------


def _existing_file(path: str | Path) -> Path:
    """`path` as a Path, or AttnlabError when there is no such file (or it is a directory)."""
    return check_input_file(Path(path))


def _lines(path: Path) -> Iterator[str]:
    """Yield the decoded lines of a UTF-8 file (.gz allowed), line endings kept (io.text_lines)."""
    return text_lines(path)


def _read_json(path: Path) -> object:
    """Parse a JSON file (.gz allowed), naming it in any error."""
    text = "".join(_lines(path))
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as error:  # also too deep, or an integer too long
        raise AttnlabError(f"{path}: not valid JSON ({error})") from error
    check_no_lone_surrogates(data, str(path))
    return data


# ---- tables: classification and regression ----------------------------------------------


@dataclass
class TextExample:
    """One row of a classification or regression table."""

    text: str
    pair: str | None = None
    label: str | float | None = None
    line: int = 0  # 1-based line in the file, for error messages


def read_table(
    path: str | Path,
    text_column: str = "text",
    pair_column: str | None = None,
    label_column: str | None = "label",
    *,
    columns: Sequence[str] | None = None,
    skip_empty: bool = False,
) -> list[TextExample]:
    """Read a .tsv, .csv or .jsonl table (optionally .gz) into examples.

    TSV and CSV files start with a header row naming the columns, unless `columns` names
    them, for headerless files such as AFQMC, LCQMC and CMNLI (a first row that repeats
    those names is then a header all the same, and skipped). `label_column=None` reads
    unlabeled input (labels None). Text fields are stripped of surrounding whitespace; an
    empty text is an error, or with `skip_empty` a dropped row (with a warning), since
    ChnSentiCorp_htl_all has one empty review.
    """
    path = _existing_file(path)
    name = path.name.lower().removesuffix(".gz")
    suffix = next((s for s in TABLE_FORMATS if name.endswith(s)), None)
    if suffix is None:
        raise AttnlabError(
            f"{path}: unknown table format; expected .tsv, .csv or .jsonl (optionally .gz)"
        )
    wanted = [c for c in (text_column, pair_column, label_column) if c is not None]
    if suffix == ".jsonl":
        rows = _jsonl_rows(path, wanted)
    else:
        rows = _delimited_rows(path, suffix, wanted, columns)

    examples = []
    skipped = 0
    for line, row in rows:
        if skip_empty and any(_is_blank(row.get(c)) for c in (text_column, pair_column) if c):
            skipped += 1
            continue
        examples.append(
            TextExample(
                text=_text_field(path, line, row, text_column),
                pair=None if pair_column is None else _text_field(path, line, row, pair_column),
                label=None if label_column is None else _label_field(path, line, row, label_column),
                line=line,
            )
        )
    if not examples:
        raise AttnlabError(f"{path} holds no rows")
    if skipped:
        warnings.warn(f"{path}: skipped {skipped} row(s) with an empty text", stacklevel=2)
    return examples


def _is_blank(value: object) -> bool:
    """Whether a field is an empty or whitespace-only string."""
    return isinstance(value, str) and not value.strip()


def _delimited_rows(
    path: Path, suffix: str, wanted: list[str], columns: Sequence[str] | None
) -> Iterator[tuple[int, dict]]:
    """Yield (line, {column: value}) for each row of a TSV or CSV file."""
    if suffix == ".tsv":
        # GLUE-style TSV has bare quote characters in its text: never treat them as quoting.
        reader = csv.reader(_lines(path), delimiter="\t", quoting=csv.QUOTE_NONE)
    else:
        reader = csv.reader(_lines(path))
    try:
        if columns is None:
            header = next(reader, None)
            if header is None:
                raise AttnlabError(f"{path} is empty")
            header = [name.strip() for name in header]
        else:
            header = list(columns)
        _check_columns(path, wanted, header, named=columns is not None)
        header_row = columns is None
        while True:
            first_line = reader.line_num + 1  # a quoted CSV field may span several lines
            row = next(reader, None)
            if row is None:
                return
            if not row:  # a blank line
                continue
            if not header_row:  # the first row, with names given: a header if it has them
                header_row = True
                if [field.strip() for field in row] == header:
                    continue
            if len(row) != len(header):
                raise AttnlabError(
                    f"{path}, line {first_line}: {len(row)} field(s), expected {len(header)} "
                    f"({', '.join(header)})"
                )
            yield first_line, dict(zip(header, row, strict=True))
    except csv.Error as error:
        if "new-line character" in str(error):  # csv's words for a bare carriage return
            raise AttnlabError(
                f"{path}, line {reader.line_num}: a carriage return (CR) outside a quoted field: "
                "the file has old Mac line ends or a stray CR; save it with LF or CRLF line ends"
            ) from error
        raise AttnlabError(f"{path}, line {reader.line_num}: {error}") from error


def _check_columns(path: Path, wanted: list[str], present: list[str], named: bool) -> None:
    """Raise when a requested column is not among those present."""
    for column in wanted:
        if column not in present:
            hint = "" if named else " (the first row is read as the header)"
            raise AttnlabError(
                f"{path}: no column {column!r}; columns present: {', '.join(present)}{hint}"
            )


def _jsonl_rows(path: Path, wanted: list[str]) -> Iterator[tuple[int, dict]]:
    """Yield (line, object) for each non-blank line of a JSONL file."""
    first = True
    for number, line in enumerate(_lines(path), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as error:  # also too deep, or an integer too long
            raise AttnlabError(f"{path}, line {number}: not valid JSON ({error})") from error
        if not isinstance(row, dict):
            raise AttnlabError(f"{path}, line {number}: expected a JSON object")
        check_no_lone_surrogates(row, f"{path}, line {number}")
        if first:  # later rows that lack a field fail in _text_field, naming their line
            _check_columns(path, wanted, list(row), named=True)
            first = False
        yield number, row


def _text_field(path: Path, line: int, row: dict, column: str) -> str:
    """The stripped, non-empty text in `column` of a row."""
    value = row.get(column)
    if value is None:
        raise AttnlabError(f"{path}, line {line}: no {column!r} field")
    if not isinstance(value, str):
        raise AttnlabError(f"{path}, line {line}: field {column!r} is not text: {value!r}")
    # GLUE's SST-2 ends almost every sentence with a space before the TAB.
    value = value.strip()
    if not value:
        raise AttnlabError(f"{path}, line {line}: empty {column!r} field")
    return value


def _label_field(path: Path, line: int, row: dict, column: str) -> str | float:
    """The label in `column`: a string as written, or a float for a JSON number."""
    value = row.get(column)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if value is None or (isinstance(value, str) and not value.strip()):
        raise AttnlabError(f"{path}, line {line}: empty {column!r} field")
    if not isinstance(value, str):
        raise AttnlabError(f"{path}, line {line}: label {value!r} is not a string or number")
    return value.strip()


def _as_number(value: str | float) -> float | None:
    """`value` as a finite float, or None when it is not a number."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _class_name(label: str | float) -> str:
    """The class name of a label: JSON numbers 1.0 and 1 both name the class "1"."""
    if isinstance(label, float) and label.is_integer():
        return str(int(label))
    return str(label)


# ---- label sets -------------------------------------------------------------------------


@dataclass
class LabelSet:
    """The labels of a task: class names in id order, or real-valued scores (regression)."""

    kind: str  # "classes" or "scores"
    names: list[str] = field(default_factory=list)  # class names in id order (empty for scores)
    _ids: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in LABEL_KINDS:
            raise AttnlabError(f"label kind must be one of {LABEL_KINDS}, got {self.kind!r}")
        if self.kind == "classes" and not self.names:
            raise AttnlabError("a label set of classes needs at least one class name")
        if len(set(self.names)) != len(self.names):
            raise AttnlabError(f"duplicate class names in {self.names}")
        self._ids = {name: index for index, name in enumerate(self.names)}

    @classmethod
    def from_examples(cls, labels: Sequence[str | float | None], kind: str) -> LabelSet:
        """The label set of training labels: sorted classes, or scores that all parse as numbers."""
        if kind not in LABEL_KINDS:
            raise AttnlabError(f"label kind must be one of {LABEL_KINDS}, got {kind!r}")
        if len(labels) == 0:
            raise AttnlabError("no labels to build a label set from")
        for index, label in enumerate(labels):
            if label is None:
                raise AttnlabError(f"example {index + 1} has no label: training needs labels")
        if kind == "scores":
            for label in labels:
                if _as_number(label) is None:
                    raise AttnlabError(
                        f"label {label!r} is not a number: regression needs numeric scores"
                    )
            return cls("scores", [])

        names = sorted({_class_name(label) for label in labels})
        numbers = {name: _as_number(name) for name in names}
        numeric = [name for name in names if numbers[name] is not None]
        if numeric and len(numeric) < len(names):
            word = next(name for name in names if numbers[name] is None)
            raise AttnlabError(
                f"mixed label types: numbers (e.g. {numeric[0]!r}) and words (e.g. {word!r}); "
                "is the label column right?"
            )
        if numeric:
            fractional = [name for name in names if not numbers[name].is_integer()]
            if fractional:
                raise AttnlabError(
                    f"class labels look like real-valued scores (e.g. {fractional[0]!r}): "
                    "is this a regression task?"
                )
            names.sort(key=lambda name: numbers[name])
        elif "O" in names and all(_TAG.fullmatch(name) for name in names):
            # BIO tag sets read best (and conventionally are stored) with "O" as id 0.
            names.remove("O")
            names.insert(0, "O")
        return cls("classes", names)

    @property
    def num_labels(self) -> int:
        """Outputs a head needs: the class count, or 1 for scores."""
        return len(self.names) if self.kind == "classes" else 1

    def encode(self, label: str | float) -> int | float:
        """The class id of a label, or the score as a float."""
        if self.kind == "scores":
            number = _as_number(label)
            if number is None:
                raise AttnlabError(f"label {label!r} is not a number: regression needs scores")
            return number
        name = _class_name(label)
        index = self._ids.get(name)
        if index is None:
            known = self.names[:_SHOWN_LABELS] + (
                ["..."] if len(self.names) > _SHOWN_LABELS else []
            )
            raise AttnlabError(f"unknown label {name!r}; known labels: [{', '.join(known)}]")
        return index

    def decode(self, index: int) -> str:
        """The class name of an id."""
        if self.kind == "scores":
            raise AttnlabError("a regression label set has no class names to decode")
        if not 0 <= index < len(self.names):
            raise AttnlabError(f"class id {index} out of range 0..{len(self.names) - 1}")
        return self.names[index]

    def to_config(self) -> dict:
        """The id2label / label2id entries of an HF config.json (regression adds problem_type)."""
        if self.kind == "scores":
            return {
                "id2label": {"0": "LABEL_0"},
                "label2id": {"LABEL_0": 0},
                "problem_type": "regression",
            }
        return {
            "id2label": {str(index): name for index, name in enumerate(self.names)},
            "label2id": {name: index for index, name in enumerate(self.names)},
        }

    @classmethod
    def from_config(cls, data: dict) -> LabelSet:
        """The label set stored in an HF config.json by `to_config` (or by transformers)."""
        if data.get("problem_type") == "regression":
            return cls("scores", [])
        id2label = data.get("id2label")
        if not isinstance(id2label, dict) or not id2label:
            raise AttnlabError("config has no id2label mapping: cannot recover the class names")
        try:
            by_id = {int(key): value for key, value in id2label.items()}
        except (TypeError, ValueError) as error:
            raise AttnlabError(f"config id2label keys must be integers: {id2label}") from error
        if sorted(by_id) != list(range(len(by_id))):
            raise AttnlabError(f"config id2label ids must be 0..{len(by_id) - 1}: {id2label}")
        return cls("classes", [str(by_id[index]) for index in range(len(by_id))])


def encode_texts(
    tokenizer: BertTokenizer, examples: Sequence[TextExample], max_length: int
) -> list[dict[str, list[int]]]:
    """input_ids and token_type_ids of [CLS] text [SEP] (pair [SEP]), longest-first truncated."""
    if not examples:
        return []
    has_pair = [example.pair is not None for example in examples]
    if any(has_pair) and not all(has_pair):
        line = examples[has_pair.index(not has_pair[0])].line
        raise AttnlabError(
            f"some examples have a text pair and some not (first change: line {line})"
        )
    texts = [example.text for example in examples]
    pairs = [example.pair for example in examples] if has_pair[0] else None
    encodings = tokenizer.encode_batch(texts, pairs, max_length=max_length)
    return [{"input_ids": e.ids, "token_type_ids": e.type_ids} for e in encodings]


# ---- CoNLL: token tagging ---------------------------------------------------------------


@dataclass
class WordExample:
    """One sentence of a tagging file: its words and (unless unlabeled) one tag per word."""

    words: list[str]
    tags: list[str] | None
    line: int = 0  # line where the sentence starts


def read_conll(path: str | Path, tag_column: int | None = -1) -> list[WordExample]:
    """Read a CoNLL column file (optionally .gz): token first, BIO tag in `tag_column`.

    Columns are whitespace-separated, as many on every line (a line of running text would
    otherwise pass as its first word), and a blank line ends a sentence; `-DOCSTART-` lines
    are skipped. `tag_column=None` reads untagged text (one token a line, tags None). Tags
    come back in BIO: an I-X that starts an entity (IOB1, as the original CoNLL-2003 files
    write it, or a slip in a BIO file) becomes B-X, the entity conlleval and seqeval read
    there, so an IOB1 training file and a BIO dev file share one label set.
    """
    path = _existing_file(path)
    examples: list[WordExample] = []
    words: list[str] = []
    tags: list[str] = []
    start = 0
    width: tuple[int, int] | None = None  # (columns, line) of the first token line

    def end_sentence() -> None:
        if words:
            examples.append(
                WordExample(list(words), None if tag_column is None else to_bio(tags), start)
            )
            words.clear()
            tags.clear()

    for number, line in enumerate(_lines(path), start=1):
        fields = line.split()
        if not fields or fields[0] == "-DOCSTART-":
            end_sentence()
            continue
        if not words:
            start = number
        if tag_column is not None and len(fields) < 2:
            raise AttnlabError(
                f"{path}, line {number}: expected a token and a tag, got {line.strip()!r}"
            )
        if width is None:
            width = (len(fields), number)
        elif len(fields) != width[0]:
            raise AttnlabError(
                f"{path}, line {number}: {len(fields)} columns where line {width[1]} has "
                f"{width[0]}: CoNLL files hold one token a line (a blank line between sentences)"
            )
        words.append(fields[0])
        if tag_column is None:
            continue
        try:
            tag = fields[tag_column]
        except IndexError:
            raise AttnlabError(
                f"{path}, line {number}: no column {tag_column} in {line.strip()!r}"
            ) from None
        if not _TAG.fullmatch(tag):
            raise AttnlabError(f"{path}, line {number}: tag {tag!r} is not O, B-TYPE or I-TYPE")
        tags.append(tag)
    end_sentence()
    if not examples:
        raise AttnlabError(f"{path} holds no sentences")
    return examples


def to_bio(tags: Sequence[str]) -> list[str]:
    """Convert IOB1 tags (I- starts an entity unless it follows one of the same type) to BIO."""
    bio = []
    previous = "O"
    for tag in tags:
        # An I-X that does not continue an X entity starts one: in BIO it must be B-X.
        if tag.startswith("I-") and (previous == "O" or previous[2:] != tag[2:]):
            bio.append("B-" + tag[2:])
        else:
            bio.append(tag)
        previous = tag
    return bio


def encode_words(
    tokenizer: BertTokenizer,
    examples: Sequence[WordExample],
    label_set: LabelSet | None,
    max_length: int,
) -> list[dict[str, list[int]]]:
    """Sub-word ids for pre-split words: input_ids, token_type_ids, word_ids (+ labels).

    `word_ids` gives each token's word index (-1 for [CLS]/[SEP]); `labels` puts each
    word's tag id on its first sub-token and -100 elsewhere. A word that tokenizes to
    nothing (a control or zero-width character) is encoded as [UNK], so every word keeps a
    token and a prediction. Words past `max_length` are cut: see `count_truncated_words`.
    """
    if not isinstance(max_length, int) or max_length < 2:
        raise AttnlabError(f"max_length must be an integer >= 2, got {max_length!r}")
    if not examples:
        return []
    backend = tokenizer.backend
    # The untruncated backend: truncation is by tokens here, after alignment is known.
    encodings = backend.encode_batch([example.words for example in examples], is_pretokenized=True)
    features = []
    for example, encoding in zip(examples, encodings, strict=True):
        word_ids = [-1 if word is None else word for word in encoding.word_ids]
        ids = encoding.ids
        present = set(word_ids)
        if len(present) - (-1 in present) < len(example.words):
            # "[UNK]" is a registered special token, so the literal string encodes to its id.
            words = [w if i in present else UNK for i, w in enumerate(example.words)]
            encoding = backend.encode(words, is_pretokenized=True)
            word_ids = [-1 if word is None else word for word in encoding.word_ids]
            ids = encoding.ids
        if len(ids) > max_length:
            ids = [*ids[: max_length - 1], tokenizer.sep_id]
            word_ids = [*word_ids[: max_length - 1], -1]
        feature = {"input_ids": ids, "token_type_ids": [0] * len(ids), "word_ids": word_ids}
        if label_set is not None:
            if example.tags is None:
                raise AttnlabError(f"sentence at line {example.line} has no tags to train on")
            feature["labels"] = align_labels(word_ids, [label_set.encode(t) for t in example.tags])
        features.append(feature)
    return features


def count_truncated_words(
    features: Sequence[dict[str, list[int]]], examples: Sequence[WordExample]
) -> int:
    """How many words `encode_words` cut off at max_length (they get no prediction)."""
    cut = 0
    for feature, example in zip(features, examples, strict=True):
        kept = max(feature["word_ids"], default=-1) + 1
        cut += len(example.words) - kept
    return cut


def align_labels(word_ids: Sequence[int], word_labels: Sequence[int]) -> list[int]:
    """Token labels: each word's label on its first sub-token, -100 on the rest and on specials."""
    labels = []
    previous = -1
    for word in word_ids:
        labels.append(word_labels[word] if word >= 0 and word != previous else IGNORE_INDEX)
        previous = word
    return labels


def word_predictions(
    word_ids: Sequence[int], token_label_ids: Sequence[int], n_words: int, fill: int
) -> list[int]:
    """Each word's predicted label (that of its first sub-token); words cut off get `fill`."""
    predictions = [fill] * n_words
    previous = -1
    for word, label in zip(word_ids, token_label_ids, strict=False):
        if word >= 0 and word != previous:
            predictions[word] = int(label)
        previous = word
    return predictions


# ---- SQuAD: extractive question answering -----------------------------------------------


@dataclass
class QAExample:
    """One question with its context and gold answers (character offsets into context)."""

    id: str
    title: str
    question: str
    context: str
    answers: list[dict]  # [{"text": str, "answer_start": int}], may be empty for prediction
    # Gold answer texts that do not occur in the context (CMRC 2018 dev has 193): they
    # count when scoring, as in the official script, but cannot be training targets.
    other_answers: list[str] = field(default_factory=list)


def read_squad(
    path: str | Path, fix_offsets: bool = True, require_answers: bool = False
) -> list[QAExample]:
    """Read SQuAD v1.1-style JSON (optionally .gz): SQuAD itself, CMRC 2018.

    Every kept answer satisfies context[start:start + len(text)] == text. With
    `fix_offsets` (the default), an answer whose offset is wrong is moved to the
    occurrence of its text nearest the given offset, and an answer whose text is not in
    the context at all goes to `other_answers`; a warning gives both counts. With
    `fix_offsets=False` any wrong offset is an error. With `require_answers` (training
    files) every question must have an "answers" list, empty for an unanswerable one.
    """
    path = _existing_file(path)
    data = _read_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise AttnlabError(f'{path}: not SQuAD-style JSON (expected {{"data": [...]}})')
    examples: list[QAExample] = []
    seen: set[str] = set()
    moved = 0
    qid = "(first question)"
    try:
        for article in data["data"]:
            title = str(article.get("title", ""))
            for paragraph in article["paragraphs"]:
                context = paragraph["context"]
                for qa in paragraph["qas"]:
                    qid = _question_id(path, qa, qid, seen)
                    example, moved_here = _qa_example(
                        path, qa, qid, title, context, fix_offsets, require_answers
                    )
                    examples.append(example)
                    moved += moved_here
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as error:
        raise AttnlabError(
            f"{path}: not SQuAD-style JSON near question {qid!r} ({type(error).__name__}: {error})"
        ) from error
    if not examples:
        raise AttnlabError(f"{path} holds no questions")
    unlocated = sum(len(example.other_answers) for example in examples)
    if moved or unlocated:
        warnings.warn(
            f"{path}: moved {moved} answer offset(s) to where the answer text occurs; "
            f"{unlocated} answer(s) not found in their context are kept for scoring only",
            stacklevel=2,
        )
    return examples


def _question_id(path: Path, qa: dict, previous: str, seen: set[str]) -> str:
    """A question's id as text, refused if it is neither text nor a number, or seen before."""
    if not isinstance(qa["id"], (str, int)) or isinstance(qa["id"], bool):
        raise AttnlabError(  # str() would make ids such as "None"
            f"{path}: question id {qa['id']!r} after {previous!r} is neither text nor a number"
        )
    qid = str(qa["id"])
    if qid in seen:
        raise AttnlabError(f"{path}: question id {qid!r} appears twice")
    seen.add(qid)
    return qid


def _qa_example(
    path: Path,
    qa: dict,
    qid: str,
    title: str,
    context: object,
    fix_offsets: bool,
    require_answers: bool,
) -> tuple[QAExample, int]:
    """One question of a SQuAD file as an example, and how many of its answers were moved."""
    if not isinstance(context, str):  # tokenized as is when no answer reads it
        raise AttnlabError(f"{path}: the context of question {qid!r} is not text")
    if require_answers and not isinstance(qa.get("answers"), list):
        raise AttnlabError(
            f'{path}: question {qid!r} has no "answers" list: a training file '
            'needs one for every question ("answers": [] if it has no answer)'
        )
    answers, others = [], []
    moved = 0
    for answer in qa.get("answers", []):
        text, given = answer["text"], int(answer["answer_start"])
        start = _locate_answer(path, qid, context, text, given, fix_offsets)
        if start is None:
            others.append(text)
        else:
            answers.append({"text": text, "answer_start": start})
        moved += start is not None and start != given
    # A question may be empty (CMRC 2018's trial set has one): the model still reads the
    # passage, and the official scripts score it.
    question = qa["question"]
    if not isinstance(question, str):  # str() would train on "None" or "['a']"
        raise AttnlabError(f"{path}: question {qid!r} is not a string")
    return QAExample(qid, title, question, context, answers, others), moved


class AnswerOffsetError(AttnlabError):
    """An answer's offset does not point at its text (read_squad with fix_offsets=False)."""


def _locate_answer(
    path: Path, qid: str, context: str, text: str, start: int, fix_offsets: bool
) -> int | None:
    """Where answer `text` starts in `context`: `start` when right, else see read_squad."""
    if not isinstance(text, str):
        raise AttnlabError(f"{path}: question {qid!r} has an answer that is not text: {text!r}")
    if not text.strip():  # blank: no span to point at
        raise AttnlabError(f"{path}: question {qid!r} has an empty answer")
    if start >= 0 and context[start : start + len(text)] == text:
        return start
    if not fix_offsets:
        shown = context[max(start, 0) : max(start, 0) + len(text)]
        raise AnswerOffsetError(
            f"{path}: question {qid!r}: answer {text!r} is not at offset {start} "
            f"(the context there reads {shown!r})"
        )
    return _nearest_occurrence(context, text, start)


def _nearest_occurrence(context: str, text: str, start: int) -> int | None:
    """The start of the occurrence of `text` in `context` nearest to `start`, or None."""
    best = None
    found = context.find(text)
    while found >= 0:
        if best is None or abs(found - start) < abs(best - start):
            best = found
        found = context.find(text, found + 1)
    return best


def split_by_article(
    examples: Sequence[QAExample], held_out_every: int = 2
) -> tuple[list[QAExample], list[QAExample]]:
    """Split questions by article: of the sorted titles, every `held_out_every`-th is held out.

    With the default 2, even-indexed titles (0, 2, ...) go to the train half and odd ones
    to the held-out half, so no article (and no context) is in both. SQuAD v1.1 dev has
    48 articles: 24 + 24; `held_out_every=5` holds out 9.
    """
    if not isinstance(held_out_every, int) or held_out_every < 2:
        raise AttnlabError(f"held_out_every must be an integer >= 2, got {held_out_every!r}")
    titles = sorted({example.title for example in examples})
    held = {title for i, title in enumerate(titles) if i % held_out_every == held_out_every - 1}
    train = [example for example in examples if example.title not in held]
    held_out = [example for example in examples if example.title in held]
    return train, held_out


@dataclass
class QAFeature:
    """One window of a question + context, as model input with answer positions."""

    example_index: int
    input_ids: list[int]
    token_type_ids: list[int]
    offsets: list[tuple[int, int] | None]  # char span in the context; None off the context
    # (start, end) tokens of every gold answer in this window; (0, 0), i.e. [CLS], for one not
    # wholly inside it. SQuAD's dev file and CMRC 2018 give most questions several answers.
    answer_positions: list[tuple[int, int]] = field(default_factory=list)

    @property
    def start_position(self) -> int:
        """The first answer's start token in this window (0 if none is inside it)."""
        return self.answer_positions[0][0] if self.answer_positions else 0

    @property
    def end_position(self) -> int:
        """The first answer's end token in this window (0 if none is inside it)."""
        return self.answer_positions[0][1] if self.answer_positions else 0


def encode_squad(
    tokenizer: BertTokenizer,
    examples: Sequence[QAExample],
    max_length: int = 384,
    doc_stride: int = 128,
    max_question_length: int = 64,
) -> list[QAFeature]:
    """Encode [CLS] question [SEP] context-window [SEP] features, windows overlapping by doc_stride.

    A context too long for one input is covered by windows of the same length, each
    sharing `doc_stride` tokens with the one before (HF run_qa's `doc_stride`); the
    question keeps its first `max_question_length` tokens. `start_position` and
    `end_position` locate the first answer; `answer_positions` locates every answer.
    """
    if doc_stride < 0 or max_question_length < 1:
        raise AttnlabError(
            f"need doc_stride >= 0 and max_question_length >= 1, "
            f"got {doc_stride} and {max_question_length}"
        )
    if not examples:
        return []
    backend = tokenizer.backend
    # The windows are cut here rather than by the backend's truncation: tokenizers can
    # stride the context but cannot cut the question to its own limit at the same time.
    questions = backend.encode_batch([e.question for e in examples], add_special_tokens=False)
    # SQuAD asks about five questions per paragraph: tokenize each context once.
    contexts = list(dict.fromkeys(example.context for example in examples))
    encoded = backend.encode_batch(contexts, add_special_tokens=False)
    by_context = dict(zip(contexts, encoded, strict=True))
    cls_id, sep_id = tokenizer.cls_id, tokenizer.sep_id

    features = []
    for index, (example, question) in enumerate(zip(examples, questions, strict=True)):
        question_ids = question.ids[:max_question_length]
        context = by_context[example.context]
        room = max_length - len(question_ids) - 3  # context tokens per window
        if room <= doc_stride:
            raise AttnlabError(
                f"max_length {max_length} leaves {room} context tokens after a "
                f"{len(question_ids)}-token question: need more than doc_stride {doc_stride}"
            )
        n_context = len(context.ids)
        start = 0
        while True:
            end = min(start + room, n_context)
            window_offsets = [tuple(offset) for offset in context.offsets[start:end]]
            input_ids = [cls_id, *question_ids, sep_id, *context.ids[start:end], sep_id]
            n_first = len(question_ids) + 2
            token_type_ids = [0] * n_first + [1] * (end - start + 1)
            offsets = [None] * n_first + window_offsets + [None]
            # An answer not wholly inside the window points at [CLS] (index 0), as in BERT.
            positions = [
                (0, 0) if span is None else (span[0] + n_first, span[1] + n_first)
                for span in (_answer_tokens(window_offsets, a) for a in example.answers)
            ]
            features.append(QAFeature(index, input_ids, token_type_ids, offsets, positions))
            if end == n_context:
                break
            start = end - doc_stride
    return features


def _answer_tokens(offsets: list[tuple[int, int]], answer: dict | None) -> tuple[int, int] | None:
    """(first, last) token of the answer within a window, or None if not wholly inside it."""
    if answer is None or not offsets:
        return None
    first_char = answer["answer_start"]
    end_char = first_char + len(answer["text"])
    if offsets[0][0] > first_char or offsets[-1][1] < end_char:
        return None
    first = next(i for i, (_, stop) in enumerate(offsets) if stop > first_char)
    last = max(i for i, (begin, _) in enumerate(offsets) if begin < end_char)
    if last < first:  # the answer is only characters the tokenizer drops
        return None
    return first, last


def best_span(
    start_logits: Sequence[float],
    end_logits: Sequence[float],
    offsets: Sequence[tuple[int, int] | None],
    n_best: int = 20,
    max_answer_length: int = 30,
) -> tuple[int, int, float] | None:
    """Best (start_char, end_char, score) over context-token spans; None if there is none.

    The score of span i..j is start_logits[i] + end_logits[j] (BERT §4.2), searched over
    the `n_best` best starts and ends, with i <= j < i + max_answer_length.
    """
    n = len(offsets)
    is_context = np.array([offset is not None for offset in offsets], dtype=bool)
    if not is_context.any():
        return None
    # Padding may make the logits longer than the window: only its own tokens count.
    start = np.where(is_context, np.asarray(start_logits, dtype=np.float64)[:n], -np.inf)
    end = np.where(is_context, np.asarray(end_logits, dtype=np.float64)[:n], -np.inf)
    starts = np.argsort(-start, kind="stable")[:n_best]
    ends = np.argsort(-end, kind="stable")[:n_best]
    starts, ends = starts[is_context[starts]], ends[is_context[ends]]
    scores = start[starts][:, None] + end[ends][None, :]
    length = ends[None, :] - starts[:, None]
    scores = np.where((length >= 0) & (length < max_answer_length), scores, -np.inf)
    if scores.size == 0 or not np.isfinite(scores.max()):
        return None
    i, j = np.unravel_index(np.argmax(scores), scores.shape)
    first, last = offsets[starts[i]], offsets[ends[j]]
    return first[0], last[1], float(scores[i, j])


def decode_answers(
    examples: Sequence[QAExample],
    features: Sequence[QAFeature],
    start_logits: np.ndarray | list,
    end_logits: np.ndarray | list,
    n_best: int = 20,
    max_answer_length: int = 30,
) -> dict[str, str]:
    """Each question's answer text: the best-scoring span over all its windows ("" if none)."""
    if len(start_logits) != len(features) or len(end_logits) != len(features):
        raise AttnlabError(
            f"got logits for {len(start_logits)}/{len(end_logits)} windows "
            f"but {len(features)} features"
        )
    best: dict[int, tuple[int, int, float]] = {}
    for feature, starts, ends in zip(features, start_logits, end_logits, strict=True):
        span = best_span(starts, ends, feature.offsets, n_best, max_answer_length)
        previous = best.get(feature.example_index)
        if span is not None and (previous is None or span[2] > previous[2]):
            best[feature.example_index] = span
    answers = {}
    for index, example in enumerate(examples):
        span = best.get(index)
        answers[example.id] = "" if span is None else example.context[span[0] : span[1]]
    return answers
