"""Fine-tuning BERT on a downstream task (Devlin et al. 2019, section 4): data -> head -> trainer.

One recipe for the four task shapes of figure 4, one class each (``registry.TASKS``):
``classify`` (sentence or pair, [CLS]) and ``regress`` (pair similarity, STS-B) in
``table.py``, ``ner`` (BIO tags on each word's first sub-token) in ``ner.py``, ``qa``
(SQuAD start/end spans over strided windows) in ``qa.py``. The steps (``run.py``):

1. read the task file (``FinetuneTask.read_training``), take the label set from it;
2. load the encoder (an attnlab or HF checkpoint) with the task's head (new, or the
   checkpoint's own when it was fine-tuned on the same labels);
3. featurise, then batch by length (``batches.py``): examples are shuffled, sorted by length
   inside chunks of ~64 batches, cut into batches padded only to their own longest row, and
   the batches are shuffled again;
4. train with the shared Trainer (AdamW, 10% warm-up + linear decay, the paper's 3 epochs
   at lr 3e-5 and batch 32: ``FinetuneOptions``), evaluating on --dev each epoch and keeping
   the best model;
5. publish the best model in --out as an HF-loadable checkpoint (config.json with
   architectures and id2label, the tokenizer, ``finetune.json`` with the data settings:
   ``DataSettings``) and ``results.json`` with the step, epoch and dev metrics of the kept
   model.

``inference.py`` loads such a model for ``attnlab evaluate`` and ``attnlab predict``.
"""

from .batches import LengthGroupedBatches, collate
from .inference import (
    SETTINGS_FILE,
    FinetunedModel,
    evaluate_file,
    load_finetuned,
    predict_file,
    run_model,
)
from .ner import NerTask
from .options import FinetuneOptions
from .qa import QATask
from .registry import TASKS, task_class, task_for
from .run import RESULTS_FILE, FinetuneJob, FinetuneRun, finetune, prepare
from .settings import DataSettings
from .table import ClassifyTask, RegressTask
from .task import FinetuneTask, TaskData

__all__ = [
    "RESULTS_FILE",
    "SETTINGS_FILE",
    "TASKS",
    "ClassifyTask",
    "DataSettings",
    "FinetuneJob",
    "FinetuneOptions",
    "FinetuneRun",
    "FinetuneTask",
    "FinetunedModel",
    "LengthGroupedBatches",
    "NerTask",
    "QATask",
    "RegressTask",
    "TaskData",
    "collate",
    "evaluate_file",
    "finetune",
    "load_finetuned",
    "predict_file",
    "prepare",
    "run_model",
    "task_class",
    "task_for",
]
