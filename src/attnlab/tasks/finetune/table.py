"""Sentence and sentence-pair tasks on [CLS]: classify (GLUE-style classes) and regress (STS-B).

Devlin et al. (2019), section 4.1: one text, or two joined as ``[CLS] a [SEP] b [SEP]``,
read from a .tsv/.csv/.jsonl table; the head reads the final [CLS] vector.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from attnlab import metrics as task_metrics
from attnlab.errors import AttnlabError
from attnlab.io import json_safe
from attnlab.text import tasks as task_data
from attnlab.text.tokenizer import BertTokenizer

from .task import (
    FinetuneTask,
    Labels,
    Outputs,
    TaskData,
    in_file,
    is_text_pair,
    on_line,
    saved_class_labels,
)


class TableTask(FinetuneTask):
    """What classify and regress share: a table of texts (or pairs), one target per row."""

    python_input = "a text or a (text, pair) tuple"

    @property
    def reads_pairs(self) -> bool:
        """Whether the table has a second text per row (--text-pair-column)."""
        return bool(self.settings.text_pair_column)

    def read(self, path: Path, labelled: bool) -> list[task_data.TextExample]:
        """The table's rows; unlabelled input (for predict) needs no label column."""
        settings = self.settings
        # "a, b, label" names a, b and label, as a header row's names are stripped too
        columns = [c.strip() for c in settings.columns.split(",")] if settings.columns else None
        return task_data.read_table(
            path,
            text_column=settings.text_column,
            pair_column=settings.text_pair_column,
            label_column=settings.label_column if labelled else None,
            columns=columns,
        )

    def featurise(
        self, tokenizer: BertTokenizer, examples: list, labels: Labels, path: Path
    ) -> TaskData:
        """input_ids and token_type_ids per row, with its label's id or score as the target."""
        encoded = task_data.encode_texts(tokenizer, examples, self.settings.max_length)
        rows = []
        for example, enc in zip(examples, encoded, strict=True):
            row = {"input_ids": enc["input_ids"], "token_type_ids": enc["token_type_ids"]}
            if labels is not None:
                row["labels"] = in_file(
                    path, lambda e=example: on_line(e, lambda: labels.encode(e.label))
                )
            rows.append(row)
        return TaskData(examples, rows)

    def prediction_rows(
        self, data: TaskData, outputs: Outputs, labels: Labels
    ) -> list[dict[str, Any]]:
        """Each row's text (and pair) with its prediction."""
        rows = []
        for example, out in zip(data.examples, outputs, strict=True):
            row: dict[str, Any] = {"text": example.text}
            if example.pair is not None:
                row["pair"] = example.pair
            row.update(self.prediction(out["logits"], labels))
            rows.append(json_safe(row))
        return rows

    def prediction(self, logits: np.ndarray, labels: Labels) -> dict[str, Any]:
        """The prediction fields of one row's logits."""
        raise NotImplementedError

    def example_from(self, item: Any, index: int) -> task_data.TextExample | None:
        """A text, or a (text, pair) tuple, as a table row."""
        if isinstance(item, str):
            return task_data.TextExample(item, line=index + 1)
        if is_text_pair(item):
            return task_data.TextExample(item[0], item[1], line=index + 1)
        return None


class ClassifyTask(TableTask):
    """Sentence (pair) classification: softmax over the classes of the training file."""

    name = "classify"
    metrics = ("accuracy", "f1", "mcc")  # mcc only for two classes
    best_metric = "accuracy"

    def label_set(self, examples: list, path: Path) -> task_data.LabelSet:
        """The classes of the training file, at least two."""
        labels = task_data.LabelSet.from_examples([e.label for e in examples], "classes")
        if labels.num_labels < 2:
            raise AttnlabError(
                f"{path}: every example has the label {labels.names[0]!r}: classification "
                "needs at least two classes"
            )
        return labels

    def checkpoint_labels(self, model_dir: Path, model: nn.Module) -> task_data.LabelSet:
        """The saved head's classes, in id order."""
        return saved_class_labels(model_dir, model.num_labels)

    def head_names(self, labels: Labels) -> list[str] | None:
        """The class names in id order."""
        return labels.names if labels is not None else None

    def score(self, data: TaskData, outputs: Outputs, labels: Labels) -> dict[str, float]:
        """Accuracy, macro F1 and (two classes) MCC of the most likely classes."""
        gold = [row["labels"] for row in data.rows]
        predicted = [int(out["logits"].argmax()) for out in outputs]
        return task_metrics.classification_metrics(gold, predicted, labels.num_labels)

    def prediction(self, logits: np.ndarray, labels: Labels) -> dict[str, Any]:
        """The most likely class and every class's probability."""
        probs = torch.softmax(torch.from_numpy(logits), -1).tolist()
        return {
            "label": labels.decode(int(np.argmax(logits))),
            "probabilities": {n: round(p, 6) for n, p in zip(labels.names, probs, strict=True)},
        }


class RegressTask(TableTask):
    """Sentence-pair similarity (STS-B): one real-valued score per row, a squared-error loss."""

    name = "regress"
    metrics = ("pearson", "spearman")
    best_metric = "pearson"

    def label_set(self, examples: list, path: Path) -> task_data.LabelSet:
        """Scores: every label a number."""
        return task_data.LabelSet.from_examples([e.label for e in examples], "scores")

    def checkpoint_labels(self, model_dir: Path, model: nn.Module) -> task_data.LabelSet:
        """Scores (the saved head has one output)."""
        return task_data.LabelSet("scores", [])

    def head_names(self, labels: Labels) -> list[str]:
        """HF's id2label of a one-output regression head."""
        return ["score"]

    def score(self, data: TaskData, outputs: Outputs, labels: Labels) -> dict[str, float]:
        """Pearson and Spearman correlations of the predicted scores with the gold ones."""
        gold = [row["labels"] for row in data.rows]
        return task_metrics.regression_metrics([float(out["logits"][0]) for out in outputs], gold)

    def prediction(self, logits: np.ndarray, labels: Labels) -> dict[str, Any]:
        """The predicted score."""
        return {"score": round(float(logits[0]), 6)}
