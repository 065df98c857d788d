"""SIGKILL a training job at chosen moments, to prove that a resumed run loses nothing.

Hooks, installed in the process to be killed: ``kill_at_batch(K)`` kills it as the trainer
reads its K-th batch (in the middle of an optimiser step), whatever the job's batch source;
``kill_in_save(N)`` once the checkpoint of step N has written trainer.pt into its temp
directory, before the rename that publishes it; ``kill_in_prune(N)`` once the checkpoint of
step N is published, before the older ones beyond --keep-last are deleted;
``kill_launcher_at_batch(K)`` SIGKILLs torchrun's launcher instead, and the worker goes
on. ``forked`` runs a job in a forked child with them (a real process to kill, without importing
torch again).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from attnlab.cli import main
from attnlab.train import trainer


def kill() -> None:
    """SIGKILL this process: no cleanup, no finally blocks."""
    os.kill(os.getpid(), signal.SIGKILL)


class _Killing:
    """A batch source that calls action() (by default: SIGKILL its process) as it hands out
    its kill_at-th batch."""

    def __init__(self, source: Any, kill_at: int, action: Callable[[], None] | None) -> None:
        self.source, self.kill_at, self.action = source, kill_at, action or kill

    def __iter__(self) -> Iterator[Any]:
        for count, batch in enumerate(self.source, start=1):
            if count == self.kill_at:
                self.action()
            yield batch

    def __getattr__(self, name: str) -> Any:  # state_dict, set_rank, tokens_in...
        return getattr(self.source, name)


def kill_at_batch(count: int, action: Callable[[], None] | None = None) -> None:
    """SIGKILL as the trainer reads its count-th batch (of this process), or call action()."""
    real_init = trainer.Trainer.__init__

    def init(self: trainer.Trainer, model: Any, batches: Any, *args: Any, **kwargs: Any) -> None:
        real_init(self, model, _Killing(batches, count, action), *args, **kwargs)

    trainer.Trainer.__init__ = init


def kill_launcher_at_batch(count: int) -> None:
    """SIGKILL torchrun's launcher (this worker's parent) as the trainer reads its count-th
    batch; the worker itself goes on."""
    launcher = os.getppid()
    kill_at_batch(count, lambda: os.kill(launcher, signal.SIGKILL))


def running(pid: int) -> bool:
    """Whether process pid runs (a zombie, dead but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # the state follows the command's name


def kill_in_save(step: int) -> None:
    """SIGKILL right after trainer.pt of step's checkpoint is written to its temp directory."""
    real_save = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        real_save(obj, f, *args, **kwargs)
        # f is a buffer when torch.distributed pickles a tensor (all_gather_object)
        path = Path(f) if isinstance(f, (str, os.PathLike)) else None
        if path and path.name == "trainer.pt" and path.parent.name.startswith(f".step-{step}."):
            kill()

    torch.save = save


def kill_in_prune(step: int) -> None:
    """SIGKILL once the checkpoint of step is in place, before older ones are pruned."""
    real_prune = trainer.prune_checkpoints

    def prune(root: Path, keep_last: int) -> None:
        if (root / f"step-{step}").is_dir():
            kill()
        real_prune(root, keep_last)

    trainer.prune_checkpoints = prune


HOOKS = {
    "kill_at_batch": kill_at_batch,
    "kill_in_save": kill_in_save,
    "kill_in_prune": kill_in_prune,
}


def forked(job: Callable[[], Any], **kills: int | None) -> multiprocessing.Process:
    """Start job() in a forked child with one thread; its exit code is job's (0 if not an int).

    kills: kill_at_batch, kill_in_save and kill_in_prune, each given a number or None.
    """
    unknown = set(kills) - set(HOOKS)
    if unknown:
        raise TypeError(f"no hook {', '.join(sorted(unknown))}")

    def child() -> None:
        torch.set_num_threads(1)  # the same reduction order in every run; fork-safe OpenMP
        for name, at in kills.items():
            if at is not None:
                HOOKS[name](at)
        result = job()
        raise SystemExit(result if isinstance(result, int) else 0)

    # Imported once here, not in every child: torch.optim's first use and the loss plot.
    import matplotlib.backends.backend_agg  # noqa: F401
    import torch._dynamo

    process = multiprocessing.get_context("fork").Process(target=child)
    process.start()
    return process


def forked_cli(args: Sequence[object], **kills: int | None) -> multiprocessing.Process:
    """`attnlab ARGS` in a forked child (see forked); its exit code is the command's."""
    return forked(lambda: main([str(a) for a in args]), **kills)


def exit_code(process: multiprocessing.Process) -> int | None:
    """The child's exit code (-9 for SIGKILL); None, and the child ended, if it hung."""
    process.join(timeout=120)
    if process.is_alive():  # hung: end it so the test fails instead of hanging
        process.kill()
        process.join()
        return None
    return process.exitcode
