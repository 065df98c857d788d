"""The data settings of a fine-tuned model: how its task's files are read and cut into rows.

They are saved with the model (``finetune.json``), so evaluate and predict read files as
training did; ``FinetuneOptions`` takes its defaults from here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from attnlab.errors import AttnlabError

LANGUAGES = ("auto", "en", "zh")  # qa scoring: from the text, SQuAD's rule, CMRC 2018's


@dataclass(kw_only=True)
class DataSettings:
    """How a task file is read and featurised; the fields of finetune.json, in its order."""

    task: str
    columns: str | None = None  # comma-separated names for a table without a header row
    text_column: str = "text"
    text_pair_column: str | None = None
    label_column: str = "label"
    tag_column: int = -1
    max_length: int | None = None  # None: the task's default (FinetuneTask.default_max_length)
    doc_stride: int = 128
    max_question_length: int = 64
    max_answer_length: int = 30
    language: str = "auto"  # qa scoring: "en" (SQuAD), "zh" (CMRC 2018) or from the text

    def check(self) -> None:
        """Refuse settings out of range, given as options or read from a saved finetune.json.

        A saved max_answer_length of 0 made every answer empty, with exit 0.
        """
        if self.max_answer_length < 1:
            raise AttnlabError(
                f"max_answer_length must be at least 1, got {self.max_answer_length}",
                options=("max_answer_length",),
            )
        if self.language not in LANGUAGES:
            raise AttnlabError(
                f"language must be auto, en or zh, got {self.language!r}", options=("language",)
            )

    def to_dict(self) -> dict[str, Any]:
        """The settings as finetune.json holds them."""
        return dataclasses.asdict(self)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every setting's name, the task first."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def overridable(cls) -> tuple[str, ...]:
        """What evaluate and predict may change: every setting but the task (the model's)."""
        return cls.names()[1:]
