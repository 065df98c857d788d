"""Token tagging (NER): a BIO tag per word, predicted on its first sub-token.

Devlin et al. (2019), section 5.3: CoNLL column files; the word's first WordPiece carries its
tag, the others are ignored by the loss; entity-level precision, recall and F1 (seqeval).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from attnlab import metrics as task_metrics
from attnlab.text import tasks as task_data
from attnlab.text.tokenizer import BertTokenizer

from .task import FinetuneTask, Labels, Outputs, TaskData, in_file, saved_class_labels, say


class NerTask(FinetuneTask):
    """Named-entity tagging of CoNLL sentences."""

    name = "ner"
    metrics = ("precision", "recall", "f1")
    best_metric = "f1"
    python_input = "a non-empty list of words, or a text"

    def read(self, path: Path, labelled: bool) -> list[task_data.WordExample]:
        """The file's sentences; unlabelled input (for predict) needs no tag column."""
        return task_data.read_conll(path, tag_column=self.settings.tag_column if labelled else None)

    def label_set(self, examples: list, path: Path) -> task_data.LabelSet:
        """Every tag of the training file ("O" first for a BIO set)."""
        return task_data.LabelSet.from_examples([t for e in examples for t in e.tags], "classes")

    def featurise(
        self, tokenizer: BertTokenizer, examples: list, labels: Labels, path: Path
    ) -> TaskData:
        """Sub-token rows with word_ids, each word's tag id on its first sub-token."""
        max_length = self.settings.max_length
        encoded = in_file(
            path, lambda: task_data.encode_words(tokenizer, examples, labels, max_length)
        )
        cut = task_data.count_truncated_words(encoded, examples)
        if cut:
            say(f"warning: {path}: {cut} word(s) past --max-length {max_length} get tag O")
        return TaskData(examples, encoded)

    def checkpoint_labels(self, model_dir: Path, model: nn.Module) -> task_data.LabelSet:
        """The saved head's tags, in id order."""
        return saved_class_labels(model_dir, model.num_labels)

    def head_names(self, labels: Labels) -> list[str] | None:
        """The tags in id order."""
        return labels.names if labels is not None else None

    def tags(self, data: TaskData, outputs: Outputs, labels: task_data.LabelSet) -> list[list[str]]:
        """Each sentence's predicted tags: the tag of each word's first sub-token."""
        fill = labels.encode("O") if "O" in labels.names else 0  # words cut off by max_length
        tags = []
        for example, row, out in zip(data.examples, data.rows, outputs, strict=True):
            ids = out["logits"].argmax(-1).tolist()
            words = task_data.word_predictions(row["word_ids"], ids, len(example.words), fill)
            tags.append([labels.decode(i) for i in words])
        return tags

    def score(self, data: TaskData, outputs: Outputs, labels: Labels) -> dict[str, float]:
        """Entity-level precision, recall and F1 of the predicted tags."""
        predicted = self.tags(data, outputs, labels)
        return task_metrics.entity_metrics([e.tags for e in data.examples], predicted)

    def prediction_rows(
        self, data: TaskData, outputs: Outputs, labels: Labels
    ) -> list[dict[str, Any]]:
        """Each sentence's words and predicted tags."""
        tags = self.tags(data, outputs, labels)
        return [{"words": e.words, "tags": t} for e, t in zip(data.examples, tags, strict=True)]

    def prediction_text(self, rows: list[dict[str, Any]], output: Path) -> str:
        """CoNLL (a "word tag" line per word, a blank line per sentence), or JSON lines (.jsonl)."""
        if output.name.endswith(".jsonl"):
            return super().prediction_text(rows, output)
        lines = []
        for row in rows:
            lines.extend(f"{w} {t}" for w, t in zip(row["words"], row["tags"], strict=True))
            lines.append("")
        return "\n".join(lines) + "\n"

    def example_from(self, item: Any, index: int) -> task_data.WordExample | None:
        """A list of words, or a text split at spaces, as a sentence."""
        words = item.split() if isinstance(item, str) else item
        if isinstance(words, list) and words and all(isinstance(w, str) and w for w in words):
            return task_data.WordExample(list(words), None, index + 1)
        return None
