"""What one fine-tuning task decides, as a class: Devlin et al. (2019), section 4 and figure 4.

BERT fine-tunes one encoder on four input shapes; each is a ``FinetuneTask`` subclass
(``table.py``: classify and regress, ``ner.py``, ``qa.py``) that reads its files, takes the
label set from the training file, turns examples into model rows, scores the model's
outputs and writes its predictions. The recipe (``run.py``) and inference
(``inference.py``) call these methods and never ask which task they hold.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from torch import nn

from attnlab.errors import AttnlabError
from attnlab.interop.hf import checkpoint_labels as saved_label_names
from attnlab.text import tasks as task_data
from attnlab.text.tokenizer import BertTokenizer

from .settings import DataSettings

if TYPE_CHECKING:
    from .options import FinetuneOptions

Outputs = list[dict[str, np.ndarray]]  # the model's outputs, one dict of arrays per row
Labels = task_data.LabelSet | None  # a task's label set (None: qa, or a file to predict)


def say(message: str) -> None:
    """A message for the user, on stderr."""
    print(message, file=sys.stderr, flush=True)


@dataclass
class TaskData:
    """A task file read and featurised: examples, one model-input row per feature, extras.

    ``rows`` are dicts of python lists/numbers (input_ids, token_type_ids and the targets);
    NER keeps each row's word_ids, QA its windows (``qa_features``), to map outputs back.
    """

    examples: list
    rows: list[dict[str, Any]]
    qa_features: list = field(default_factory=list)


class FinetuneTask:
    """One task shape: its files, labels, model rows, metrics and predictions.

    Subclasses set the class attributes and implement ``read``, ``featurise``, ``score``,
    ``prediction_rows`` and ``example_from``; the other methods have the common behaviour.
    """

    name: ClassVar[str]
    metrics: ClassVar[tuple[str, ...]]  # what its dev scores hold (metrics.py)
    best_metric: ClassVar[str]  # the score that picks the kept model (the paper's headline)
    default_max_length: ClassVar[int] = 128  # tokens per input when --max-length is not given
    python_input: ClassVar[str]  # what predict() takes from Python, named in its error

    def __init__(self, settings: DataSettings) -> None:
        self.settings = settings

    @classmethod
    def for_training(cls, opts: FinetuneOptions) -> FinetuneTask:
        """The task as a fine-tuning run with these options reads and featurises its files."""
        return cls(opts.data_settings())

    @property
    def reads_pairs(self) -> bool:
        """Whether inputs are text pairs (segment ids 0 and 1), with these settings."""
        return False

    # ---- reading

    def read(self, path: Path, labelled: bool) -> list:
        """The examples of a file to score (labelled) or to predict (labels unused)."""
        raise NotImplementedError

    def read_training(self, path: Path) -> list:
        """The examples of a training file (which may need stricter reading than scoring)."""
        return self.read(path, labelled=True)

    def label_set(self, examples: list, path: Path) -> task_data.LabelSet | None:
        """The training file's label set (None: the task has none)."""
        return None

    def check_scorable(self, examples: Sequence[Any], path: Path) -> None:
        """Refuse a labelled file whose examples cannot be scored."""

    def featurise(
        self, tokenizer: BertTokenizer, examples: list, labels: Labels, path: Path
    ) -> TaskData:
        """Model-input rows for examples (with targets when labels is given)."""
        raise NotImplementedError

    # ---- the saved head's labels

    def checkpoint_labels(self, model_dir: Path, model: nn.Module) -> task_data.LabelSet | None:
        """The label set the saved model's head was trained on (None: the task has none)."""
        return None

    def head_names(self, labels: Labels) -> list[str] | None:
        """The head's id2label as saved in config.json (None: the task has none)."""
        return None

    # ---- outputs

    def score(self, data: TaskData, outputs: Outputs, labels: Labels) -> dict[str, float]:
        """The task's standard metrics of model outputs against the examples' gold labels."""
        raise NotImplementedError

    def prediction_rows(
        self, data: TaskData, outputs: Outputs, labels: Labels
    ) -> list[dict[str, Any]]:
        """One JSON-ready prediction per example."""
        raise NotImplementedError

    def prediction_text(self, rows: list[dict[str, Any]], output: Path) -> str:
        """The predictions file for rows: JSON lines unless the task has its own format."""
        lines = [json.dumps(row, ensure_ascii=False, allow_nan=False) for row in rows]
        return "\n".join(lines) + "\n"

    def example_from(self, item: Any, index: int) -> Any | None:
        """The task's example for one input given from Python, or None if it has another form."""
        raise NotImplementedError

    def python_example(self, item: Any, index: int) -> Any:
        """The task's example for one input given from Python (FinetunedModel.predict)."""
        example = self.example_from(item, index)
        if example is None:
            raise AttnlabError(
                f"input {index + 1}: expected {self.python_input} for {self.name}, got {item!r:.60}"
            )
        return example


# ---------------------------------------------------------------------------- shared helpers


def in_file(path: Path, action: Callable[[], Any]) -> Any:
    """Run action; an AttnlabError without the file's name gets it (unknown labels, etc.)."""
    try:
        return action()
    except AttnlabError as err:
        if str(path) in str(err):
            raise
        raise AttnlabError(f"{path}: {err}") from None


def on_line(example: Any, action: Callable[[], Any]) -> Any:
    """Run action; an AttnlabError gets the example's line in its file."""
    try:
        return action()
    except AttnlabError as err:
        raise AttnlabError(f"line {example.line}: {err}") from None


def is_text_pair(value: Any) -> bool:
    """Whether value is a tuple of two strings (a text pair, or a question and its context)."""
    return isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, str) for v in value)


def saved_class_labels(model_dir: Path, num_outputs: int) -> task_data.LabelSet:
    """The class names of a saved head (config.json's id2label), checked against its outputs."""
    names = saved_label_names(model_dir) or []
    if len(names) != num_outputs:  # predictions would be named by the wrong list
        raise AttnlabError(
            f"{model_dir}/config.json names {len(names)} labels in id2label, but its head "
            f"has {num_outputs} outputs"
        )
    return task_data.LabelSet("classes", names)
