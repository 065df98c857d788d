"""TrainConfig: every choice of a training run, with the papers' defaults; RunOptions; seeding."""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnlab.config import check_field_types
from attnlab.errors import AttnlabError
from attnlab.train.optim import OPTIMIZER_DEFAULTS, SCHEDULES

PRECISIONS = ("fp32", "bf16")
STRATEGIES = ("ddp", "fsdp")  # data parallelism under torchrun: replicated or sharded
MAX_GRAD_ACCUM = 1 << 16  # micro-batches a step: more would not finish a step in a run


@dataclass
class TrainConfig:
    """How to train: length, optimiser and schedule, precision, logging, checkpoints, resume.

    ``weight_decay``, ``betas`` and ``eps`` left as None take the optimiser's paper values
    (AdamW: 0.01, (0.9, 0.999), 1e-6 as in BERT; Adam: 0, (0.9, 0.98), 1e-9 as in the
    Transformer). ``eval_every`` / ``save_every`` of 0 mean only at the end; ``keep_last``
    of 0 keeps every checkpoint. ``best_metric`` names an evaluation metric to track
    (``best_mode`` "max" or "min"): each evaluation that improves it calls the trainer's
    ``on_best``. ``max_seconds`` ends training early, with a checkpoint, once that much
    training time (summed over resumed runs) has passed; with ``warmup_share`` too, the
    warm-up is planned from the steps that time allows (that share of them, at most
    ``warmup``; a linear decay ends with them): Trainer._plan_schedule. ``eval_at_start`` also
    evaluates the model as it starts (an eval row at step 0, kept when the run is resumed).
    """

    out_dir: Path
    steps: int
    lr: float = 1e-4
    warmup: int = 0
    schedule: str = "linear"
    optimizer: str = "adamw"
    weight_decay: float | None = None
    betas: tuple[float, float] | None = None
    eps: float | None = None
    grad_accum: int = 1
    clip_norm: float | None = 1.0
    precision: str = "fp32"
    seed: int = 0
    log_every: int = 10
    eval_every: int = 0
    save_every: int = 1000
    keep_last: int = 3
    resume: bool = False
    overwrite: bool = False
    progress: bool = True
    device: str = "auto"
    find_unused_parameters: bool = False  # DDP: set when some parameters get no gradient
    best_metric: str | None = None
    best_mode: str = "max"
    max_seconds: float | None = None
    warmup_share: float | None = None  # None: warmup as given, whatever the time limit
    eval_at_start: bool = False
    compile: bool = False  # torch.compile the forward pass (pays off on GPUs; measure on CPU)
    # Under torchrun: "ddp" replicates the model on every process, "fsdp" shards parameters,
    # gradients and optimiser state over them (train/sharding.py); one process ignores it.
    strategy: str = "ddp"
    # The job's own settings (data files, batch and model sizes) as plain values: recorded in
    # each checkpoint, so a resume with other ones is warned about.
    job: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)
        self.validate()

    def validate(self) -> None:
        """Raise AttnlabError for an out-of-range or contradictory field."""
        check_field_types(self, "train")  # steps=4.5 ran 5 steps and never finished
        for name, low in (("steps", 1), ("grad_accum", 1), ("log_every", 1)):
            if getattr(self, name) < low:
                raise AttnlabError(f"train: {name} must be >= {low}, got {getattr(self, name)}")
        for name, high in (("steps", 2**31 - 1), ("grad_accum", MAX_GRAD_ACCUM)):
            if getattr(self, name) > high:  # past these a run overflows or never ends a step
                raise AttnlabError(f"train: {name} must be <= {high}, got {getattr(self, name)}")
        for name in ("warmup", "eval_every", "save_every", "keep_last"):
            if getattr(self, name) < 0:
                raise AttnlabError(f"train: {name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.lr < math.inf:
            raise AttnlabError(f"train: lr must be a finite number > 0, got {self.lr}")
        if self.weight_decay is not None and not 0 <= self.weight_decay < math.inf:
            raise AttnlabError(
                f"train: weight_decay must be a finite number >= 0, got {self.weight_decay}"
            )
        check_seed(self.seed)
        choices = {"schedule": SCHEDULES, "optimizer": tuple(OPTIMIZER_DEFAULTS)}
        choices["precision"], choices["strategy"] = PRECISIONS, STRATEGIES
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise AttnlabError(
                    f"train: {name} must be one of {list(allowed)}, got {getattr(self, name)!r}"
                )
        if self.best_mode not in ("max", "min"):
            raise AttnlabError(f"train: best_mode must be 'max' or 'min', got {self.best_mode!r}")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise AttnlabError(f"train: max_seconds must be > 0, got {self.max_seconds}")
        if self.warmup_share is not None and not 0 < self.warmup_share <= 1:
            raise AttnlabError(f"train: warmup_share must be in (0, 1], got {self.warmup_share}")
        if self.schedule == "inverse_sqrt" and self.warmup < 1:
            raise AttnlabError("train: the inverse_sqrt schedule needs warmup >= 1")
        if self.resume and self.overwrite:
            raise AttnlabError("train: pass resume or overwrite, not both")
        if self.strategy == "fsdp" and self.compile:  # not tried together: refused, not guessed
            raise AttnlabError("train: strategy fsdp does not combine with compile")

    def to_dict(self) -> dict[str, Any]:
        """The fields as primitives (for trainer.pt and logs)."""
        return {**dataclasses.asdict(self), "out_dir": str(self.out_dir)}


@dataclass(kw_only=True)
class RunOptions:
    """The settings every training job's options share (a job's class may change a default).

    They pass through to TrainConfig; ``validate`` checks them before the job reads or writes
    anything.
    """

    lr: float = 1e-4  # the peak learning rate; each job sets its own default
    log_every: int = 10
    eval_every: int | None = 0
    save_every: int | None = 500
    keep_last: int = 3
    seed: int = 0
    precision: str = "fp32"
    resume: bool = False
    overwrite: bool = False
    progress: bool = True

    def validate(self) -> None:
        """Raise AttnlabError for an impossible run setting."""
        # Typed as the CLI's --config files are checked (a Python caller may pass "3" for 3).
        check_field_types(self, None)
        if not self.lr > 0:  # finite already
            raise AttnlabError(f"lr must be > 0, got {self.lr}", options=("lr",))
        if self.log_every < 1:
            raise AttnlabError(
                f"log_every must be at least 1, got {self.log_every}", options=("log_every",)
            )
        if self.keep_last < 0:
            raise AttnlabError(
                f"keep_last must be >= 0 (0 keeps all), got {self.keep_last}",
                options=("keep_last",),
            )
        if self.precision not in PRECISIONS:
            raise AttnlabError(
                f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}",
                options=("precision",),
            )
        if self.resume and self.overwrite:
            raise AttnlabError(
                "resume and overwrite contradict each other: choose one",
                options=("resume", "overwrite"),
            )
        check_seed(self.seed)


def check_seed(seed: int) -> None:
    """Raise AttnlabError unless seed is an integer in [0, 2**63) (what every RNG here takes)."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise AttnlabError(
            f"seed must be an integer from 0 to 2**63 - 1, got {seed!r}", options=("seed",)
        )


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's and torch's global RNGs (torch's also seeds every GPU)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
