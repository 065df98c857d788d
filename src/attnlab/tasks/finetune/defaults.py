"""The defaults of a fine-tuning run that depend on the checkpoint and the data, with reasons.

BERT's recipe (lr 3e-5, batch 32, 3 epochs; Devlin et al. 2019, appendix A.3) was tuned for
BERT-base on GLUE-sized sets. Smaller models prefer larger rates (Turc et al. 2019, "Well-Read
Students Learn Better", swept 1e-4..3e-5 for their compact BERTs), and a small training set cut
into batches of 32 gives too few optimiser steps to learn in. FinetuneOptions leaves lr,
batch_size, epochs and warmup_ratio as None; ``choose`` fills in each one left so, and says
why. A classifier's pooling follows the checkpoint (``choose_pooling``): the mean of the token
states for a sentence-transformers model trained so, else BERT's [CLS] pooler.
docs/finetuning.md shows the same table.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from attnlab.errors import AttnlabError
from attnlab.interop.hf import checkpoint_pooling, checkpoint_task

# (largest hidden size, learning rate): the first row whose size fits the model's
LR_BY_WIDTH = ((512, 1e-4), (768, 3e-5), (math.inf, 2e-5))
BATCH_SIZES = (32, 16, 8)  # the largest giving STEPS_PER_EPOCH a pass, else the smallest
STEPS_PER_EPOCH = 500
EPOCHS = 3  # BERT's
MIN_STEPS = 1000  # a small set gets more epochs, up to MAX_EPOCHS, to reach this many steps
MAX_EPOCHS = 10
WARMUP_RATIO = 0.1  # BERT's and Turc et al.'s


@dataclass
class Choice:
    """One setting of a run, as used: its value and why it has it."""

    name: str
    value: float | int | str
    reason: str

    def line(self) -> str:
        """How the run prints it: 'lr 1e-04 (default for hidden size 384)'."""
        shown = self.value if isinstance(self.value, str) else f"{self.value:g}"
        if self.name == "lr":  # 1e-4, 2.5e-5: as papers write rates
            mantissa, exponent = f"{self.value:e}".split("e")
            shown = f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
        return f"{self.name} {shown} ({self.reason})"


def default_lr(hidden_size: int) -> float:
    """The learning rate of LR_BY_WIDTH for a model of this hidden size."""
    return next(lr for width, lr in LR_BY_WIDTH if hidden_size <= width)


def default_batch_size(examples: int) -> int:
    """The largest of BATCH_SIZES with STEPS_PER_EPOCH steps an epoch, at most the examples."""
    size = next((b for b in BATCH_SIZES if examples // b >= STEPS_PER_EPOCH), BATCH_SIZES[-1])
    return max(1, min(size, examples))


def default_epochs(per_epoch: int) -> int:
    """EPOCHS, or more (at most MAX_EPOCHS) where that many make fewer than MIN_STEPS steps."""
    return min(MAX_EPOCHS, max(EPOCHS, math.ceil(MIN_STEPS / max(per_epoch, 1))))


def choose(
    opts: object, hidden_size: int, examples: int, per_epoch: Callable[[int], int]
) -> list[Choice]:
    """Fill in opts' lr, batch_size, epochs and warmup_ratio left None; each with its reason.

    examples: training rows (features); per_epoch(batch_size): optimiser steps in an epoch.
    A value given (a flag, a --config key, a Python argument) is kept and said to be given.
    """
    choices = []

    def setting(name: str, default: Callable[[], tuple[float | int, str]]) -> None:
        value = getattr(opts, name)
        if value is None:
            value, reason = default()
            setattr(opts, name, value)
        else:
            reason = "given"
        choices.append(Choice(name, value, reason))

    setting("lr", lambda: (default_lr(hidden_size), f"default for hidden size {hidden_size}"))
    setting(
        "batch_size",
        lambda: (
            default_batch_size(examples),
            f"default for {examples} training examples: "
            f"{per_epoch(default_batch_size(examples))} steps an epoch",
        ),
    )
    if getattr(opts, "steps", None) is None:
        steps = per_epoch(opts.batch_size)
        setting("epochs", lambda: (default_epochs(steps), f"default: {steps} steps an epoch"))
    setting("warmup_ratio", lambda: (WARMUP_RATIO, "default: BERT's share of the steps"))
    return choices


def sentence_pooling(model_dir: Path) -> str | None:
    """ "mean" for a sentence-transformers folder whose Pooling module takes the mean alone.

    modules.json names the Pooling module's folder (1_Pooling in those the library saves);
    its config.json says which pooling_mode_* the checkpoint was trained with.
    """
    modules_file = Path(model_dir) / "modules.json"
    modules = _read_json(modules_file, list) if modules_file.is_file() else []
    pooling = [
        m for m in modules if isinstance(m, dict) and str(m.get("type")).endswith(".Pooling")
    ]
    if not pooling:
        return None
    config_file = Path(model_dir) / str(pooling[0].get("path", "")) / "config.json"
    modes = _read_json(config_file, dict) if config_file.is_file() else {}
    chosen = [key for key, on in modes.items() if key.startswith("pooling_mode_") and on is True]
    return "mean" if chosen == ["pooling_mode_mean_tokens"] else None


def _read_json(file: Path, kind: type) -> list | dict:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as err:
        raise AttnlabError(f"{file}: not valid JSON ({err})") from None
    if not isinstance(data, kind):
        raise AttnlabError(f"{file}: expected a JSON {'list' if kind is list else 'object'}")
    return data


def choose_pooling(opts: object) -> Choice | None:
    """Fill in opts.pooling left None for a classify or regress run; None for other tasks.

    A fine-tuned head kept from --model keeps its pooling; a sentence-transformers
    checkpoint pooled by the mean gets mean; anything else BERT's [CLS] pooler.
    """
    if opts.task not in ("classify", "regress"):
        return None
    if opts.pooling is not None:
        return Choice("pooling", opts.pooling, "given")
    if not opts.new_head and checkpoint_task(opts.model) == opts.task:
        opts.pooling = checkpoint_pooling(opts.model)
        reason = "the fine-tuned checkpoint's"
    elif sentence_pooling(opts.model) == "mean":
        opts.pooling, reason = "mean", "the checkpoint's sentence-transformers pooling"
    else:
        opts.pooling, reason = "cls", "default: BERT's [CLS] pooler"
    return Choice("pooling", opts.pooling, reason)
