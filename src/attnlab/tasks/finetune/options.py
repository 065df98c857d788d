"""The options of a fine-tuning run, named as the CLI flags; every default is written here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from attnlab.errors import AttnlabError
from attnlab.models.heads import POOLINGS
from attnlab.train.config import RunOptions

from .qa import TRAIN_ANSWERS
from .registry import task_class
from .settings import DataSettings


@dataclass(kw_only=True)
class FinetuneOptions(DataSettings, RunOptions):
    """Settings of a fine-tuning run: the data settings saved with the model (DataSettings),
    those every training job shares (RunOptions), and these."""

    model: Path
    train: Path
    out: Path
    dev: Path | None = None
    # None: chosen by the run for the checkpoint and the data, and printed (defaults.py)
    epochs: int | None = None
    steps: int | None = None  # overrides epochs
    batch_size: int | None = None
    lr: float | None = None
    warmup_ratio: float | None = None
    pooling: str | None = None  # classify/regress: "cls" or "mean" (None: chosen, defaults.py)
    weight_decay: float = 0.01
    fix_answer_offsets: bool = False  # qa training: move a wrong answer offset, not fail
    train_answers: str = "all"  # qa training targets: every gold answer, or the first only
    new_head: bool = False
    eval_batch_size: int = 64  # also evaluate's and predict's batch size
    best_metric: str | None = None  # None: the task's (accuracy / pearson / f1)
    max_seconds: float | None = None
    # RunOptions' settings whose defaults differ here
    eval_every: int | None = None  # None: after every epoch
    save_every: int = 1000
    keep_last: int = 1

    def validate(self) -> None:
        """Raise AttnlabError for impossible settings, before anything is read or written."""
        # RunOptions checks a given lr; None is the run's to choose (defaults.py)
        given = self if self.lr is not None else dataclasses.replace(self, lr=1.0)
        super(FinetuneOptions, given).validate()
        task = task_class(self.task)
        for name in ("epochs", "batch_size", "eval_batch_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise AttnlabError(f"{name} must be at least 1", options=(name,))
        self.check()
        if self.steps is not None and self.steps < 1:
            raise AttnlabError("steps must be at least 1", options=("steps",))
        if self.weight_decay < 0:  # finite already
            raise AttnlabError(
                f"weight_decay must be >= 0, got {self.weight_decay}", options=("weight_decay",)
            )
        if self.warmup_ratio is not None and not 0 <= self.warmup_ratio < 1:
            raise AttnlabError(
                f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}",
                options=("warmup_ratio",),
            )
        if self.pooling is not None and self.pooling not in POOLINGS:
            raise AttnlabError(
                f"pooling must be cls or mean, got {self.pooling!r}", options=("pooling",)
            )
        if self.pooling is not None and self.task not in ("classify", "regress"):
            raise AttnlabError(
                f"pooling applies to classify and regress heads, not {self.task}",
                options=("pooling",),
            )
        if self.train_answers not in TRAIN_ANSWERS:
            raise AttnlabError(
                f"train_answers must be all or first, got {self.train_answers!r}",
                options=("train_answers",),
            )
        if self.best_metric is not None and self.best_metric not in task.metrics:
            raise AttnlabError(
                f"best_metric {self.best_metric!r} is not a {self.task} score "
                f"(choose from {', '.join(task.metrics)})",
                options=("best_metric",),
            )
        if self.best_metric is not None and self.dev is None:
            raise AttnlabError(
                "best_metric needs dev: it picks the model by its score on that file",
                options=("best_metric", "dev"),
            )

    def data_settings(self) -> DataSettings:
        """The data settings saved with the model (finetune.json)."""
        return DataSettings(**{name: getattr(self, name) for name in DataSettings.names()})
