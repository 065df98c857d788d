"""The lifecycle every training job shares: prepare on rank 0, fail together, train, publish.

pretrain, distill, translate and finetune differ in what they read, build and write; the
order of the steps, and which rank runs each, is written once here (``run_job``):

1. every rank holds --out (``hold_run_out``: no other run may write there) and checks it
   (``Job.check_out``);
2. rank 0 alone reads and checks everything and builds the model (``Job.prepare``), writing
   nothing; an ``AttnlabError`` there is raised on every rank (``raise_together``), so no
   rank waits at a barrier for it;
3. rank 0 starts --out (``Job.start_out``: clear the old run of --overwrite, write the files
   the other ranks read), then every rank meets at a barrier;
4. the other ranks build the same run (``Job.follow``), reading what rank 0 wrote;
5. every rank trains (``Job.trainer().fit()``);
6. rank 0 publishes the result (``Job.publish``, each file by an atomic rename: ``publish``);
   every rank meets at a barrier and leaves the process group.

A job subclasses ``Job``, keeps its options in ``opts`` (``opts.out`` is --out) and what one
step builds (data, model) on ``self`` for the next, and runs with ``run_job(job)``, which
returns the trainer's summary as ``Job.publish`` left it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from attnlab.errors import AttnlabError
from attnlab.train.distributed import (
    barrier,
    init_distributed,
    raise_together,
    shutdown_distributed,
)
from attnlab.train.trainer import Trainer, hold_run_out


class Job:
    """One training job's steps, called by ``run_job`` in the order of this module's docstring.

    Subclasses set ``opts`` (the job's options; ``opts.out`` is the run's --out) and fill in
    the hooks; ``prepare`` and ``trainer`` are required, the others default to doing nothing
    (``follow``: to ``prepare``).
    """

    opts: Any

    def check_out(self) -> None:
        """Every rank, --out held: refuse an --out this run may not use (``AttnlabError``)."""

    def prepare(self, world_size: int) -> None:
        """Rank 0: read and check the data and options, build the model; write nothing.

        Check here that the batches split over ``world_size`` ranks (``set_rank(0, world_size)``),
        so a bad split is refused before --overwrite clears --out.
        """
        raise NotImplementedError

    def start_out(self) -> None:
        """Rank 0, once prepare succeeded: clear --overwrite's old run, write what others read."""

    def follow(self) -> None:
        """Ranks other than 0, after ``start_out``: build the same run as rank 0's prepare."""
        self.prepare(world_size=1)

    def trainer(self) -> Trainer:
        """Every rank: the trainer of the prepared model and data."""
        raise NotImplementedError

    def publish(self, trainer: Trainer, summary: dict[str, Any]) -> dict[str, Any]:
        """Rank 0, after training: write the result into --out; returns the (extended) summary."""
        return summary


def run_job(job: Job) -> dict[str, Any]:
    """Run a training job on this process's rank (torchrun or one process); the fit's summary."""
    rank, world_size, _ = init_distributed()
    with hold_run_out(job.opts.out, rank):  # no other run writes to --out until this one ends
        job.check_out()  # on every rank, before any rank writes
        failure: AttnlabError | None = None
        if rank == 0:
            try:
                job.prepare(world_size)
            except AttnlabError as err:
                failure = err
        raise_together(failure)
        if rank == 0:
            job.start_out()
        barrier()
        if rank != 0:
            job.follow()
        trainer = job.trainer()
        summary = trainer.fit()
        if rank == 0:
            summary = job.publish(trainer, summary)
        trainer.release_network()  # DDP's reducer goes while the process group lives
        barrier()
        shutdown_distributed()
    return summary


def publish(stage: Path, out: Path) -> None:
    """Move a saved model's files from stage into out (each an atomic rename), then remove stage.

    The finished model's files replace any earlier ones in out/, so out/ is a model directory
    (config.json, model.safetensors, vocabulary files) at every moment.
    """
    for item in stage.iterdir():
        os.replace(item, out / item.name)
    stage.rmdir()
