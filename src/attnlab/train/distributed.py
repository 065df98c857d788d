"""torch.distributed plumbing for data-parallel training under torchrun.

One process per device; torchrun sets RANK, WORLD_SIZE and LOCAL_RANK (and the rendezvous
address). Gradients are averaged by DistributedDataParallel; these helpers cover the rest:
start-up, averaging logged values, gathering per-rank RNG states, barriers.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def is_distributed() -> bool:
    """True when a process group is up."""
    return dist.is_available() and dist.is_initialized()


def init_distributed() -> tuple[int, int, int]:
    """(rank, world_size, local_rank): joins the torchrun process group when WORLD_SIZE > 1.

    Backend "nccl" when CUDA is available (each process then owns cuda:LOCAL_RANK), else
    "gloo". Idempotent; without torchrun's variables it returns (0, 1, 0).
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if is_distributed():
        return dist.get_rank(), dist.get_world_size(), local_rank
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return 0, 1, 0
    end_with_launcher()
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), local_rank


_PR_SET_PDEATHSIG = 1  # prctl option of <linux/prctl.h>


def end_with_launcher() -> None:
    """Under torchrun on Linux: have the kernel SIGKILL this worker when its launcher dies.

    torchrun starts each worker in a session of its own, so a SIGKILL of the launcher (or of
    its process group) does not reach them: they would train on, orphaned, beside the run a
    --resume starts in the same --out. SIGKILL is what the launcher would escalate to; a
    worker must not outlive it. (The kernel watches the thread that started the worker:
    torchrun's main thread.) Workers still importing when it dies are missed: they write
    nothing, and wait at the rendezvous until its timeout.
    """
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return  # not torchrun's worker: its parent may be a shell that exits on purpose
    launcher = os.getppid()
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != launcher:  # it died before the kernel was told
        os.kill(os.getpid(), signal.SIGKILL)


def shutdown_distributed() -> None:
    """Leave the process group, if one is up."""
    if is_distributed():
        dist.destroy_process_group()


def barrier() -> None:
    """Wait for every rank (a no-op in a single process)."""
    if is_distributed():
        dist.barrier()


def all_reduce_sum(tensor: Tensor) -> Tensor:
    """Sum of tensor over ranks (in place; the tensor itself in a single process)."""
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's obj, indexed by rank (a one-element list in a single process)."""
    if not is_distributed():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def raise_together(failure: Exception | None) -> None:
    """Re-raise a failure of one rank on every rank, so no rank waits at a barrier forever."""
    flag = torch.tensor([0 if failure is None else 1])
    if is_distributed() and dist.get_backend() == "nccl":
        flag = flag.cuda()  # NCCL reduces CUDA tensors only (init_distributed set the device)
    if int(all_reduce_sum(flag)):
        if failure is not None:
            raise failure
        from attnlab.errors import AttnlabError

        raise AttnlabError("another rank could not prepare the run (see its message)")
