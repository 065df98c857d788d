"""Fine-tuning BERT on a downstream task (Devlin et al. 2019, section 4): data -> head -> trainer.

One recipe for the four task shapes of figure 4: ``classify`` (sentence or pair, [CLS]),
``regress`` (pair similarity, STS-B), ``ner`` (BIO tags on each word's first sub-token) and
``qa`` (SQuAD start/end spans over strided windows). The steps:

1. read the task file (``attnlab.text.tasks``), take the label set from the training file;
2. load the encoder (an attnlab or HF checkpoint) with the task's head (new, or the
   checkpoint's own when it was fine-tuned on the same labels);
3. featurise, then batch by length: examples are shuffled, sorted by length inside chunks of
   ~64 batches, cut into batches padded only to their own longest row, and the batches are
   shuffled again. Sentence lengths vary widely (SST-2: 3 to 60+ tokens), so padding to a
   fixed 128, or to the longest of a random batch, would spend most FLOPs on [PAD];
4. train with the shared Trainer (AdamW, 10% warm-up + linear decay, the paper's 3 epochs
   at lr 3e-5 and batch 32), evaluating on --dev each epoch and keeping the best model;
5. publish the best model in --out as an HF-loadable checkpoint (config.json with
   architectures and id2label, the tokenizer, ``finetune.json`` with the data settings) and
   ``results.json`` with the step, epoch and dev metrics of the kept model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from attnlab import metrics as task_metrics
from attnlab.config import check_types
from attnlab.errors import AttnlabError
from attnlab.interop.hf import (
    checkpoint_labels,
    checkpoint_task,
    load_task_model,
    read_config,
    save_task_model,
)
from attnlab.io import check_output_file, clear_dir, json_safe, write_text_atomic
from attnlab.nn.dropout import eval_mode
from attnlab.nn.packed import packed_linears
from attnlab.tasks.pretrain import publish
from attnlab.text import tasks as task_data
from attnlab.text.tokenizer import BertTokenizer
from attnlab.train.config import RunOptions, TrainConfig
from attnlab.train.data import Batch
from attnlab.train.distributed import barrier, init_distributed, shutdown_distributed
from attnlab.train.trainer import Trainer, check_run_out, hold_run_out, holds_run

TASKS = ("classify", "regress", "ner", "qa")
DEFAULT_MAX_LENGTH = {"classify": 128, "regress": 128, "ner": 128, "qa": 384}
# The metric that picks the kept checkpoint (GLUE / CoNLL / SQuAD headline numbers).
BEST_METRIC = {"classify": "accuracy", "regress": "pearson", "ner": "f1", "qa": "f1"}
METRICS = {  # what each task's dev scores hold (metrics.py); mcc only for two classes
    "classify": ("accuracy", "f1", "mcc"),
    "regress": ("pearson", "spearman"),
    "ner": ("precision", "recall", "f1"),
    "qa": ("exact_match", "f1"),
}
SETTINGS_FILE = "finetune.json"  # the task and data settings evaluate/predict default to
RESULTS_FILE = "results.json"
TOKEN_OUTPUTS = ("start_logits", "end_logits")
BEST_DIR = "best"  # inside --out: the best model so far, published into --out at the end
# Data settings saved with the model, so evaluate/predict read files as training did.
DATA_SETTINGS = (
    "task",
    "columns",
    "text_column",
    "text_pair_column",
    "label_column",
    "tag_column",
    "max_length",
    "doc_stride",
    "max_question_length",
    "max_answer_length",
    "language",
)
OVERRIDABLE = DATA_SETTINGS[1:]  # what evaluate/predict may change: all but the task


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- options


@dataclass(kw_only=True)
class FinetuneOptions(RunOptions):
    """Settings of a fine-tuning run (the shared ones in RunOptions), named as the CLI flags."""

    task: str
    model: Path
    train: Path
    out: Path
    dev: Path | None = None
    epochs: int = 3
    steps: int | None = None  # overrides epochs
    batch_size: int = 32
    lr: float = 3e-5
    warmup_ratio: float = 0.1
    weight_decay: float = 0.01
    max_length: int | None = None  # None: 128, or 384 for qa
    doc_stride: int = 128
    max_question_length: int = 64
    max_answer_length: int = 30
    columns: str | None = None  # comma-separated names for a table without a header row
    text_column: str = "text"
    text_pair_column: str | None = None
    label_column: str = "label"
    tag_column: int = -1
    language: str = "auto"  # qa scoring: "en" (SQuAD), "zh" (CMRC 2018) or from the text
    fix_answer_offsets: bool = False  # qa training: move a wrong answer offset, not fail
    train_answers: str = "all"  # qa training targets: every gold answer, or the first only
    new_head: bool = False
    eval_batch_size: int = 64
    best_metric: str | None = None  # None: accuracy / pearson / f1 by task
    max_seconds: float | None = None
    # RunOptions' settings whose defaults differ here
    eval_every: int | None = None  # None: after every epoch
    save_every: int = 1000
    keep_last: int = 1

    def validate(self) -> None:
        """Raise AttnlabError for impossible settings, before anything is read or written."""
        super().validate()
        if self.task not in TASKS:
            raise AttnlabError(f"unknown task {self.task!r} (choose from {', '.join(TASKS)})")
        for name in ("epochs", "batch_size", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise AttnlabError(f"--{name.replace('_', '-')} must be at least 1")
        check_data_settings(self.settings())
        if self.steps is not None and self.steps < 1:
            raise AttnlabError("--steps must be at least 1")
        if self.weight_decay < 0:  # finite already
            raise AttnlabError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        if not 0 <= self.warmup_ratio < 1:
            raise AttnlabError(f"--warmup-ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.train_answers not in ("all", "first"):
            raise AttnlabError(f"--train-answers must be all or first, got {self.train_answers!r}")
        if self.best_metric is not None and self.best_metric not in METRICS[self.task]:
            raise AttnlabError(
                f"--best-metric {self.best_metric!r} is not a {self.task} score "
                f"(choose from {', '.join(METRICS[self.task])})"
            )
        if self.best_metric is not None and self.dev is None:
            raise AttnlabError("--best-metric needs --dev: it picks the model by its dev score")

    def settings(self) -> dict[str, Any]:
        """The data settings saved with the model (finetune.json)."""
        return {name: getattr(self, name) for name in DATA_SETTINGS}


def check_data_settings(settings: dict[str, Any]) -> None:
    """Refuse data settings out of range, given as options or read from a saved finetune.json.

    A saved max_answer_length of 0 made every answer empty, with exit 0.
    """
    if settings["max_answer_length"] < 1:
        raise AttnlabError(
            f"--max-answer-length must be at least 1, got {settings['max_answer_length']}"
        )
    if settings["language"] not in ("auto", "en", "zh"):
        raise AttnlabError(f"--language must be auto, en or zh, got {settings['language']!r}")


# ---------------------------------------------------------------------------- data


@dataclass
class TaskData:
    """A task file read and featurised: examples, one model-input row per feature, extras.

    ``rows`` are dicts of python lists/numbers (input_ids, token_type_ids and the targets);
    NER keeps each row's word_ids, QA its windows (QAFeature), to map outputs back.
    """

    task: str
    examples: list
    rows: list[dict[str, Any]]
    qa_features: list = field(default_factory=list)


def _in_file(path: Path, action: Callable[[], Any]) -> Any:
    """Run action; an AttnlabError without the file's name gets it (unknown labels, etc.)."""
    try:
        return action()
    except AttnlabError as err:
        if str(path) in str(err):
            raise
        raise AttnlabError(f"{path}: {err}") from None


def read_examples(task: str, path: Path, settings: dict[str, Any], labelled: bool) -> list:
    """The examples of a task file; unlabelled input (for predict) needs no label column."""
    path = Path(path)
    if task in ("classify", "regress"):
        return task_data.read_table(
            path,
            text_column=settings["text_column"],
            pair_column=settings["text_pair_column"],
            label_column=settings["label_column"] if labelled else None,
            # "a, b, label" names a, b and label, as a header row's names are stripped too
            columns=[c.strip() for c in settings["columns"].split(",")]
            if settings.get("columns")
            else None,
        )
    if task == "ner":
        return task_data.read_conll(path, tag_column=settings["tag_column"] if labelled else None)
    # Training targets must sit where the file says unless the user lets wrong offsets move
    # to the nearest occurrence of the answer text (CMRC 2018's trial set has 5 such
    # answers); scoring always tolerates them, as the official scripts compare texts.
    training = labelled and not settings["_scoring"]
    fix = not training or settings.get("_fix_offsets", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            examples = task_data.read_squad(path, fix_offsets=fix, require_answers=training)
        except task_data.AnswerOffsetError as err:
            raise AttnlabError(
                f"{err}; --fix-answer-offsets moves such answers to where their text occurs"
            ) from None
    for warning in caught:
        _say(f"warning: {warning.message}")
    if training:  # a question whose answer is nowhere in its context cannot be a target
        # (A question with no answers at all stays: it trains the [CLS] "no answer" target.)
        answerable = [e for e in examples if e.answers or not e.other_answers]
        if not answerable:
            raise AttnlabError(
                f"{path}: no question has its answer in its context: nothing to train on"
            )
        if len(answerable) < len(examples):
            _say(
                f"warning: {path}: {len(examples) - len(answerable)} question(s) whose answer "
                "is not in the context are left out of training"
            )
        examples = answerable
    return examples


def label_set_of(task: str, examples: list) -> task_data.LabelSet | None:
    """The training file's label set (None for qa)."""
    if task == "classify":
        return task_data.LabelSet.from_examples([e.label for e in examples], "classes")
    if task == "regress":
        return task_data.LabelSet.from_examples([e.label for e in examples], "scores")
    if task == "ner":
        return task_data.LabelSet.from_examples([t for e in examples for t in e.tags], "classes")
    return None


def featurise(
    task: str,
    tokenizer: BertTokenizer,
    examples: list,
    labels: task_data.LabelSet | None,
    settings: dict[str, Any],
    path: Path,
) -> TaskData:
    """Model-input rows for examples (with targets when labels is given)."""
    max_length = settings["max_length"]
    rows: list[dict[str, Any]] = []
    if task in ("classify", "regress"):
        encoded = task_data.encode_texts(tokenizer, examples, max_length)
        for example, enc in zip(examples, encoded, strict=True):
            row = {"input_ids": enc["input_ids"], "token_type_ids": enc["token_type_ids"]}
            if labels is not None:
                row["labels"] = _in_file(
                    path, lambda e=example: _line(e, lambda: labels.encode(e.label))
                )
            rows.append(row)
        return TaskData(task, examples, rows)
    if task == "ner":
        encoded = _in_file(
            path, lambda: task_data.encode_words(tokenizer, examples, labels, max_length)
        )
        cut = task_data.count_truncated_words(encoded, examples)
        if cut:
            _say(f"warning: {path}: {cut} word(s) past --max-length {max_length} get tag O")
        return TaskData(task, examples, encoded)
    features = task_data.encode_squad(
        tokenizer,
        examples,
        max_length=max_length,
        doc_stride=settings["doc_stride"],
        max_question_length=settings["max_question_length"],
    )
    # Targets: each gold answer's (start, end) tokens; the loss averages over them, which is
    # training once per annotator's answer at the cost of one pass (a single answer: as BERT).
    every = settings.get("_train_answers", "all") == "all"
    for feature in features:
        positions = feature.answer_positions if every else feature.answer_positions[:1]
        positions = positions or [(0, 0)]
        rows.append(
            {
                "input_ids": feature.input_ids,
                "token_type_ids": feature.token_type_ids,
                "start_positions": [start for start, _ in positions],
                "end_positions": [end for _, end in positions],
            }
        )
    return TaskData(task, examples, rows, features)


def _line(example: Any, action: Callable[[], Any]) -> Any:
    try:
        return action()
    except AttnlabError as err:
        raise AttnlabError(f"line {example.line}: {err}") from None


def collate(rows: Sequence[dict[str, Any]], pad_id: int, targets: bool = True) -> Batch:
    """Pad rows to the longest of them: input_ids, attention_mask, token_type_ids (+ targets)."""
    longest = max(len(row["input_ids"]) for row in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    types = torch.zeros((len(rows), longest), dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        ids[i, :n] = torch.tensor(row["input_ids"])
        types[i, :n] = torch.tensor(row["token_type_ids"])
        mask[i, :n] = 1
    batch: Batch = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
    if not targets:
        return batch
    first = rows[0]
    if "start_positions" in first:  # target distributions: each answer an equal share
        for key in ("start_positions", "end_positions"):
            shares = torch.zeros((len(rows), longest))
            for i, row in enumerate(rows):
                for position in row[key]:
                    shares[i, position] += 1 / len(row[key])
            batch[key] = shares
    elif isinstance(first.get("labels"), list):  # token labels; padding carries no loss
        labels = torch.full((len(rows), longest), task_data.IGNORE_INDEX, dtype=torch.long)
        for i, row in enumerate(rows):
            labels[i, : len(row["labels"])] = torch.tensor(row["labels"])
        batch["labels"] = labels
    elif isinstance(first.get("labels"), float):
        batch["labels"] = torch.tensor([row["labels"] for row in rows], dtype=torch.float)
    elif "labels" in first:
        batch["labels"] = torch.tensor([row["labels"] for row in rows], dtype=torch.long)
    return batch


class LengthGroupedBatches:
    """Shuffled batches of similar-length rows, each padded to its own longest: the BatchSource.

    Per epoch (seeded by seed and epoch only, so resuming reproduces it): a random
    permutation of the rows, cut into chunks of ``chunk_batches`` batches; each chunk is
    sorted by length and cut into batches; then the order of all the epoch's batches is
    shuffled. Batches stay random in content (a chunk is a random sample) but hold rows of
    near-equal length. Like ``TensorBatches``, the last incomplete batch of an epoch is
    dropped (a different random remainder each epoch) and, under torch.distributed, rank r
    reads rows [r*B/W, (r+1)*B/W) of every global batch.
    """

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        batch_size: int,
        pad_id: int,
        seed: int = 0,
        chunk_batches: int = 64,
    ) -> None:
        if not 1 <= batch_size <= len(rows):
            raise AttnlabError(
                f"--batch-size {batch_size} must be between 1 and the {len(rows)} training "
                "examples (features)"
            )
        self.rows = rows
        self.lengths = torch.tensor([len(row["input_ids"]) for row in rows])
        self.batch_size, self.pad_id = batch_size, pad_id
        self.seed, self.chunk_batches = seed, chunk_batches
        self.rank, self.world_size = 0, 1
        self.epoch, self.batch_index = 0, 0  # the next global batch to hand out

    @property
    def batches_per_epoch(self) -> int:
        """Full global batches in one pass over the rows."""
        return len(self.rows) // self.batch_size

    def set_rank(self, rank: int, world_size: int) -> None:
        """Read only this rank's slice of each global batch."""
        if self.batch_size % world_size:
            raise AttnlabError(
                f"--batch-size {self.batch_size} is not divisible by the {world_size} processes"
            )
        self.rank, self.world_size = rank, world_size

    def epoch_batches(self, epoch: int) -> list[Tensor]:
        """The row indices of every global batch of an epoch, in the order they are read."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(len(self.rows), generator=generator)
        order = order[: self.batches_per_epoch * self.batch_size]
        chunk = self.chunk_batches * self.batch_size
        batches = []
        for start in range(0, len(order), chunk):
            part = order[start : start + chunk]
            part = part[torch.argsort(self.lengths[part], descending=True, stable=True)]
            batches.extend(part.split(self.batch_size))
        shuffle = torch.randperm(len(batches), generator=generator)
        return [batches[i] for i in shuffle]

    def __iter__(self) -> Iterator[Batch]:
        """Yield this rank's share of each global batch, from the current position, forever."""
        share = self.batch_size // self.world_size
        while True:
            batches = self.epoch_batches(self.epoch)
            while self.batch_index < len(batches):
                rows = batches[self.batch_index][self.rank * share : (self.rank + 1) * share]
                self.batch_index += 1  # before yielding: state_dict() names the next batch
                yield collate([self.rows[i] for i in rows.tolist()], self.pad_id)
            self.epoch, self.batch_index = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        """The position: epoch and index of the next global batch."""
        return {"epoch": self.epoch, "batch_index": self.batch_index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position given by state_dict()."""
        self.epoch, self.batch_index = int(state["epoch"]), int(state["batch_index"])

    def tokens_in(self, batch: Batch) -> int:
        """Real (unpadded) tokens of a batch, for tokens/s."""
        return int(batch["attention_mask"].sum())


# ---------------------------------------------------------------------------- inference


@torch.no_grad()
def run_model(
    model: nn.Module, rows: Sequence[dict[str, Any]], pad_id: int, batch_size: int = 64
) -> list[dict[str, np.ndarray]]:
    """The model's outputs for every row, in row order; token outputs cut to the row's length.

    Rows are run longest first in batches of similar length, so padding stays small.
    """
    if batch_size < 1:
        raise AttnlabError(f"--batch-size must be at least 1, got {batch_size}")
    device = next(model.parameters()).device
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["input_ids"]), reverse=True)
    results: list[dict[str, np.ndarray]] = [{} for _ in rows]
    with eval_mode(model), packed_linears(model):  # no dropout; weights packed once
        for start in range(0, len(order), batch_size):
            index = order[start : start + batch_size]
            batch = collate([rows[i] for i in index], pad_id, targets=False)
            out = model(**{k: v.to(device) for k, v in batch.items()})
            outputs = {k: v.float().cpu().numpy() for k, v in out.items() if k != "loss"}
            for j, i in enumerate(index):
                n = len(rows[i]["input_ids"])
                # Per-token outputs (batch, seq, ...) lose their padding; per-example ones stay.
                results[i] = {
                    k: v[j, :n] if k in TOKEN_OUTPUTS or v.ndim == 3 else v[j]
                    for k, v in outputs.items()
                }
    return results


def score(
    data: TaskData,
    outputs: list[dict[str, np.ndarray]],
    labels: task_data.LabelSet | None,
    settings: dict[str, Any],
) -> dict[str, float]:
    """The task's standard metrics of model outputs against the examples' gold labels."""
    task = data.task
    if task == "classify":
        gold = [row["labels"] for row in data.rows]
        predicted = [int(out["logits"].argmax()) for out in outputs]
        return task_metrics.classification_metrics(gold, predicted, labels.num_labels)
    if task == "regress":
        gold = [row["labels"] for row in data.rows]
        return task_metrics.regression_metrics([float(out["logits"][0]) for out in outputs], gold)
    if task == "ner":
        predicted = ner_tags(data, outputs, labels)
        return task_metrics.entity_metrics([e.tags for e in data.examples], predicted)
    answers = qa_answers(data, outputs, settings)
    return task_metrics.squad_metrics(answers, data.examples, qa_language(settings, data.examples))


def ner_tags(
    data: TaskData, outputs: list[dict[str, np.ndarray]], labels: task_data.LabelSet
) -> list[list[str]]:
    """Each sentence's predicted tags: the tag of each word's first sub-token."""
    fill = labels.encode("O") if "O" in labels.names else 0  # words cut off by max_length
    tags = []
    for example, row, out in zip(data.examples, data.rows, outputs, strict=True):
        ids = out["logits"].argmax(-1).tolist()
        words = task_data.word_predictions(row["word_ids"], ids, len(example.words), fill)
        tags.append([labels.decode(i) for i in words])
    return tags


def qa_answers(
    data: TaskData, outputs: list[dict[str, np.ndarray]], settings: dict[str, Any]
) -> dict[str, str]:
    """Each question's best answer span over all its windows."""
    return task_data.decode_answers(
        data.examples,
        data.qa_features,
        [out["start_logits"] for out in outputs],
        [out["end_logits"] for out in outputs],
        max_answer_length=settings["max_answer_length"],
    )


def qa_language(settings: dict[str, Any], examples: Sequence[Any]) -> str:
    """The SQuAD scoring rule: as set, else "zh" when the contexts are mostly Chinese."""
    if settings.get("language", "auto") != "auto":
        return settings["language"]
    text = "".join(example.context for example in examples[:50])
    cjk = sum(1 for char in text if "\u4e00" <= char <= "\u9fff")
    return "zh" if text and cjk / len(text) > 0.3 else "en"


def check_scorable(task: str, examples: Sequence[Any], path: Path) -> None:
    """Refuse a labelled QA file with a question that has no gold answer (SQuAD v1.1 scores)."""
    if task == "qa":
        bare = next((e.id for e in examples if not (e.answers or e.other_answers)), None)
        if bare is not None:
            raise AttnlabError(f"{path}: question {bare!r} has no gold answer to score against")


def evaluation(
    data: TaskData,
    labels: task_data.LabelSet | None,
    settings: dict[str, Any],
    pad_id: int,
    batch_size: int,
) -> Callable[[nn.Module], dict[str, float]]:
    """The trainer's evaluate callback: the task's metrics on a fixed dev set."""

    def evaluate(model: nn.Module) -> dict[str, float]:
        return score(data, run_model(model, data.rows, pad_id, batch_size), labels, settings)

    return evaluate


# ---------------------------------------------------------------------------- the run


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_tokenizer(model_dir: Path) -> BertTokenizer:
    """The checkpoint's tokenizer, checked against its config."""
    config = read_config(model_dir)
    tokenizer = BertTokenizer.from_dir(model_dir)
    if tokenizer.vocab_size > config.vocab_size:
        raise AttnlabError(
            f"the tokenizer in {model_dir} has {tokenizer.vocab_size} tokens but config.json "
            f"says vocab_size {config.vocab_size}: are they from the same model?"
        )
    return tokenizer


def _check_model_fits(task: str, settings: dict[str, Any], model_dir: Path) -> None:
    """Refuse a --max-length beyond the model's positions, and text pairs it has no segment for."""
    config = read_config(model_dir)
    pairs = task == "qa" or (task in ("classify", "regress") and settings.get("text_pair_column"))
    if pairs and config.type_vocab_size < 2:  # the second text's segment id 1 has no embedding
        raise AttnlabError(
            f"{model_dir} has one token type (type_vocab_size 1): it cannot tell the two texts "
            f"of a pair apart, which task {task!r} with these settings needs"
        )
    limit = config.max_positions
    if settings["max_length"] > limit:
        raise AttnlabError(
            f"--max-length {settings['max_length']} is above the model's maximum ({limit})"
        )
    if settings["max_length"] < 8:
        raise AttnlabError("--max-length must be at least 8")


def initial_model(
    opts: FinetuneOptions, labels: task_data.LabelSet | None
) -> tuple[nn.Module, task_data.LabelSet | None, list[str]]:
    """The model to fine-tune from --model, the label set its head uses, its new parts.

    A checkpoint fine-tuned on another task, or on other labels, keeps its head only if
    that head fits: otherwise --new-head is needed, so no head is thrown away by accident.
    """
    saved = None if opts.new_head else checkpoint_task(opts.model)
    if saved is not None:
        if saved != opts.task:
            raise AttnlabError(
                f"--model {opts.model} is fine-tuned for {saved!r}, not {opts.task!r}: "
                "pass --new-head to train a new head on its encoder"
            )
        if labels is not None and labels.kind == "classes":
            names = checkpoint_labels(opts.model) or []
            if sorted(names) != sorted(labels.names):
                raise AttnlabError(
                    f"--model {opts.model} was trained on labels {names}, the training file "
                    f"has {labels.names}: pass --new-head to train a new head"
                )
            labels = task_data.LabelSet("classes", names)  # the head's own label order
    n_labels = labels.num_labels if labels is not None else None
    model, fresh = load_task_model(opts.model, opts.task, n_labels, new_head=opts.new_head)
    return model, labels, fresh


def _check_out(opts: FinetuneOptions) -> None:
    out = opts.out
    if out.exists() and opts.model.exists() and out.resolve() == opts.model.resolve():
        raise AttnlabError("--out must differ from --model")
    # A run killed before its first log row may hold a checkpoint, or nothing yet.
    started = holds_run(out) or (out / BEST_DIR).exists()
    inputs = [opts.model, opts.train, opts.dev]
    check_run_out(out, opts.resume, opts.overwrite, started, "fine-tuning", inputs)


@dataclass
class FinetuneRun:
    """Everything a run needs, built and checked before anything is written."""

    model: nn.Module
    tokenizer: BertTokenizer
    labels: task_data.LabelSet | None
    batches: LengthGroupedBatches
    train_config: TrainConfig
    evaluate: Callable[[nn.Module], dict[str, float]] | None
    fresh: list[str]
    train_examples: int


def prepare(opts: FinetuneOptions) -> FinetuneRun:
    """Read and check data, model and options; nothing is written."""
    opts.validate()
    opts.model, opts.train, opts.out = Path(opts.model), Path(opts.train), Path(opts.out)
    opts.dev = Path(opts.dev) if opts.dev is not None else None
    if opts.max_length is None:
        opts.max_length = DEFAULT_MAX_LENGTH[opts.task]
    _check_out(opts)
    tokenizer = load_tokenizer(opts.model)
    settings = {
        **opts.settings(),
        "_scoring": False,
        "_fix_offsets": opts.fix_answer_offsets,
        "_train_answers": opts.train_answers,
    }
    _check_model_fits(opts.task, settings, opts.model)
    train = read_examples(opts.task, opts.train, settings, labelled=True)
    labels = label_set_of(opts.task, train)
    if opts.task == "classify" and labels is not None and labels.num_labels < 2:
        raise AttnlabError(
            f"{opts.train}: every example has the label {labels.names[0]!r}: classification "
            "needs at least two classes"
        )
    torch.manual_seed(opts.seed)  # a fresh head's initial weights are part of the run
    model, labels, fresh = initial_model(opts, labels)
    train_data = featurise(opts.task, tokenizer, train, labels, settings, opts.train)
    evaluate = None
    if opts.dev is not None:
        dev = read_examples(opts.task, opts.dev, {**settings, "_scoring": True}, labelled=True)
        check_scorable(opts.task, dev, opts.dev)  # now, not at the first dev score
        dev_data = featurise(opts.task, tokenizer, dev, labels, settings, opts.dev)
        evaluate = evaluation(dev_data, labels, settings, tokenizer.pad_id, opts.eval_batch_size)
    batches = LengthGroupedBatches(train_data.rows, opts.batch_size, tokenizer.pad_id, opts.seed)
    per_epoch = batches.batches_per_epoch
    steps = opts.steps if opts.steps is not None else opts.epochs * per_epoch
    best = opts.best_metric or BEST_METRIC[opts.task]
    if best == "mcc" and labels is not None and labels.num_labels != 2:
        raise AttnlabError(
            f"--best-metric mcc needs two classes; these data have {labels.num_labels}"
        )
    config = TrainConfig(
        out_dir=opts.out,
        steps=steps,
        lr=opts.lr,
        warmup=math.ceil(opts.warmup_ratio * steps),
        schedule="linear",
        optimizer="adamw",
        weight_decay=opts.weight_decay,
        precision=opts.precision,
        seed=opts.seed,
        log_every=opts.log_every,
        eval_every=per_epoch if opts.eval_every is None else opts.eval_every,
        save_every=opts.save_every,
        keep_last=opts.keep_last,
        resume=opts.resume,
        overwrite=opts.overwrite,
        progress=opts.progress,
        best_metric=best if evaluate is not None else None,
        max_seconds=opts.max_seconds,
        job={"train": str(opts.train), "dev": str(opts.dev), "batch_size": opts.batch_size},
    )
    return FinetuneRun(
        model, tokenizer, labels, batches, config, evaluate, fresh, len(train_data.examples)
    )


def names_of(labels: task_data.LabelSet | None) -> list[str] | None:
    """Class names in id order (None for regression and qa)."""
    return labels.names if labels is not None and labels.kind == "classes" else None


def _save(run: FinetuneRun, opts: FinetuneOptions, model: nn.Module, where: Path) -> None:
    names = names_of(run.labels)
    if run.labels is not None and run.labels.kind == "scores":
        names = ["score"]  # HF's id2label of a one-output regression head
    settings = json.dumps(opts.settings(), indent=2, ensure_ascii=False) + "\n"
    save_task_model(model, where, run.tokenizer, names, {SETTINGS_FILE: settings}, overwrite=True)


def finetune(opts: FinetuneOptions) -> dict[str, Any]:
    """Fine-tune --model on --train (scoring --dev); the best model ends up in --out."""
    rank, world_size, _ = init_distributed()
    # prepare() fills in defaults: it gets a copy, and the caller's options stay as given
    opts = dataclasses.replace(opts)
    with hold_run_out(opts.out, rank):  # no other run writes to --out until this one ends
        run = prepare(opts)
        run.batches.set_rank(rank, world_size)  # its split refused before --overwrite clears --out
        if run.fresh:
            _say(
                f"{opts.model}: new randomly initialised {' and '.join(run.fresh)} for {opts.task}"
            )
        stage = opts.out / BEST_DIR
        if rank == 0 and opts.overwrite:  # the old run goes as a whole, before anything is written
            clear_dir(opts.out)
        per_epoch = run.batches.batches_per_epoch
        trainer = Trainer(
            run.model,
            run.batches,
            run.train_config,
            run.evaluate,
            # with a dev set, each better dev score keeps its model; without, the last one is kept
            on_best=(lambda model, _: _save(run, opts, model, stage)) if run.evaluate else None,
        )
        summary = trainer.fit()
        if rank == 0:
            best = summary.get("best")
            # No dev set, or no dev score that could pick a model (NaN at every evaluation, as
            # for a correlation of equal scores): the model kept is the last one.
            if not best:
                _save(run, opts, run.model.eval(), stage)
            results = {
                "task": opts.task,
                "kept": "best dev" if best else "last step",
                "best": {**best, "epoch": round(best["step"] / per_epoch, 3)} if best else None,
                "final": {
                    "step": summary["step"],
                    "epoch": round(summary["step"] / per_epoch, 3),
                    "loss": summary["loss"],
                    "eval": summary["eval"],
                },
                "train_examples": run.train_examples,
                "batches_per_epoch": per_epoch,
                "new_head": run.fresh,
                "labels": names_of(run.labels),
            }
            if stage.is_dir():
                publish(stage, opts.out)
            text = json.dumps(json_safe(results), indent=2, allow_nan=False)  # NaN: null
            write_text_atomic(opts.out / RESULTS_FILE, text + "\n")
            summary["results"] = results
        barrier()
        shutdown_distributed()
    return summary


# ---------------------------------------------------------------------------- evaluate / predict


@dataclass
class FinetunedModel:
    """A fine-tuned checkpoint ready for inference: model, tokenizer, labels, data settings."""

    model: nn.Module
    tokenizer: BertTokenizer
    labels: task_data.LabelSet | None
    settings: dict[str, Any]

    def predict(self, inputs: Sequence[Any], batch_size: int = 64) -> list[dict[str, Any]]:
        """One prediction per input, in order, as predict_file's rows.

        classify / regress: a text or a (text, pair) tuple, giving {"label", "probabilities"}
        or {"score"}; ner: a list of words (or a text, split at spaces), giving {"words",
        "tags"}; qa: a (question, context) tuple, giving {"id", "answer"}.
        """
        task = self.settings["task"]
        examples = [_python_example(task, item, i) for i, item in enumerate(inputs)]
        if not examples:
            return []
        data, outputs = self.run(examples, Path("<inputs>"), batch_size)
        return prediction_rows(data, outputs, self.labels, self.scoring)

    @property
    def scoring(self) -> dict[str, Any]:
        """The data settings for evaluation and prediction (answers scored by the task's rule)."""
        return {**self.settings, "_scoring": True}

    def run(
        self,
        examples: list,
        source: Path,
        batch_size: int,
        labels: task_data.LabelSet | None = None,
    ) -> tuple[TaskData, list[dict[str, np.ndarray]]]:
        """The examples' model rows (with targets when labels is given) and the model's outputs."""
        task = self.settings["task"]
        data = featurise(task, self.tokenizer, examples, labels, self.scoring, source)
        return data, run_model(self.model, data.rows, self.tokenizer.pad_id, batch_size)


def _python_example(task: str, item: Any, index: int) -> Any:
    """The task's example for one input given from Python (FinetunedModel.predict)."""

    def texts(value: Any) -> bool:
        return (
            isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, str) for v in value)
        )

    if task in ("classify", "regress"):
        if isinstance(item, str):
            return task_data.TextExample(item, line=index + 1)
        if texts(item):
            return task_data.TextExample(item[0], item[1], line=index + 1)
        wanted = "a text or a (text, pair) tuple"
    elif task == "ner":
        words = item.split() if isinstance(item, str) else item
        if isinstance(words, list) and words and all(isinstance(w, str) and w for w in words):
            return task_data.WordExample(list(words), None, index + 1)
        wanted = "a non-empty list of words, or a text"
    else:  # qa
        if texts(item):
            return task_data.QAExample(str(index), "", item[0], item[1], [])
        wanted = "a (question, context) tuple of strings"
    raise AttnlabError(f"input {index + 1}: expected {wanted} for {task}, got {item!r:.60}")


def load_finetuned(
    model_dir: str | Path, task: str | None = None, overrides: dict[str, Any] | None = None
) -> FinetunedModel:
    """Load a fine-tuned checkpoint (attnlab's or HF's) with the settings it was trained with."""
    model_dir = Path(model_dir)
    saved_task = checkpoint_task(model_dir)
    settings_file = model_dir / SETTINGS_FILE
    # A checkpoint without finetune.json (say, from HF transformers) reads files the default way.
    settings = {
        f.name: f.default for f in dataclasses.fields(FinetuneOptions) if f.name in DATA_SETTINGS
    }
    settings["task"] = saved_task
    if settings_file.is_file():
        try:
            saved = json.loads(settings_file.read_text(encoding="utf-8"))
        except (ValueError, RecursionError) as err:  # also too deep, or an integer too long
            raise AttnlabError(f"{settings_file}: not valid JSON ({err})") from None
        if not isinstance(saved, dict):
            raise AttnlabError(f"{settings_file}: expected a JSON object of settings")
        saved = {k: v for k, v in saved.items() if k in DATA_SETTINGS}
        check_types(FinetuneOptions, saved, str(settings_file))
        if saved.get("task", saved_task) != saved_task:  # config.json's head decides
            raise AttnlabError(
                f"{settings_file} says task {saved['task']!r} but the model's head is for "
                f"{saved_task!r}: the two files are from different models"
            )
        settings.update(saved)
    if saved_task is None:
        raise AttnlabError(
            f"{model_dir} holds no fine-tuned head (config.json architectures): "
            "fine-tune it first with attnlab finetune"
        )
    if task is not None and task != saved_task:
        raise AttnlabError(
            f"{model_dir} is a {saved_task!r} model: it cannot be used for task {task!r}"
        )
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    unknown = set(overrides) - set(OVERRIDABLE)
    if unknown:
        raise AttnlabError(
            f"overrides: no data setting {', '.join(sorted(unknown))} (the task is the model's; "
            f"choose from {', '.join(OVERRIDABLE)})"
        )
    check_types(FinetuneOptions, overrides, "overrides")
    settings.update(overrides)
    check_data_settings(settings)
    if settings["max_length"] is None:
        settings["max_length"] = DEFAULT_MAX_LENGTH[saved_task]
    _check_model_fits(saved_task, settings, model_dir)
    tokenizer = load_tokenizer(model_dir)
    model, fresh = load_task_model(model_dir, saved_task)
    if fresh:
        raise AttnlabError(f"{model_dir} lacks trained weights for its {', '.join(fresh)}")
    labels = None
    if saved_task in ("classify", "ner"):
        names = checkpoint_labels(model_dir) or []
        if len(names) != model.num_labels:  # predictions would be named by the wrong list
            raise AttnlabError(
                f"{model_dir}/config.json names {len(names)} labels in id2label, but its head "
                f"has {model.num_labels} outputs"
            )
        labels = task_data.LabelSet("classes", names)
    elif saved_task == "regress":
        labels = task_data.LabelSet("scores", [])
    return FinetunedModel(model.to(_device()).eval(), tokenizer, labels, settings)


def evaluate_file(
    model_dir: str | Path,
    data: str | Path,
    task: str | None = None,
    overrides: dict[str, Any] | None = None,
    batch_size: int = 64,
) -> dict[str, float]:
    """The task's metrics of a fine-tuned model on a labelled file."""
    loaded = load_finetuned(model_dir, task, overrides)
    settings = loaded.scoring
    path = Path(data)
    examples = read_examples(settings["task"], path, settings, labelled=True)
    check_scorable(settings["task"], examples, path)
    features, outputs = loaded.run(examples, path, batch_size, loaded.labels)
    return score(features, outputs, loaded.labels, settings)


def predict_file(
    model_dir: str | Path,
    input_path: str | Path,
    output_path: str | Path,
    task: str | None = None,
    overrides: dict[str, Any] | None = None,
    overwrite: bool = False,
    batch_size: int = 64,
) -> int:
    """Write predictions for an (unlabelled) input file; returns how many examples."""
    output = check_output_file(output_path, overwrite, inputs=[input_path, model_dir])
    loaded = load_finetuned(model_dir, task, overrides)
    settings = loaded.scoring
    path = Path(input_path)
    examples = read_examples(settings["task"], path, settings, labelled=False)
    data, outputs = loaded.run(examples, path, batch_size)
    write_text_atomic(output, prediction_text(data, outputs, loaded.labels, settings, output))
    return len(examples)


def prediction_rows(
    data: TaskData,
    outputs: list[dict[str, np.ndarray]],
    labels: task_data.LabelSet | None,
    settings: dict[str, Any],
) -> list[dict[str, Any]]:
    """One JSON-ready prediction per example: label and probabilities, score, tags or answer."""
    task = data.task
    if task == "qa":
        answers = qa_answers(data, outputs, settings)
        return [{"id": e.id, "answer": answers[e.id]} for e in data.examples]
    if task == "ner":
        tags = ner_tags(data, outputs, labels)
        return [{"words": e.words, "tags": t} for e, t in zip(data.examples, tags, strict=True)]
    rows = []
    for example, out in zip(data.examples, outputs, strict=True):
        row: dict[str, Any] = {"text": example.text}
        if example.pair is not None:
            row["pair"] = example.pair
        if task == "regress":
            row["score"] = round(float(out["logits"][0]), 6)
        else:
            probs = torch.softmax(torch.from_numpy(out["logits"]), -1).tolist()
            row["label"] = labels.decode(int(np.argmax(out["logits"])))
            row["probabilities"] = {
                n: round(p, 6) for n, p in zip(labels.names, probs, strict=True)
            }
        rows.append(json_safe(row))
    return rows


def prediction_text(
    data: TaskData,
    outputs: list[dict[str, np.ndarray]],
    labels: task_data.LabelSet | None,
    settings: dict[str, Any],
    output: Path,
) -> str:
    """The predictions file: JSONL (classify/regress, ner .jsonl), CoNLL (ner), SQuAD JSON (qa)."""
    rows = prediction_rows(data, outputs, labels, settings)
    if data.task == "qa":
        answers = {row["id"]: row["answer"] for row in rows}
        return json.dumps(answers, ensure_ascii=False, indent=2, allow_nan=False) + "\n"
    if data.task == "ner" and not output.name.endswith(".jsonl"):  # CoNLL: word tag lines
        lines = []
        for row in rows:
            lines.extend(f"{w} {t}" for w, t in zip(row["words"], row["tags"], strict=True))
            lines.append("")
        return "\n".join(lines) + "\n"
    lines = [json.dumps(row, ensure_ascii=False, allow_nan=False) for row in rows]
    return "\n".join(lines) + "\n"
