"""A fine-tuned model at work: load it with its settings, run it, score a file, predict.

``load_finetuned`` reads a checkpoint saved by ``attnlab finetune`` (or an HF one with a
task head) with the data settings it was trained with; ``evaluate_file`` and
``predict_file`` are the CLI's evaluate and predict.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnlab import fast
from attnlab.config import check_types
from attnlab.errors import AttnlabError
from attnlab.interop.hf import checkpoint_task, load_task_model, read_config
from attnlab.io import check_output_file, write_text_atomic
from attnlab.nn.mode import eval_mode
from attnlab.progress import progress_bar
from attnlab.text import tasks as task_data
from attnlab.text.tokenizer import BertTokenizer

from .batches import collate
from .options import FinetuneOptions
from .registry import task_class, task_for
from .settings import DataSettings
from .task import FinetuneTask, Outputs, TaskData

SETTINGS_FILE = "finetune.json"  # the task and data settings evaluate/predict default to
TOKEN_OUTPUTS = ("start_logits", "end_logits")
EVAL_BATCH_SIZE = FinetuneOptions.eval_batch_size


@torch.no_grad()
def run_model(
    model: nn.Module,
    rows: Sequence[dict[str, Any]],
    pad_id: int,
    batch_size: int = EVAL_BATCH_SIZE,
    progress: Callable[[int], None] | None = None,
) -> Outputs:
    """The model's outputs for every row, in row order; token outputs cut to the row's length.

    Rows are run longest first in batches of similar length, so padding stays small;
    progress(n) is told of each n rows done.
    """
    if batch_size < 1:
        raise AttnlabError(
            f"batch_size must be at least 1, got {batch_size}", options=("batch_size",)
        )
    device = next(model.parameters()).device
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["input_ids"]), reverse=True)
    results: Outputs = [{} for _ in rows]
    with eval_mode(model), fast.inference_twins(model):  # no dropout; fast inference
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
            if progress is not None:
                progress(len(index))
    return results


def device() -> torch.device:
    """Where models run: the GPU when there is one."""
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


def check_model_fits(task: FinetuneTask, model_dir: Path) -> None:
    """Refuse a --max-length beyond the model's positions, and text pairs it has no segment for."""
    config = read_config(model_dir)
    if task.reads_pairs and config.type_vocab_size < 2:  # segment id 1 has no embedding
        raise AttnlabError(
            f"{model_dir} has one token type (type_vocab_size 1): it cannot tell the two texts "
            f"of a pair apart, which task {task.name!r} with these settings needs"
        )
    max_length = task.settings.max_length
    limit = config.max_positions
    if max_length > limit:
        raise AttnlabError(
            f"max_length {max_length} is above the model's maximum ({limit})",
            options=("max_length",),
        )
    if max_length < 8:
        raise AttnlabError("max_length must be at least 8", options=("max_length",))


@dataclass
class FinetunedModel:
    """A fine-tuned checkpoint ready for inference: model, tokenizer, labels, its task."""

    model: nn.Module
    tokenizer: BertTokenizer
    labels: task_data.LabelSet | None
    task: FinetuneTask  # reads and featurises files by the model's data settings

    @property
    def settings(self) -> DataSettings:
        """The data settings files are read by."""
        return self.task.settings

    def predict(
        self, inputs: Sequence[Any], batch_size: int = EVAL_BATCH_SIZE
    ) -> list[dict[str, Any]]:
        """One prediction per input, in order, as predict_file's rows.

        classify / regress: a text or a (text, pair) tuple, giving {"label", "probabilities"}
        or {"score"}; ner: a list of words (or a text, split at spaces), giving {"words",
        "tags"}; qa: a (question, context) tuple, giving {"id", "answer"}.
        """
        examples = [self.task.python_example(item, i) for i, item in enumerate(inputs)]
        if not examples:
            return []
        data, outputs = self.run(examples, Path("<inputs>"), batch_size)
        return self.task.prediction_rows(data, outputs, self.labels)

    def run(
        self,
        examples: list,
        source: Path,
        batch_size: int,
        labels: task_data.LabelSet | None = None,
        progress: bool | None = False,
    ) -> tuple[TaskData, Outputs]:
        """The examples' model rows (with targets when labels is given) and the model's outputs.

        progress: a bar on stderr over the rows (None: on a terminal or a long input).
        """
        data = self.task.featurise(self.tokenizer, examples, labels, source)
        with progress_bar(len(data.rows), "row", progress) as advance:
            outputs = run_model(self.model, data.rows, self.tokenizer.pad_id, batch_size, advance)
        return data, outputs


def read_settings(model_dir: Path, saved_task: str | None) -> DataSettings:
    """The data settings saved with a model (defaults without a finetune.json, as from HF)."""
    settings_file = model_dir / SETTINGS_FILE
    settings = DataSettings(task=saved_task)
    if not settings_file.is_file():
        return settings
    try:
        saved = json.loads(settings_file.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as err:  # also too deep, or an integer too long
        raise AttnlabError(f"{settings_file}: not valid JSON ({err})") from None
    if not isinstance(saved, dict):
        raise AttnlabError(f"{settings_file}: expected a JSON object of settings")
    saved = {k: v for k, v in saved.items() if k in DataSettings.names()}
    check_types(DataSettings, saved, str(settings_file))
    if saved.get("task", saved_task) != saved_task:  # config.json's head decides
        raise AttnlabError(
            f"{settings_file} says task {saved['task']!r} but the model's head is for "
            f"{saved_task!r}: the two files are from different models"
        )
    return dataclasses.replace(settings, **saved)


def with_overrides(settings: DataSettings, overrides: dict[str, Any] | None) -> DataSettings:
    """settings with the given data settings changed (None: not given), checked."""
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    unknown = set(overrides) - set(DataSettings.overridable())
    if unknown:
        raise AttnlabError(
            f"overrides: no data setting {', '.join(sorted(unknown))} (the task is the model's; "
            f"choose from {', '.join(DataSettings.overridable())})"
        )
    check_types(DataSettings, overrides, "overrides")
    settings = dataclasses.replace(settings, **overrides)
    settings.check()
    if settings.max_length is None:
        settings.max_length = task_class(settings.task).default_max_length
    return settings


def load_finetuned(
    model_dir: str | Path, task: str | None = None, overrides: dict[str, Any] | None = None
) -> FinetunedModel:
    """Load a fine-tuned checkpoint (attnlab's or HF's) with the settings it was trained with."""
    model_dir = Path(model_dir)
    saved_task = checkpoint_task(model_dir)
    settings = read_settings(model_dir, saved_task)
    if saved_task is None:
        raise AttnlabError(
            f"{model_dir} holds no fine-tuned head (config.json architectures): "
            "fine-tune it first with attnlab finetune"
        )
    if task is not None and task != saved_task:
        raise AttnlabError(
            f"{model_dir} is a {saved_task!r} model: it cannot be used for task {task!r}"
        )
    finetuned = task_for(with_overrides(settings, overrides))
    check_model_fits(finetuned, model_dir)
    tokenizer = load_tokenizer(model_dir)
    model, fresh = load_task_model(model_dir, saved_task)
    if fresh:
        raise AttnlabError(f"{model_dir} lacks trained weights for its {', '.join(fresh)}")
    labels = finetuned.checkpoint_labels(model_dir, model)
    return FinetunedModel(model.to(device()).eval(), tokenizer, labels, finetuned)


def evaluate_file(
    model_dir: str | Path,
    data: str | Path,
    task: str | None = None,
    overrides: dict[str, Any] | None = None,
    batch_size: int = EVAL_BATCH_SIZE,
    progress: bool | None = False,
) -> dict[str, float]:
    """The task's metrics of a fine-tuned model on a labelled file (progress: as FinetunedModel.run)."""
    loaded = load_finetuned(model_dir, task, overrides)
    path = Path(data)
    examples = loaded.task.read(path, labelled=True)
    loaded.task.check_scorable(examples, path)
    features, outputs = loaded.run(examples, path, batch_size, loaded.labels, progress)
    return loaded.task.score(features, outputs, loaded.labels)


def predict_file(
    model_dir: str | Path,
    input_path: str | Path,
    output_path: str | Path,
    task: str | None = None,
    overrides: dict[str, Any] | None = None,
    overwrite: bool = False,
    batch_size: int = EVAL_BATCH_SIZE,
    progress: bool | None = False,
) -> int:
    """Write predictions for an (unlabelled) input file; returns how many examples.

    progress: as FinetunedModel.run.
    """
    output = check_output_file(output_path, overwrite, inputs=[input_path, model_dir])
    loaded = load_finetuned(model_dir, task, overrides)
    path = Path(input_path)
    examples = loaded.task.read(path, labelled=False)
    data, outputs = loaded.run(examples, path, batch_size, progress=progress)
    rows = loaded.task.prediction_rows(data, outputs, loaded.labels)
    write_text_atomic(output, loaded.task.prediction_text(rows, output))
    return len(examples)
