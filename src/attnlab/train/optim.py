"""Optimisers and learning-rate schedules of the papers.

BERT (Devlin et al. 2019, appendix A.2): AdamW, beta1=0.9, beta2=0.999, weight decay 0.01
except on biases and LayerNorm weights, linear warm-up then linear decay to 0.
Transformer (Vaswani et al. 2017, section 5.3): Adam, beta1=0.9, beta2=0.98, eps=1e-9, and
``lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)``.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from attnlab.errors import AttnlabError

# kind -> (weight_decay, betas, eps): the paper's values when the caller gives none.
OPTIMIZER_DEFAULTS: dict[str, tuple[float, tuple[float, float], float]] = {
    "adamw": (0.01, (0.9, 0.999), 1e-6),  # BERT
    "adam": (0.0, (0.9, 0.98), 1e-9),  # Transformer
}
SCHEDULES = ("linear", "inverse_sqrt", "constant")


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split parameters into a decayed group (matrices) and an undecayed one (biases, LayerNorm).

    BERT (and HF's Trainer) exclude parameters whose name contains "bias" or "LayerNorm". On
    attnlab models the LayerNorm weights and the biases of linear layers are the 1-D
    parameters; the one 2-D bias is the relative position-bias table (``positions.bias``,
    an embedding of per-head biases added to the attention scores), excluded by its name as
    those rules do. Embedding matrices are 2-D and decayed, as in BERT.
    ``named_parameters`` yields a tied tensor once.
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 and "bias" not in name else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(
    model: nn.Module,
    lr: float,
    weight_decay: float | None = None,
    betas: tuple[float, float] | None = None,
    eps: float | None = None,
    kind: str = "adamw",
    fused: bool = True,
) -> torch.optim.Optimizer:
    """AdamW (BERT) or Adam (Transformer) over the model's parameters; None = the paper's value.

    PyTorch's fused kernel is the default: one pass over each parameter instead of the
    multi-tensor (``foreach``) path's eight or so, several times faster on CPU, which matters
    where steps are short (fine-tuning). It
    rounds differently from the plain loop (about 1 ulp); ``fused=False`` gives the
    bit-identical ``foreach`` path. HF's Trainer also defaults to the fused kernel.
    """
    if kind not in OPTIMIZER_DEFAULTS:
        raise AttnlabError(f"optimizer must be one of {sorted(OPTIMIZER_DEFAULTS)}, got {kind!r}")
    default_wd, default_betas, default_eps = OPTIMIZER_DEFAULTS[kind]
    weight_decay = default_wd if weight_decay is None else weight_decay
    options = {
        "lr": lr,
        "betas": tuple(default_betas if betas is None else betas),
        "eps": default_eps if eps is None else eps,
        **({"fused": True} if fused else {"foreach": True}),
    }
    if kind == "adamw":
        return torch.optim.AdamW(decay_groups(model, weight_decay), **options)
    # Adam's weight_decay is an L2 term in the gradient, not decoupled decay; the paper uses none.
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.Adam(params, weight_decay=weight_decay, **options)


class Schedule:
    """The learning-rate factor of a named schedule at optimiser step ``step`` (LambdaLR's lambda).

    ``replan`` sets a warm-up (and a linear decay's last step) planned during the run: the
    trainer plans them from the steps a time limit allows (``planned_warmup``); ``redecay``
    moves a linear decay's last step, earlier or later, without a jump. LambdaLR saves
    a callable object's ``__dict__`` with the scheduler, and only the plan lives there (the
    configured values are slots): a resumed run keeps its plan, while its configured steps
    and warm-up come from the resumed run's own settings, as for a plain function.
    """

    __slots__ = ("__dict__", "d_model", "name", "total_steps", "warmup_steps")

    def __init__(
        self, name: str, warmup_steps: int, total_steps: int, d_model: int | None = None
    ) -> None:
        if name not in SCHEDULES:
            raise AttnlabError(f"schedule must be one of {list(SCHEDULES)}, got {name!r}")
        if name == "inverse_sqrt" and warmup_steps < 1:
            raise AttnlabError(f"inverse_sqrt needs warmup_steps >= 1, got {warmup_steps}")
        self.name, self.warmup_steps, self.total_steps = name, warmup_steps, total_steps
        self.d_model = d_model
        self.plan: dict[str, float] = {}  # what replan set: saved and restored with the scheduler

    @property
    def warmup(self) -> int:
        """The warm-up in force: the planned one, else the configured one."""
        return self.plan.get("warmup_steps", self.warmup_steps)

    @property
    def total(self) -> int:
        """The last step of a linear decay in force: the planned one, else the configured one."""
        return self.plan.get("total_steps", self.total_steps)

    def replan(self, warmup_steps: int, total_steps: int) -> None:
        """Warm up for warmup_steps (>= 1) and end a linear decay at total_steps from now on."""
        self.plan = {"warmup_steps": max(1, warmup_steps), "total_steps": total_steps}

    def redecay(self, step: int, total_steps: int) -> None:
        """From step on, decay linearly from the factor in force at step to 0 at total_steps.

        A linear decay re-planned after its warm-up: the factor goes on from where it is (no
        jump), only its slope changes.
        """
        factor = self(step)
        self.plan = {"warmup_steps": self.warmup, "total_steps": total_steps,
                     "decay_from": step, "decay_factor": factor}  # fmt: skip

    def __call__(self, step: int) -> float:
        warmup, total = self.warmup, self.total
        if self.name == "inverse_sqrt":
            n = step + 1  # the paper counts steps from 1
            scale = self.d_model**-0.5 if self.d_model is not None else math.sqrt(warmup)
            return scale * min(n**-0.5, n * warmup**-1.5)
        if step < warmup:  # counted from 0, as HF's schedules: the first update runs at lr 0
            return step / warmup
        if self.name == "constant":
            return 1.0
        start = self.plan.get("decay_from")
        if start is not None and step >= start:
            return max(0.0, self.plan["decay_factor"] * (total - step) / max(1, total - start))
        return max(0.0, (total - step) / max(1, total - warmup))


def planned_warmup(steps: int, share: float, most: int) -> int:
    """The warm-up of a run that will make ``steps`` steps: ``share`` of them, at most ``most``.

    At least 1 step. The one rule every job's default warm-up follows (a translation run's
    10% of its steps, at most the paper's 4,000; pretraining's 10%; distillation's 5%): under a
    time limit, ``steps`` is what the clock allows (Trainer), not the run's nominal length.
    """
    return max(1, min(most, int(share * steps + 1e-9)))  # 0.1 * 30 is 3, not 2.999...


def linear_warmup_decay(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int
) -> LambdaLR:
    """BERT: lr * step/warmup while warming up, then lr * (total - step)/(total - warmup), floor 0.

    ``step`` counts optimiser steps from 0, as HF's ``get_linear_schedule_with_warmup`` does,
    so the first update runs at lr 0 when there is a warm-up.
    """
    return LambdaLR(optimizer, Schedule("linear", warmup_steps, total_steps))


def inverse_sqrt(
    optimizer: torch.optim.Optimizer, warmup_steps: int, d_model: int | None = None
) -> LambdaLR:
    """Transformer: lr * min(n^-0.5, n * warmup^-1.5) with n = step + 1 (the paper counts from 1).

    Scaled by warmup^0.5 so the peak (at n = warmup) is exactly lr; with ``d_model`` the
    paper's d_model^-0.5 is used instead, and lr = 1 gives the paper's lrate.
    """
    return LambdaLR(optimizer, Schedule("inverse_sqrt", warmup_steps, 0, d_model))


def constant(optimizer: torch.optim.Optimizer, warmup_steps: int = 0) -> LambdaLR:
    """lr after a linear warm-up of warmup_steps (counted from 0 as in linear_warmup_decay)."""
    return LambdaLR(optimizer, Schedule("constant", warmup_steps, 0))


def build_scheduler(
    name: str, optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int
) -> LambdaLR:
    """The schedule called name ("linear", "inverse_sqrt" or "constant"); its lambda a Schedule."""
    return LambdaLR(optimizer, Schedule(name, warmup_steps, total_steps))


def schedule_of(scheduler: torch.optim.lr_scheduler.LRScheduler) -> Schedule | None:
    """The Schedule a scheduler made here follows (one for every parameter group), else None."""
    factors = getattr(scheduler, "lr_lambdas", [])
    first = factors[0] if factors else None
    shared = isinstance(first, Schedule) and all(f is first for f in factors)
    return first if shared else None
