"""The fine-tuning recipe: options and files checked, the run built on rank 0, trained, published.

``prepare`` builds a run (data, model, trainer settings) and writes nothing; ``finetune`` runs
it as a job (``tasks/job.py``): the best dev model is kept in --out/best while training and
published into --out at the end, with ``results.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnlab import fast
from attnlab.errors import AttnlabError
from attnlab.interop.hf import checkpoint_labels, checkpoint_task, load_task_model, save_task_model
from attnlab.io import clear_dir, json_safe, write_text_atomic
from attnlab.tasks.job import Job, run_job
from attnlab.tasks.job import publish as publish_dir
from attnlab.text import tasks as task_data
from attnlab.text.tokenizer import BertTokenizer
from attnlab.train.config import TrainConfig
from attnlab.train.trainer import Trainer, check_run_out, holds_run

from . import defaults
from .batches import LengthGroupedBatches
from .inference import SETTINGS_FILE, check_model_fits, load_tokenizer, run_model
from .options import FinetuneOptions
from .registry import task_class
from .task import FinetuneTask, say

RESULTS_FILE = "results.json"
BEST_DIR = "best"  # inside --out: the best model so far, published into --out at the end

Evaluate = Callable[[nn.Module], dict[str, float]]


@dataclass
class FinetuneRun:
    """Everything a run needs, built and checked before anything is written."""

    model: nn.Module
    tokenizer: BertTokenizer
    task: FinetuneTask
    labels: task_data.LabelSet | None
    batches: LengthGroupedBatches
    train_config: TrainConfig
    evaluate: Evaluate | None
    fresh: list[str]
    train_examples: int


def check_options(opts: FinetuneOptions) -> None:
    """Validate opts, fill in the task's --max-length, and refuse an --out the run may not use."""
    opts.validate()
    opts.model, opts.train, opts.out = Path(opts.model), Path(opts.train), Path(opts.out)
    opts.dev = Path(opts.dev) if opts.dev is not None else None
    if opts.max_length is None:
        opts.max_length = task_class(opts.task).default_max_length
    out = opts.out
    if out.exists() and opts.model.exists() and out.resolve() == opts.model.resolve():
        raise AttnlabError("out must differ from model", options=("out", "model"))
    # A run killed before its first log row may hold a checkpoint, or nothing yet.
    started = holds_run(out) or (out / BEST_DIR).exists()
    inputs = [opts.model, opts.train, opts.dev]
    check_run_out(out, opts.resume, opts.overwrite, started, "fine-tuning", inputs)


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
                f"model {opts.model} is fine-tuned for {saved!r}, not {opts.task!r}: "
                "pass new_head to train a new head on its encoder",
                options=("model", "new_head"),
            )
        if labels is not None and labels.kind == "classes":
            names = checkpoint_labels(opts.model) or []
            if sorted(names) != sorted(labels.names):
                raise AttnlabError(
                    f"model {opts.model} was trained on labels {names}, the training file "
                    f"has {labels.names}: pass new_head to train a new head",
                    options=("model", "new_head"),
                )
            labels = task_data.LabelSet("classes", names)  # the head's own label order
    n_labels = labels.num_labels if labels is not None else None
    model, fresh = load_task_model(
        opts.model, opts.task, n_labels, new_head=opts.new_head, pooling=opts.pooling
    )
    return model, labels, fresh


def dev_evaluation(
    opts: FinetuneOptions,
    task: FinetuneTask,
    tokenizer: BertTokenizer,
    labels: task_data.LabelSet | None,
) -> Evaluate | None:
    """The trainer's evaluate callback: the task's metrics on --dev (None without --dev)."""
    if opts.dev is None:
        return None
    examples = task.read(opts.dev, labelled=True)
    task.check_scorable(examples, opts.dev)  # now, not at the first dev score
    data = task.featurise(tokenizer, examples, labels, opts.dev)

    def evaluate(model: nn.Module) -> dict[str, float]:
        outputs = run_model(model, data.rows, tokenizer.pad_id, opts.eval_batch_size)
        return task.score(data, outputs, labels)

    return evaluate


def best_metric(opts: FinetuneOptions, labels: task_data.LabelSet | None) -> str:
    """The dev score that picks the kept model: --best-metric, else the task's headline."""
    best = opts.best_metric or task_class(opts.task).best_metric
    if best == "mcc" and labels is not None and labels.num_labels != 2:
        raise AttnlabError(
            f"best_metric mcc needs two classes; these data have {labels.num_labels}",
            options=("best_metric",),
        )
    return best


def train_config(opts: FinetuneOptions, per_epoch: int, best: str | None) -> TrainConfig:
    """The trainer's settings: AdamW, warm-up then linear decay, a dev score each epoch."""
    steps = opts.steps if opts.steps is not None else opts.epochs * per_epoch
    return TrainConfig(
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
        best_metric=best,
        max_seconds=opts.max_seconds,
        job={"train": str(opts.train), "dev": str(opts.dev), "batch_size": opts.batch_size},
    )


def build_run(opts: FinetuneOptions) -> FinetuneRun:
    """Read and check the data and the model of checked options (check_options); write nothing."""
    tokenizer = load_tokenizer(opts.model)
    task = task_class(opts.task).for_training(opts)
    check_model_fits(task, opts.model)
    train = task.read_training(opts.train)
    labels = task.label_set(train, opts.train)
    torch.manual_seed(opts.seed)  # a fresh head's initial weights are part of the run
    pooling = defaults.choose_pooling(opts)  # before the model: it decides the head's input
    model, labels, fresh = initial_model(opts, labels)
    train_data = task.featurise(tokenizer, train, labels, opts.train)
    evaluate = dev_evaluation(opts, task, tokenizer, labels)
    rows = len(train_data.rows)  # lr, batch size, epochs, warm-up: for this model and data
    choices = defaults.choose(opts, model.bert.config.d_model, rows, lambda b: rows // b)
    choices += [pooling] if pooling is not None else []
    batches = LengthGroupedBatches(train_data.rows, opts.batch_size, tokenizer.pad_id, opts.seed)
    best = best_metric(opts, labels)
    config = train_config(opts, batches.batches_per_epoch, best if evaluate else None)
    for choice in choices:  # once every setting has passed its checks
        say(choice.line())
    return FinetuneRun(
        model, tokenizer, task, labels, batches, config, evaluate, fresh, len(train_data.examples)
    )


def prepare(opts: FinetuneOptions) -> FinetuneRun:
    """Read and check data, model and options; nothing is written (opts get the defaults)."""
    check_options(opts)
    return build_run(opts)


def names_of(labels: task_data.LabelSet | None) -> list[str] | None:
    """Class names in id order (None for regression and qa)."""
    return labels.names if labels is not None and labels.kind == "classes" else None


def save_model(run: FinetuneRun, opts: FinetuneOptions, model: nn.Module, where: Path) -> None:
    """The model in where as an HF checkpoint, with the tokenizer and the data settings."""
    names = run.task.head_names(run.labels)
    settings = json.dumps(opts.data_settings().to_dict(), indent=2, ensure_ascii=False) + "\n"
    save_task_model(model, where, run.tokenizer, names, {SETTINGS_FILE: settings}, overwrite=True)


def results_of(run: FinetuneRun, opts: FinetuneOptions, summary: dict[str, Any]) -> dict:
    """results.json: the kept model's step, epoch and dev scores, the last step's, the data."""
    per_epoch = run.batches.batches_per_epoch
    best = summary.get("best")
    return {
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


class FinetuneJob(Job):
    """A fine-tuning run's steps, in the order ``run_job`` calls them (tasks/job.py)."""

    def __init__(self, opts: FinetuneOptions) -> None:
        self.opts = opts
        self.run: FinetuneRun

    @property
    def out(self) -> Path:
        """The run's --out."""
        return Path(self.opts.out)

    @property
    def stage(self) -> Path:
        """Where the best model so far is kept, to be published into --out."""
        return self.opts.out / BEST_DIR

    def check_out(self) -> None:
        """Check the options, and refuse an --out this run may not use."""
        check_options(self.opts)

    def prepare(self, world_size: int) -> None:
        """Read the data and build the model; the batches must split over the ranks."""
        self.run = build_run(self.opts)
        self.run.batches.set_rank(0, world_size)  # refused before --overwrite clears --out
        if self.run.fresh:
            fresh = " and ".join(self.run.fresh)
            say(f"{self.opts.model}: new randomly initialised {fresh} for {self.opts.task}")

    def start_out(self) -> None:
        """--overwrite: the old run goes as a whole, before anything is written."""
        if self.opts.overwrite:
            clear_dir(self.opts.out)

    def trainer(self) -> Trainer:
        """The shared trainer; with a dev set, each better dev score keeps its model."""
        run = self.run

        def keep(model: nn.Module, _: dict[str, float]) -> None:
            save_model(run, self.opts, model, self.stage)

        # without a dev set the last model is kept (publish)
        on_best = keep if run.evaluate else None
        model, speedups = fast.for_training(run.model), fast.TrainingSpeedups()
        return Trainer(
            model, run.batches, run.train_config, run.evaluate, on_best=on_best, speedups=speedups
        )

    def publish(self, trainer: Trainer, summary: dict[str, Any]) -> dict[str, Any]:
        """The kept model into --out, and results.json; the summary gets the results."""
        # No dev set, or no dev score that could pick a model (NaN at every evaluation, as
        # for a correlation of equal scores): the model kept is the last one.
        if not summary.get("best"):
            save_model(self.run, self.opts, self.run.model.eval(), self.stage)
        results = results_of(self.run, self.opts, summary)
        if self.stage.is_dir():
            publish_dir(self.stage, self.opts.out)
        text = json.dumps(json_safe(results), indent=2, allow_nan=False)  # NaN: null
        write_text_atomic(self.opts.out / RESULTS_FILE, text + "\n")
        summary["results"] = results
        return summary


def finetune(opts: FinetuneOptions) -> dict[str, Any]:
    """Fine-tune --model on --train (scoring --dev); the best model ends up in --out."""
    # The run fills in defaults: it gets a copy, and the caller's options stay as given
    return run_job(FinetuneJob(dataclasses.replace(opts)))
