"""The fine-tuning tasks by name: ``--task NAME`` picks the class (figure 4's four shapes)."""

from __future__ import annotations

from attnlab.errors import AttnlabError

from .ner import NerTask
from .qa import QATask
from .settings import DataSettings
from .table import ClassifyTask, RegressTask
from .task import FinetuneTask

TASKS: dict[str, type[FinetuneTask]] = {
    task.name: task for task in (ClassifyTask, RegressTask, NerTask, QATask)
}


def task_class(name: str) -> type[FinetuneTask]:
    """The class of the task called name."""
    if name not in TASKS:
        raise AttnlabError(f"unknown task {name!r} (choose from {', '.join(TASKS)})")
    return TASKS[name]


def task_for(settings: DataSettings) -> FinetuneTask:
    """The task that settings name, reading and featurising files by them (to score, predict)."""
    return task_class(settings.task)(settings)
