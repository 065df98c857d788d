"""The one trainer: optimiser groups, schedules, bf16, accumulation, atomic checkpoints + resume, DDP."""

from attnlab.train.checkpoint import latest_checkpoint, read_checkpoint, save_checkpoint
from attnlab.train.config import TrainConfig, seed_everything
from attnlab.train.data import BatchSource, TensorBatches, count_tokens
from attnlab.train.distributed import init_distributed, shutdown_distributed
from attnlab.train.hooks import TrainerHooks
from attnlab.train.log import plot_loss_curve, read_rows
from attnlab.train.optim import (
    build_optimizer,
    build_scheduler,
    constant,
    decay_groups,
    inverse_sqrt,
    linear_warmup_decay,
)
from attnlab.train.trainer import Trainer

__all__ = [
    "BatchSource",
    "TensorBatches",
    "TrainConfig",
    "Trainer",
    "TrainerHooks",
    "build_optimizer",
    "build_scheduler",
    "constant",
    "count_tokens",
    "decay_groups",
    "init_distributed",
    "inverse_sqrt",
    "latest_checkpoint",
    "linear_warmup_decay",
    "plot_loss_curve",
    "read_checkpoint",
    "read_rows",
    "save_checkpoint",
    "seed_everything",
    "shutdown_distributed",
]
