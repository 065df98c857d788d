"""Sharded data parallelism, ``TrainConfig.strategy="fsdp"``: torch's FSDP2 (``fully_shard``).

Each process keeps 1/world_size of every parameter, gradient and optimiser state and gathers
a layer's full weights only while that layer runs (ZeRO-3). The arithmetic is DDP's: every
rank's gradients are averaged before the step. What changes is everything that reads
the parameters as whole tensors, gathered here: checkpoints hold full tensors in the files a
DDP run writes (``model.safetensors``, an ``optimizer.state_dict()`` numbered by parameter),
and the trained model is whole again for publishing.
Every function that gathers or scatters is a collective: every rank must call it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from attnlab.train.checkpoint import tied_names
from attnlab.train.hooks import TrainerHooks

# Full tensors, gathered to rank 0's memory (the other ranks get {}): what rank 0 writes.
_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
_SCATTER = StateDictOptions(full_state_dict=True)  # every rank passes the full tensors


def shard_model(model: nn.Module) -> None:
    """fully_shard each layer of the model's stacks (every nn.ModuleList's items), then the model.

    A layer's weights are then gathered for its forward and backward only. Deepest first:
    fully_shard needs a module's sharded parts sharded before it.
    """
    for module in reversed(list(model.modules())):
        if isinstance(module, nn.ModuleList):
            for layer in module:
                if next(layer.parameters(), None) is not None:
                    fully_shard(layer)
    fully_shard(model)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Gradients accumulate unsynchronised (a micro-batch before the step's last): DDP's no_sync."""
    assert isinstance(model, FSDPModule)
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def clipped_step(
    optimizer: torch.optim.Optimizer, parameters: Iterable[Tensor], max_norm: float
) -> Tensor:
    """The plain clipped step (TrainerHooks) on sharded gradients; the total norm, which comes
    as a DTensor, as a plain tensor."""
    norm = TrainerHooks().clipped_step(optimizer, parameters, max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def gather_weights(model: nn.Module) -> dict[str, Tensor]:
    """The model's state dict with full tensors on rank 0's CPU ({} on the other ranks)."""
    return get_model_state_dict(model, options=_GATHER)


def load_weights(model: nn.Module, file: Path) -> list[str]:
    """Load a model.safetensors of full tensors into the sharded model; the names it lacked.

    Every rank reads the file and keeps its own shard. Names tied to another (stored once,
    as safetensors' save_model does) are filled from the one stored.
    """
    weights = load_file(str(file))
    for name, stored in tied_names(model).items():
        if stored in weights:
            weights.setdefault(name, weights[stored])
    ours = model.state_dict().keys()
    missing = [name for name in ours if name not in weights]
    set_model_state_dict(model, {k: v for k, v in weights.items() if k in ours}, options=_SCATTER)
    return missing


def gather_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """optimizer.state_dict() as one process holds it (parameters by number, full tensors): rank 0.

    torch gathers it keyed by parameter name; renumbered in the optimiser's order, it is the
    file a DDP run writes. The other ranks get {}.
    """
    state = get_optimizer_state_dict(model, optimizer, options=_GATHER)
    if not state:
        return {}
    numbers: dict[str, int] = {}
    groups = [
        {**group, "params": [numbers.setdefault(name, len(numbers)) for name in group["params"]]}
        for group in state["param_groups"]
    ]
    return {"state": {numbers[k]: v for k, v in state["state"].items()}, "param_groups": groups}


def load_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Load an optimizer.state_dict() of full tensors (gather_optimizer_state's, or DDP's)."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    names = [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
    if len(names) != sum(len(group["params"]) for group in state["param_groups"]):
        raise ValueError("the optimizer state has another number of parameters")
    groups = [
        {**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]
    ]
    by_name = {"state": {names[i]: v for i, v in state["state"].items()}, "param_groups": groups}
    set_optimizer_state_dict(model, optimizer, by_name, options=_SCATTER)
