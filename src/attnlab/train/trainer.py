"""The one training loop of attnlab: pretraining, fine-tuning and translation all run through it.

Per optimiser step: ``grad_accum`` micro-batches (each loss divided by grad_accum, DDP's
gradient all-reduce only on the last), gradient clipping, optimiser and schedule step.
Around it: seeding, bf16 autocast, a progress bar, ``metrics.jsonl``, periodic evaluation,
atomic checkpoints with exact resume, and torch.distributed data parallelism.

Exact resume means a run killed at any moment and resumed ends bit-identical to an
uninterrupted one (same thread count and device): the checkpoint holds weights, optimiser
and schedule state, every RNG state, the data position and the partial logging window.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from attnlab.errors import AttnlabError
from attnlab.io import (
    check_out_location,
    contents,
    lock_out_dir,
    remove_leftovers,
    remove_trash_of,
)
from attnlab.train import sharding
from attnlab.train.checkpoint import (
    capture_rng,
    latest_checkpoint,
    prune_checkpoints,
    read_checkpoint,
    remove_partial,
    restore_rng,
    save_checkpoint,
)
from attnlab.train.config import TrainConfig, seed_everything
from attnlab.train.data import Batch, BatchSource, count_tokens
from attnlab.train.distributed import (
    all_reduce_sum,
    barrier,
    gather_objects,
    init_distributed,
    raise_together,
)
from attnlab.train.hooks import TrainerHooks
from attnlab.train.log import METRICS_FILE, PLOT_FILE, MetricsLog, plot_loss_curve
from attnlab.train.optim import build_optimizer, build_scheduler, planned_warmup, schedule_of

CHECKPOINT_DIR = "checkpoints"
Evaluate = Callable[[nn.Module], dict[str, float]]
OnBest = Callable[[nn.Module, dict[str, float]], None]


# What a resumed run should share with its checkpoint (steps, logging and checkpointing may
# change: a run is often resumed to train longer).
RESUMED_SETTINGS = (
    "lr", "warmup", "schedule", "optimizer", "weight_decay", "betas", "eps", "grad_accum",
    "clip_norm", "precision", "seed",
)  # fmt: skip


def holds_run(out: Path) -> bool:
    """Whether out holds a training run's log or checkpoints (something --resume continues)."""
    return (out / METRICS_FILE).exists() or (out / CHECKPOINT_DIR).is_dir()


def check_run_out(
    out: Path,
    resume: bool,
    overwrite: bool,
    started: bool,
    job: str,
    inputs: Sequence[Path | None] = (),
) -> None:
    """Refuse an --out a training job may not use (pretrain, distill, finetune, translate).

    ``started``: out holds this job's files (a run, or a start killed early). A non-empty out
    needs --resume or --overwrite; --resume needs a started run or an empty out (the run then
    starts); --overwrite replaces out as a whole, so no input may be inside it.
    """
    check_out_location(out, [p for p in inputs if p is not None] if overwrite else [])
    if out.exists() and not out.is_dir():
        raise AttnlabError(f"out {out} exists and is not a directory", options=("out",))
    if not contents(out):  # nothing, or only the temp files of a start killed early
        return
    if not (resume or overwrite):
        what = "holds a run" if started else "already holds files"
        raise AttnlabError(
            f"out {out} {what}: pass resume to continue or overwrite",
            options=("out", "resume", "overwrite"),
        )
    if resume and not started:
        raise AttnlabError(f"resume: {out} holds no {job} run to continue", options=("resume",))


@contextlib.contextmanager
def hold_run_out(out: Path, rank: int) -> Iterator[None]:
    """Keep out to this run while the block runs: refused, on every rank, while another run has it.

    Every training job holds it from before its --out check to its last write, so that a
    second run (a --resume, an --overwrite) can neither write beside it nor replace out under
    it. Rank 0 alone takes the lock (io.lock_out_dir): it alone writes, and the ranks of one
    run, on one machine or several sharing out, must not shut each other out.
    """
    with contextlib.ExitStack() as stack:
        failure: AttnlabError | None = None
        if rank == 0:
            try:
                stack.enter_context(lock_out_dir(out))
            except AttnlabError as err:
                failure = err
        raise_together(failure)  # the other ranks stop too, rather than wait at a barrier
        yield


def has_checkpoint(out: Path) -> bool:
    """Whether out holds a complete checkpoint: only then does --resume reuse the run's files."""
    return latest_checkpoint(out / CHECKPOINT_DIR) is not None


def _resolve_device(name: str, local_rank: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)  # one GPU per process under torchrun
    return device


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    # SIGTERM (a scheduler pre-empting the job, torchrun stopping its workers) would otherwise
    # end the process with no cleanup; as KeyboardInterrupt it unwinds like Ctrl-C, so a
    # checkpoint being written is discarded and the last complete one stays the newest.
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


PLAN_EVERY = 10  # steps between the plans of a time-limited run (_plan_schedule)
# The plan counts on this share of the step rate measured so far: evaluations and checkpoints
# still to come take their time from the same clock.
PLAN_RATE_SHARE = 0.9


def steps_within(
    steps: int, step: int, elapsed: float, max_seconds: float, steps_per_s: float | None
) -> int:
    """The step a time-limited run will stop at: ``steps``, or fewer if the clock ends it first.

    The progress bar's total, so that its percentage and ETA follow the time limit (a 30-minute
    run of "100,000 steps" would otherwise show an ETA of hours).
    """
    if not steps_per_s:
        return steps
    left = max(max_seconds - elapsed, 0.0)
    return min(steps, step + math.ceil(left * steps_per_s))


@dataclass
class _Window:
    """Sums of the logged values since the last row, per rank and on the device."""

    sums: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    steps: int = 0
    tokens: int = 0
    started: float = dataclasses.field(default_factory=time.perf_counter)
    resumed_s: float = 0.0  # its training seconds before the checkpoint this run resumed

    def seconds(self) -> float:
        """Training seconds since the last row, those before a resume included."""
        return self.resumed_s + time.perf_counter() - self.started

    def add(self, values: dict[str, Tensor], tokens: int) -> None:
        """Add one optimiser step's values."""
        for key, value in values.items():
            self.sums[key] = self.sums[key] + value if key in self.sums else value
        self.steps += 1
        self.tokens += tokens


def _check_trainer_arguments(
    batches: BatchSource, config: TrainConfig, evaluate: Evaluate | None, on_best: OnBest | None
) -> None:
    """Refuse Trainer arguments that do not go together, or batches that are no BatchSource."""
    if config.best_metric is not None and evaluate is None:
        raise AttnlabError("train: best_metric needs an evaluate function")
    if on_best is not None and config.best_metric is None:
        raise AttnlabError("train: on_best needs a best_metric to compare evaluations by")
    missing = [m for m in BATCH_SOURCE_METHODS if not callable(getattr(batches, m, None))]
    if missing:
        raise AttnlabError(
            f"train: batches must be a BatchSource (attnlab.train.data), which a "
            f"{type(batches).__name__} is not: it lacks {', '.join(missing)}"
        )


class Trainer:
    """Trains model on batches as config says; ``fit()`` runs (or resumes) the whole job.

    ``model(**batch)`` must return a dict with a scalar ``"loss"``; its other 0-dim tensors
    (e.g. ``mlm_loss``, ``nsp_loss``) are logged too. ``evaluate(model)`` is called in eval
    mode under no_grad (and the run's bf16 autocast) on rank 0 and returns named floats; it
    cannot disturb training (the RNG states are put back afterwards). With
    ``config.best_metric`` set, ``on_best(model, metrics)`` is called (rank 0) after each
    evaluation that improves that metric, e.g. to keep the best dev model.
    ``optimizer`` / ``scheduler`` default to those the config names (AdamW decays the weights
    of 2-D and larger parameters but no biases: train/optim.py: decay_groups). Under torchrun the
    model is wrapped in DistributedDataParallel (or, with ``config.strategy`` "fsdp", sharded
    over the ranks: train/sharding.py; the trainer then builds the optimiser itself and takes
    no on_best) and each rank reads its own shard of batches; only rank 0 writes files or
    shows progress. While ``fit()`` runs, another run into
    ``config.out_dir`` is refused (hold_run_out).

    ``speedups`` (train/hooks.py; the jobs pass fast/training.py's TrainingSpeedups) may change
    how the loop runs and how the clipped optimiser step is taken; without it the trainer is
    plain PyTorch. For the whole process, not just the run: ``fit()`` seeds Python's, numpy's
    and torch's global generators with ``config.seed``. The model is left in training mode.
    """

    def __init__(
        self,
        model: nn.Module,
        batches: BatchSource,
        config: TrainConfig,
        evaluate: Evaluate | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        on_best: OnBest | None = None,
        speedups: TrainerHooks | None = None,
    ) -> None:
        _check_trainer_arguments(batches, config, evaluate, on_best)
        self.config = config
        self.speedups = speedups or TrainerHooks()
        self.rank, self.world_size, local_rank = init_distributed()
        self.is_main = self.rank == 0
        self.device = _resolve_device(config.device, local_rank)
        self.model = model.to(self.device)
        self.batches = batches
        self.batches.set_rank(self.rank, self.world_size)
        self.evaluate = evaluate
        self.on_best = on_best
        self.best: dict[str, float] | None = None  # step and metrics of the best evaluation
        # fsdp: self.model's parameters become shards (DTensors), before the optimiser takes them
        self.sharded = self.world_size > 1 and config.strategy == "fsdp"
        if self.sharded:
            _check_sharded_arguments(optimizer, scheduler, on_best)
            sharding.shard_model(self.model)
        self.optimizer = optimizer or build_optimizer(
            self.model, config.lr, config.weight_decay, config.betas, config.eps, config.optimizer
        )
        self.scheduler = scheduler or build_scheduler(
            config.schedule, self.optimizer, config.warmup, config.steps
        )
        self.network = self._network()  # what the forward pass runs
        # Rank 0, after fit() under fsdp: the trained model's state dict of full tensors.
        self.full_weights: dict[str, Tensor] | None = None
        self.step = 0
        self.tokens_seen = 0
        self.checkpoint_root = config.out_dir / CHECKPOINT_DIR
        self.log = MetricsLog(config.out_dir / METRICS_FILE)
        self._elapsed_before = 0.0  # training seconds of the runs this one resumes
        self._window = _Window()
        self._last_lr = 0.0
        self._started = time.perf_counter()
        self._session_tokens = 0
        # What fit() reports: the last train row and eval metrics, the newest checkpoint.
        self.last_train: dict[str, Any] = {}
        self.last_eval: dict[str, float] = {}
        self.last_checkpoint: Path | None = None

    def release_network(self) -> None:
        """After training, before the process group goes: drop the DDP (or compiled) wrapper.

        Freed after the group is gone, DDP's reducer destroys gloo's backend while holding the
        GIL, and gloo's worker thread may still be releasing the last collective's tensors,
        which needs the GIL: a deadlock at exit. Freed now, the group outlives it.
        """
        self.network = self.model

    def _network(self) -> nn.Module:
        """The model under DDP (torchrun, strategy ddp), else itself (fsdp shards it in place)."""
        network = self.model
        if self.world_size > 1 and not self.sharded:
            network = DistributedDataParallel(
                self.model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                find_unused_parameters=self.config.find_unused_parameters,
            )
        if self.config.compile:
            # Compiled around DDP (not inside it) so DDP's gradient hooks still see every bucket;
            # checkpoints keep reading self.model, whose parameter names compile leaves alone.
            network = torch.compile(network)
        return network

    # ---- the loop ---------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        """Train to config.steps (resuming if asked), evaluating, saving and plotting; a summary."""
        with hold_run_out(self.config.out_dir, self.rank):  # a job holds it already: joined
            return self._fit()

    def _fit(self) -> dict[str, Any]:
        cfg = self.config
        self._started = time.perf_counter()
        seed_everything(cfg.seed + self.rank)  # ranks differ in dropout, as their data does
        self._open_run()
        if cfg.eval_at_start and self.step == 0 and self.evaluate is not None:
            self._run_evaluation()
        start_step, self._session_tokens = self.step, 0
        self._window.started = time.perf_counter()  # tokens/s counts training time only
        self._loop_started = self._window.started  # the step rate of _plan_schedule
        data = iter(self.batches)
        bar = tqdm(
            total=None if self._clock_plans() else cfg.steps,  # then the first log row sets it
            initial=self.step,
            desc="train",
            unit="step",
            file=sys.stderr,
            dynamic_ncols=True,
            disable=not (cfg.progress and self.is_main),
        )
        try:
            with _sigterm_as_interrupt(), self.speedups.running(self):
                self.model.train()
                # Decided once a step: a clock that runs out during the logging, evaluation or
                # saving after a step would otherwise end the loop with no final checkpoint.
                stop = self.step >= self._last_step() or self._out_of_time()
                while not stop:
                    values, tokens = self._train_step(data)
                    self.step += 1
                    self._plan_schedule(start_step)
                    self._window.add(values, tokens)
                    bar.update(1)
                    stop = self.step >= self._last_step() or self._out_of_time()
                    self._after_step(bar, final=stop)
                    self.speedups.after_step(self)
        finally:
            bar.close()
        if self.sharded:  # whole again for the job to publish (rank 0)
            self.full_weights = sharding.gather_weights(self.model)
        if self.is_main:
            plot_loss_curve(self.log.rows, cfg.out_dir / PLOT_FILE)
        wall = time.perf_counter() - self._started
        # tokens_per_s: this session's tokens over its whole wall time, evaluation, checkpoints
        # and restoring included (metrics.jsonl's rows count training time only).
        return {
            "step": self.step,
            "loss": self.last_train.get("loss"),
            "eval": self.last_eval,
            "tokens_per_s": self._session_tokens / wall if self.step > start_step else 0.0,
            "wall_s": wall,
            "checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
            "best": self.best,
            **self._planned(),
        }

    def _plan_schedule(self, start_step: int) -> None:
        """Under max_seconds and warmup_share, plan the schedule from the steps the clock allows.

        Every PLAN_EVERY steps, from the step rate of this session so far (evaluations and
        checkpoints included): while warming up, a warm-up of warmup_share of the steps the run
        will make (at most config.warmup) and a linear decay that ends with them; an
        inverse-sqrt warm-up then stays (a later change would make the learning rate jump). A
        linear decay is planned again all along (Schedule.redecay: from the rate in force, no
        jump), so that it ends with the clock when the machine's speed drifts, and the run
        ends with it (_last_step). A resumed run goes on with its plan.
        """
        cfg = self.config
        schedule = schedule_of(self.scheduler)
        if not self._clock_plans() or schedule is None:
            return
        warming_up = self.step < schedule.warmup
        if self.step % PLAN_EVERY or not (warming_up or schedule.name == "linear"):
            return
        # One plan for every rank (their clocks differ): their mean times.
        now = time.perf_counter()
        times = torch.tensor([now - self._loop_started, self._elapsed()], device=self.device)
        looped, elapsed = (all_reduce_sum(times) / self.world_size).tolist()
        rate = PLAN_RATE_SHARE * (self.step - start_step) / max(looped, 1e-9)
        steps = steps_within(cfg.steps, self.step, elapsed, cfg.max_seconds, rate)
        if warming_up:
            schedule.replan(planned_warmup(steps, cfg.warmup_share, cfg.warmup), steps)
        else:
            schedule.redecay(self.scheduler.last_epoch, steps)
        # The next step's rate, set by the scheduler's step before this plan, follows it.
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs, strict=True):
            group["lr"] = base * schedule(self.scheduler.last_epoch)

    def _clock_plans(self) -> bool:
        """Whether _plan_schedule plans this run from the clock (max_seconds and warmup_share)."""
        return self.config.max_seconds is not None and self.config.warmup_share is not None

    def _planned(self) -> dict[str, int]:
        """What _plan_schedule planned: {"planned_warmup": steps}, with "planned_steps" for a
        linear decay; {} without a plan."""
        schedule = schedule_of(self.scheduler)
        if schedule is None or not schedule.plan:
            return {}
        planned = {"planned_warmup": schedule.warmup}
        return planned | ({"planned_steps": schedule.total} if schedule.name == "linear" else {})

    def _last_step(self) -> int:
        """config.steps, or the step where a planned linear decay reaches 0 (a timed run ends)."""
        schedule = schedule_of(self.scheduler)
        if schedule is not None and schedule.name == "linear" and schedule.plan:
            return min(schedule.total, self.config.steps)
        return self.config.steps

    def _out_of_time(self) -> bool:
        """Whether config.max_seconds of training time have passed (the same answer on every rank)."""
        limit = self.config.max_seconds
        if limit is None:
            return False
        over = torch.tensor([float(self._elapsed() >= limit)], device=self.device)
        return bool(all_reduce_sum(over).item() > 0)  # any rank over the limit stops them all

    def _after_step(self, bar: tqdm, final: bool) -> None:
        """Log, evaluate and checkpoint where this step is due for them.

        In that order: the checkpoint of step N then follows every row of step N, so a run
        resumed from it keeps exactly the rows with step <= N.
        """
        cfg = self.config
        if final or self.step % cfg.log_every == 0:
            row = self._log_window()
            if cfg.max_seconds is not None and not final and not bar.disable:
                bar.total = steps_within(
                    self._last_step(), self.step, self._elapsed(), cfg.max_seconds,
                    bar.format_dict["rate"],
                )  # fmt: skip
            bar.set_postfix(
                loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}", tok_s=f"{row['tokens_per_s']:.0f}"
            )
        if self.evaluate is not None and (final or _due(self.step, cfg.eval_every)):
            self._off_the_clock(self._run_evaluation)
        if final or _due(self.step, cfg.save_every):
            self._off_the_clock(self._save)

    def _off_the_clock(self, action: Callable[[], None]) -> None:
        """Run action, its time left out of the logging window's (tokens/s: training time only)."""
        began = time.perf_counter()
        action()
        self._window.started += time.perf_counter() - began

    def _train_step(self, data: Iterator[Batch]) -> tuple[dict[str, Tensor], int]:
        """One optimiser step over grad_accum micro-batches: (mean values, tokens read)."""
        cfg = self.config
        values: dict[str, Tensor] = {}
        tokens = 0
        for micro in range(cfg.grad_accum):
            try:
                batch = next(data)
            except StopIteration:
                raise AttnlabError(
                    f"train: the batches ran out at step {self.step + 1}: a BatchSource yields "
                    "batches without end (epoch after epoch)"
                ) from None
            if not isinstance(batch, Mapping):
                raise AttnlabError(
                    "train: a batch must be a dict of model.forward's keyword arguments, got a "
                    f"{type(batch).__name__}"
                )
            tokens += self._tokens_in(batch)
            batch = {
                k: v.to(self.device, non_blocking=True) if isinstance(v, Tensor) else v
                for k, v in batch.items()
            }
            # DDP all-reduces gradients during backward (FSDP reduce-scatters them); only the
            # last micro-batch needs it.
            sync = micro == cfg.grad_accum - 1 or self.world_size == 1
            with contextlib.nullcontext() if sync else self._no_sync():
                with self._autocast():
                    out = self.network(**batch)
                loss = _loss_of(out)
                (loss / cfg.grad_accum).backward()
            for key, value in _scalars(out).items():
                value = value.detach().float() / cfg.grad_accum
                values[key] = values[key] + value if key in values else value
        max_norm = cfg.clip_norm if cfg.clip_norm else math.inf
        self._last_lr = self.optimizer.param_groups[0]["lr"]  # the lr this step used
        # The speed-ups read whole gradients: sharded ones take the plain step.
        clipped_step = sharding.clipped_step if self.sharded else self.speedups.clipped_step
        values["grad_norm"] = clipped_step(self.optimizer, self.model.parameters(), max_norm)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return values, tokens

    def _no_sync(self) -> contextlib.AbstractContextManager:
        if self.sharded:
            return sharding.no_sync(self.model)
        assert isinstance(self.network, DistributedDataParallel)
        return self.network.no_sync()

    def _tokens_in(self, batch: Batch) -> int:
        counter = getattr(self.batches, "tokens_in", None)
        return int(counter(batch)) if counter is not None else count_tokens(batch)

    def _autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=self.config.precision == "bf16"
        )

    # ---- logging and evaluation ------------------------------------------------------

    def _log_window(self) -> dict[str, Any]:
        """Average the window over steps and ranks, append it to metrics.jsonl, start a new one."""
        window = self._window
        keys = sorted(window.sums)
        # One all-reduce for the values, one for the token count, and .item() only here: no
        # per-step host sync.
        totals = torch.stack([window.sums[k].double() for k in keys])
        tokens = torch.tensor([window.tokens], dtype=torch.int64, device=self.device)
        totals, tokens = all_reduce_sum(totals), all_reduce_sum(tokens)
        averages = dict(
            zip(keys, (totals / (window.steps * self.world_size)).tolist(), strict=True)
        )
        window_tokens = int(tokens.item())
        self.tokens_seen += window_tokens
        seconds = max(window.seconds(), 1e-9)
        row: dict[str, Any] = {
            "step": self.step,
            "loss": averages.pop("loss"),
            "lr": self._last_lr,
            **averages,
            "tokens": self.tokens_seen,
            "tokens_per_s": round(window_tokens / seconds, 1),
            "elapsed_s": round(self._elapsed(), 3),
        }
        if self.is_main:
            self.log.append(row)
        self._window = _Window()
        self._session_tokens += window_tokens
        self.last_train = {k: v for k, v in row.items() if k != "step"}
        return row

    def _run_evaluation(self) -> None:
        """evaluate(model) on rank 0, logged as an eval row; RNG states are left as they were.

        Under fsdp every rank runs it (each layer's forward gathers its shards from all ranks),
        and rank 0 alone logs it.
        """
        metrics: dict[str, float] = {}
        if self.is_main or self.sharded:
            rng = capture_rng(self.device)
            self.model.eval()
            try:
                with torch.no_grad(), self._autocast():
                    metrics = _metrics_of(self.evaluate(self.model))
            finally:
                self.model.train()
                restore_rng(rng, self.device)
        if self.is_main:
            improved = self._is_best(metrics)
            row = {"step": self.step, "eval": True, **metrics}
            self.log.append({**row, "best": True} if improved else row)
            self.last_eval = metrics
            if improved:
                self.best = {"step": self.step, **metrics}
                if self.on_best is not None:
                    self.on_best(self.model, metrics)
        barrier()

    def _is_best(self, metrics: dict[str, float]) -> bool:
        name = self.config.best_metric
        if name is None:
            return False
        if name not in metrics:
            raise AttnlabError(f"train: best_metric {name!r} is not among {sorted(metrics)}")
        value = metrics[name]
        if math.isnan(value):  # e.g. a correlation of constant predictions: never the best
            return False
        if self.best is None or math.isnan(self.best[name]):
            return True
        if self.config.best_mode == "max":
            return value > self.best[name]
        return value < self.best[name]

    def _last_row(self, eval_rows: bool) -> dict[str, Any]:
        for row in reversed(self.log.rows):
            if bool(row.get("eval")) == eval_rows:  # as _log_window / _run_evaluation keep them
                return {k: v for k, v in row.items() if k not in ("step", "eval", "best")}
        return {}

    def _elapsed(self) -> float:
        return self._elapsed_before + time.perf_counter() - self._started

    # ---- checkpoints and resume ------------------------------------------------------

    def _open_run(self) -> None:
        """Check out_dir, then resume from its newest checkpoint or start afresh (overwrite)."""
        cfg = self.config
        out = cfg.out_dir
        if out.exists() and not out.is_dir():
            raise AttnlabError(f"output {out} exists and is not a directory")
        root = self.checkpoint_root
        # Laxer than holds_run (the CLI's check): an empty checkpoints folder, left by a start
        # killed before its first checkpoint, holds nothing a fresh start would lose.
        has_progress = (out / METRICS_FILE).exists() or (root.is_dir() and any(root.iterdir()))
        if has_progress and not (cfg.resume or cfg.overwrite):
            raise AttnlabError(
                f"{out} holds a run: pass resume to continue or overwrite to start over",
                options=("resume", "overwrite"),
            )
        # Every rank reads the checkpoint (a shared filesystem is assumed) before any rank
        # writes: a bad checkpoint stops all of them with nothing changed.
        latest = latest_checkpoint(root) if cfg.resume else None
        if latest is not None:
            self._restore(latest)
        barrier()
        if self.is_main:
            if cfg.overwrite:
                shutil.rmtree(root, ignore_errors=True)
                for name in (METRICS_FILE, PLOT_FILE):
                    (out / name).unlink(missing_ok=True)
                self.log = MetricsLog(out / METRICS_FILE)
            remove_partial(root)
            # A kill between a checkpoint and the pruning after it left one too many: a run
            # resumed at its last step saves nothing more that would prune it.
            prune_checkpoints(root, cfg.keep_last)
            # Temp files and trash of writes a kill interrupted: in out and one level below
            # (the best model's folder, a staged final model), never in the checkpoints.
            remove_trash_of(out)  # an --overwrite killed while clearing the old run
            if out.is_dir():
                for folder in [out, *(p for p in out.iterdir() if p.is_dir() and p != root)]:
                    remove_leftovers(folder)
            # Rows past the checkpoint are redone by this run: drop them so the file ends up
            # as an uninterrupted run's (all of them, step 0's evaluation too, without one).
            self.log.truncate_after(self.step if latest is not None else -1)
            out.mkdir(parents=True, exist_ok=True)
            self.last_train, self.last_eval = self._last_row(False), self._last_row(True)
        barrier()

    def _restore(self, path: Path) -> None:
        load = sharding.load_weights if self.sharded else None
        state = read_checkpoint(path, self.model, load)
        try:
            if state["step"] > self.config.steps:
                raise ValueError(f"it is at step {state['step']}, past steps={self.config.steps}")
            if self.sharded:
                sharding.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
            else:
                self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            # Per-rank parts by rank; a different world size reuses them round-robin (the
            # resumed run is then no longer bit-identical, but it continues).
            data, rng = state["data"], state["rng"]
            self.batches.load_state_dict(data[self.rank % len(data)])
            restore_rng(rng[self.rank % len(rng)], self.device)
            window = state["window"]
            sums = self._resumed_sums(window["sums"], state.get("world_size", self.world_size))
            self._window.sums = {k: v.to(self.device) for k, v in sums.items()}
            self._window.steps = window["steps"]
            self._window.tokens = window["tokens"] if self.is_main else 0  # the ranks' total
            self._window.resumed_s = float(window.get("seconds", 0.0))  # tokens/s of its row
            self.step = state["step"]
            self.tokens_seen = state["tokens_seen"]
            self._elapsed_before = state["elapsed_s"]
            self.best = state.get("best")
            self.last_checkpoint = path
        except (KeyError, ValueError, RuntimeError, TypeError) as exc:
            raise AttnlabError(f"checkpoint {path} does not fit this run ({exc})") from exc
        saved, now = state.get("config") or {}, self.config.to_dict()
        saved, now = {**saved, **saved.get("job", {})}, {**now, **now["job"]}
        names = [*RESUMED_SETTINGS, *self.config.job]
        changed = [k for k in names if k in saved and saved[k] != now[k]]
        if changed and self.is_main:  # the checkpoint's optimiser and schedule state go on
            differ = ", ".join(f"{k} {now[k]!r} (checkpoint: {saved[k]!r})" for k in changed)
            if "warmup" in changed and saved.get("steps") != now["steps"]:
                differ += " (a job's default warm-up follows --steps: --warmup fixes it)"
            print(f"warning: resuming {path} with other settings: {differ}", file=sys.stderr)
        longer = saved.get("steps") not in (None, now["steps"])
        if longer and now["schedule"] == "linear" and self.is_main:
            print(
                f"warning: resuming {path} with steps {now['steps']} (checkpoint: "
                f"{saved['steps']}): the linear decay is stretched to the new last step, so the "
                "learning rate rises again here (an uninterrupted run of this length differs)",
                file=sys.stderr,
            )
        ranks = len(state["rng"])  # one RNG state per process of the saving run
        if ranks != self.world_size and self.is_main:
            print(
                f"warning: resuming {path} with {self.world_size} process(es) (checkpoint: "
                f"{ranks}): it goes on from the checkpoint's step, but the processes' random "
                "states (dropout) are reused round-robin, so it is no longer bit-identical to "
                "an uninterrupted run",
                file=sys.stderr,
            )

    def _resumed_sums(
        self, saved: list[dict[str, Tensor]] | dict[str, Tensor], saved_ranks: int
    ) -> dict[str, Tensor]:
        """This rank's part of a checkpoint's logging-window sums (saved: one dict per rank)."""
        if isinstance(saved, dict):  # an older checkpoint: the ranks' total only
            zeros = {k: torch.zeros_like(v) for k, v in saved.items()}
            saved = [saved, *[zeros] * (saved_ranks - 1)]
        if len(saved) == self.world_size:
            # Each rank its own sums: the row's all-reduce then adds the numbers an uninterrupted
            # run adds, in its order, so the row is bit-identical (a total kept on rank 0 was
            # rounded in another order: the last bits of a 2-process run's loss changed).
            return saved[self.rank]
        # Another number of processes: the total on rank 0 only (the all-reduce adds it once),
        # rescaled to this run's ranks, as the row divides by steps x this run's ranks.
        if not self.is_main:
            return {k: torch.zeros_like(v) for k, v in saved[0].items()}
        scale = self.world_size / len(saved)
        return {k: sum(part[k] for part in saved) * scale for k in saved[0]}

    def _save(self) -> None:
        """Checkpoint the run as out_dir/checkpoints/step-<step> (rank 0 writes; all ranks wait)."""
        rng = gather_objects(capture_rng(self.device))
        state = self.batches.state_dict()
        _check_state(state, "state_dict()")
        data = gather_objects(state)
        window = self._window
        sums = gather_objects({k: v.cpu() for k, v in sorted(window.sums.items())})  # by rank
        tokens = all_reduce_sum(torch.tensor([window.tokens], device=self.device)).item()
        weights, optimizer = None, None  # fsdp: full tensors, gathered by every rank for rank 0
        if self.sharded:
            weights = sharding.gather_weights(self.model)
            optimizer = sharding.gather_optimizer_state(self.model, self.optimizer)
        if self.is_main:
            state = {
                "step": self.step,
                "optimizer": optimizer if self.sharded else self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "data": data,
                "rng": rng,
                "window": {
                    "sums": sums,
                    "steps": window.steps,
                    "tokens": int(tokens),
                    "seconds": window.seconds(),
                },
                "tokens_seen": self.tokens_seen,
                "elapsed_s": self._elapsed(),
                "world_size": self.world_size,
                "best": self.best,
                "config": self.config.to_dict(),
            }
            self.last_checkpoint = save_checkpoint(
                self.checkpoint_root, self.step, self.model, state, weights
            )
            prune_checkpoints(self.checkpoint_root, self.config.keep_last)
        barrier()


def _check_sharded_arguments(
    optimizer: torch.optim.Optimizer | None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    on_best: OnBest | None,
) -> None:
    """Refuse what strategy fsdp cannot take: an optimiser made before sharding holds the
    parameters that sharding replaced, and on_best would get a model of shards."""
    if optimizer is not None or scheduler is not None:
        raise AttnlabError(
            "train: strategy fsdp builds the optimizer and scheduler after sharding the model: "
            "pass neither"
        )
    if on_best is not None:
        raise AttnlabError("train: strategy fsdp takes no on_best (its model holds shards)")


def _due(step: int, every: int) -> bool:
    """Whether a periodic action (every 0 = never) falls on step."""
    return every > 0 and step % every == 0


BATCH_SOURCE_METHODS = ("__iter__", "state_dict", "load_state_dict", "set_rank")


def _metrics_of(result: Any) -> dict[str, float]:
    """evaluate(model)'s named numbers as floats, or a one-line reason they are not."""
    if not isinstance(result, Mapping):
        raise AttnlabError(
            f"evaluate(model) must return a dict of named numbers, got {type(result).__name__}"
        )
    metrics = {}
    for name, value in result.items():
        try:
            metrics[str(name)] = float(value)
        except (TypeError, ValueError):
            raise AttnlabError(
                f"evaluate(model)[{name!r}] is not a number: {value!r:.60}"
            ) from None
    return metrics


def _check_state(state: Any, where: str) -> None:
    """Refuse a batch-source state that a checkpoint could not be read back with (weights_only)."""
    if isinstance(state, dict):
        for key, value in state.items():
            if not isinstance(key, str):
                raise AttnlabError(
                    f"train: the batch source's {where} has a key {key!r} that is not a string"
                )
            _check_state(value, f"{where}[{key!r}]")
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            _check_state(value, f"{where}[{i}]")
    elif not (state is None or isinstance(state, (bool, int, float, str, Tensor))) or (
        type(state).__module__ == "numpy"  # np.float64 is a float, but pickles as numpy's
    ):
        raise AttnlabError(
            f"train: the batch source's {where} holds a {type(state).__name__}: a checkpoint "
            "keeps only numbers, strings, lists, dicts and tensors (convert it, e.g. int(x))"
        )


def _loss_of(out: Any) -> Tensor:
    if not isinstance(out, dict) or not isinstance(out.get("loss"), Tensor):
        raise AttnlabError("model(**batch) must return a dict with a scalar tensor 'loss'")
    loss = out["loss"]
    if loss.ndim != 0:
        raise AttnlabError(
            f"model(**batch)['loss'] must be a scalar, got shape {tuple(loss.shape)}"
        )
    return loss


def _scalars(out: dict[str, Any]) -> dict[str, Tensor]:
    """The model's 0-dim tensor outputs: the loss and any metrics it reports."""
    return {k: v for k, v in out.items() if isinstance(v, Tensor) and v.ndim == 0}
