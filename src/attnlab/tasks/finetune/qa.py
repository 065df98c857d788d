"""Extractive question answering (SQuAD v1.1, CMRC 2018): an answer span in the context.

Devlin et al. (2019), section 4.2: ``[CLS] question [SEP] context [SEP]`` in overlapping
windows of a long context; start and end vectors S and E score each span i..j as
S·T_i + E·T_j, the best over all windows of a question is its answer; exact match and F1.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnlab import metrics as task_metrics
from attnlab.errors import AttnlabError
from attnlab.text import tasks as task_data
from attnlab.text.tokenizer import BertTokenizer

from .settings import DataSettings
from .task import FinetuneTask, Labels, Outputs, TaskData, is_text_pair, say

if TYPE_CHECKING:
    from .options import FinetuneOptions

TRAIN_ANSWERS = ("all", "first")  # training targets: every gold answer, or the first only


class QATask(FinetuneTask):
    """SQuAD-style spans; training options say how gold answers become targets."""

    name = "qa"
    metrics = ("exact_match", "f1")
    best_metric = "f1"
    default_max_length = 384
    python_input = "a (question, context) tuple of strings"

    def __init__(
        self,
        settings: DataSettings,
        *,
        fix_answer_offsets: bool = False,
        train_answers: str = "all",
    ) -> None:
        super().__init__(settings)
        self.fix_answer_offsets = fix_answer_offsets  # training: move a wrong offset, not fail
        self.train_answers = train_answers

    @classmethod
    def for_training(cls, opts: FinetuneOptions) -> QATask:
        """The task with the run's choice of training targets."""
        return cls(
            opts.data_settings(),
            fix_answer_offsets=opts.fix_answer_offsets,
            train_answers=opts.train_answers,
        )

    @property
    def reads_pairs(self) -> bool:
        """Always: a question and its context."""
        return True

    def read(self, path: Path, labelled: bool) -> list[task_data.QAExample]:
        """The file's questions, to score or predict.

        Scoring tolerates a gold answer at a wrong offset, as the official scripts compare
        texts, and keeps questions without an answer in their context.
        """
        return self._read_squad(path, fix_offsets=True, training=False)

    def read_training(self, path: Path) -> list[task_data.QAExample]:
        """The file's questions that can be training targets.

        Targets must sit where the file says unless the user lets wrong offsets move to the
        nearest occurrence of the answer text (CMRC 2018's trial set has 5 such answers).
        """
        examples = self._read_squad(path, self.fix_answer_offsets, training=True)
        # A question whose answer is nowhere in its context cannot be a target. (A question
        # with no answers at all stays: it trains the [CLS] "no answer" target.)
        answerable = [e for e in examples if e.answers or not e.other_answers]
        if not answerable:
            raise AttnlabError(
                f"{path}: no question has its answer in its context: nothing to train on"
            )
        if len(answerable) < len(examples):
            say(
                f"warning: {path}: {len(examples) - len(answerable)} question(s) whose answer "
                "is not in the context are left out of training"
            )
        return answerable

    def _read_squad(
        self, path: Path, fix_offsets: bool, training: bool
    ) -> list[task_data.QAExample]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                examples = task_data.read_squad(
                    path, fix_offsets=fix_offsets, require_answers=training
                )
            except task_data.AnswerOffsetError as err:
                raise AttnlabError(
                    f"{err}; fix_answer_offsets moves such answers to where their text occurs",
                    options=("fix_answer_offsets",),
                ) from None
        for warning in caught:
            say(f"warning: {warning.message}")
        return examples

    def check_scorable(self, examples: Sequence[Any], path: Path) -> None:
        """Refuse a question with no gold answer (SQuAD v1.1 scores every question)."""
        bare = next((e.id for e in examples if not (e.answers or e.other_answers)), None)
        if bare is not None:
            raise AttnlabError(f"{path}: question {bare!r} has no gold answer to score against")

    def featurise(
        self, tokenizer: BertTokenizer, examples: list, labels: Labels, path: Path
    ) -> TaskData:
        """One row per window, with each gold answer's (start, end) tokens as targets."""
        settings = self.settings
        features = task_data.encode_squad(
            tokenizer,
            examples,
            max_length=settings.max_length,
            doc_stride=settings.doc_stride,
            max_question_length=settings.max_question_length,
        )
        # The loss averages over the targets, which is training once per annotator's answer
        # at the cost of one pass (a single answer: as BERT).
        every = self.train_answers == "all"
        rows = []
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
        return TaskData(examples, rows, features)

    def answers(self, data: TaskData, outputs: Outputs) -> dict[str, str]:
        """Each question's best answer span over all its windows."""
        return task_data.decode_answers(
            data.examples,
            data.qa_features,
            [out["start_logits"] for out in outputs],
            [out["end_logits"] for out in outputs],
            max_answer_length=self.settings.max_answer_length,
        )

    def language(self, examples: Sequence[Any]) -> str:
        """The SQuAD scoring rule: as set, else "zh" when the contexts are mostly Chinese."""
        if self.settings.language != "auto":
            return self.settings.language
        text = "".join(example.context for example in examples[:50])
        cjk = sum(1 for char in text if "\u4e00" <= char <= "\u9fff")
        return "zh" if text and cjk / len(text) > 0.3 else "en"

    def score(self, data: TaskData, outputs: Outputs, labels: Labels) -> dict[str, float]:
        """Exact match and F1 of the answers, by the language's rule."""
        answers = self.answers(data, outputs)
        return task_metrics.squad_metrics(answers, data.examples, self.language(data.examples))

    def prediction_rows(
        self, data: TaskData, outputs: Outputs, labels: Labels
    ) -> list[dict[str, Any]]:
        """Each question's id and answer."""
        answers = self.answers(data, outputs)
        return [{"id": e.id, "answer": answers[e.id]} for e in data.examples]

    def prediction_text(self, rows: list[dict[str, Any]], output: Path) -> str:
        """SQuAD's predictions file: one JSON object of answers by question id."""
        answers = {row["id"]: row["answer"] for row in rows}
        return json.dumps(answers, ensure_ascii=False, indent=2, allow_nan=False) + "\n"

    def example_from(self, item: Any, index: int) -> task_data.QAExample | None:
        """A (question, context) tuple as a question numbered by its place."""
        if is_text_pair(item):
            return task_data.QAExample(str(index), "", item[0], item[1], [])
        return None
