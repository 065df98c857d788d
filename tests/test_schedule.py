"""The warm-up of a time-limited run is planned from the steps the clock allows (Trainer).

The trainer's clock is replaced by one that a step moves on by a second (an evaluation by
more), so the steps a limit allows are known exactly and the test does not depend on the
machine's speed.
"""

from __future__ import annotations

import itertools
import types
from pathlib import Path

import pytest
import torch
from _trainer_run import TinyClassifier, make_data
from torch import Tensor

import attnlab.train.trainer as trainer_module
from attnlab.train import TensorBatches, TrainConfig, Trainer, read_rows, seed_everything
from attnlab.train.optim import Schedule, build_scheduler, planned_warmup, schedule_of

STEP_SECONDS = 1.0


class FakeClock:
    """perf_counter of the trainer's time module: moved on by the model and the evaluation."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One torch thread: a tiny model's steps on many threads spin when the cores are busy."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(
        trainer_module, "time", types.SimpleNamespace(perf_counter=fake.perf_counter)
    )
    return fake


class TimedClassifier(TinyClassifier):
    """TinyClassifier whose forward pass takes STEP_SECONDS of the fake clock in training."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.clock = clock

    def forward(self, input_ids: Tensor, attention_mask: Tensor, labels: Tensor) -> dict:
        if self.training:
            self.clock.now += STEP_SECONDS
        return super().forward(input_ids, attention_mask, labels)


def fit(tmp_path: Path, clock: FakeClock, **config: object) -> tuple[dict, list[dict]]:
    """A run of a million nominal steps under a 200-second limit; (summary, train rows)."""

    def evaluate(model: torch.nn.Module) -> dict[str, float]:
        clock.now += 3 * STEP_SECONDS  # evaluations take time from the same clock
        return {"score": 0.0}

    seed_everything(0)
    settings = {"steps": 1_000_000, "max_seconds": 200.0, "lr": 1e-3, "log_every": 2}
    settings |= {"eval_every": 50, "save_every": 0, "progress": False, "device": "cpu"}
    run = TrainConfig(out_dir=tmp_path / "run", **(settings | config))
    model = TimedClassifier(clock)
    summary = Trainer(model, TensorBatches(make_data(), 8), run, evaluate).fit()
    rows = [r for r in read_rows(tmp_path / "run" / "metrics.jsonl") if not r.get("eval")]
    return summary, rows


@pytest.mark.parametrize("schedule", ["inverse_sqrt", "linear"])
def test_a_time_limited_runs_warmup_is_at_most_a_tenth_of_its_steps(tmp_path, clock, schedule):
    summary, rows = fit(tmp_path, clock, schedule=schedule, warmup=4000, warmup_share=0.1)
    steps = summary["step"]
    assert 170 < steps < 200  # 200 s at a step a second, less the evaluations
    warmup = summary["planned_warmup"]
    assert warmup <= 0.1 * steps  # never more than 10% of the steps the run makes
    assert warmup >= 0.07 * steps  # and not far below it
    lrs = [row["lr"] for row in rows]
    assert max(lrs) == pytest.approx(1e-3, rel=0.02)  # the peak is reached...
    assert lrs.index(max(lrs)) <= warmup  # ...at the end of the planned warm-up
    if schedule == "linear":  # the decay ends about when the clock does
        assert lrs[-1] < 0.15 * 1e-3


def test_a_planned_linear_decay_ends_with_the_clock_even_after_a_short_warmup(tmp_path, clock):
    # A warm-up of 3 steps is over before the first plan (step 10); the decay is planned there
    # all the same and again every 10 steps, and the run ends where it reaches 0: at the clock
    # (200 s = 191 steps of 1 s and 3 evaluations of 3 s), not earlier and not at lr 0 after.
    summary, rows = fit(tmp_path, clock, schedule="linear", warmup=3, warmup_share=0.1)
    assert summary["planned_warmup"] == 3
    assert summary["step"] == summary["planned_steps"] >= 185
    lrs = [row["lr"] for row in rows]
    decay = lrs[2:]  # rows every 2 steps: the peak at step 3 is over by the second row
    drops = [earlier - later for earlier, later in itertools.pairwise(decay)]
    assert min(drops) >= 0 and max(drops) < 0.03 * 1e-3  # it only falls, and with no jump
    assert lrs[-1] < 0.01 * 1e-3


def test_a_redecay_goes_on_from_the_factor_in_force_to_zero_at_its_new_end() -> None:
    schedule = Schedule("linear", 10, 100)
    assert schedule(40) == pytest.approx(60 / 90)
    schedule.redecay(40, 200)  # the clock allows more steps than planned: a gentler slope
    assert schedule(40) == pytest.approx(60 / 90)
    assert schedule(120) == pytest.approx(60 / 90 * 80 / 160)
    assert schedule(200) == 0.0 and schedule(250) == 0.0
    assert schedule(5) == 0.5  # the warm-up is unchanged
    assert (schedule.warmup, schedule.total) == (10, 200)


def test_an_explicit_warmup_wins_over_the_plan(tmp_path, clock):
    summary, rows = fit(tmp_path, clock, schedule="inverse_sqrt", warmup=4000)
    assert "planned_warmup" not in summary
    assert max(row["lr"] for row in rows) < 0.1 * 1e-3  # 4,000 steps of warm-up: far from peak


def test_a_plan_is_kept_by_a_resumed_scheduler_and_its_settings_are_not() -> None:
    def scheduler(total: int) -> torch.optim.lr_scheduler.LambdaLR:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        return build_scheduler("linear", optimizer, 100, total)

    planned = scheduler(1000)
    schedule_of(planned).replan(20, 300)
    resumed = scheduler(2000)
    resumed.load_state_dict(planned.state_dict())
    schedule = schedule_of(resumed)
    assert (schedule.warmup, schedule.total) == (20, 300)
    assert (schedule.warmup_steps, schedule.total_steps) == (100, 2000)
    unplanned = scheduler(2000)  # without a plan, the resumed run's own settings
    unplanned.load_state_dict(scheduler(1000).state_dict())
    assert schedule_of(unplanned).total == 2000


def test_planned_warmup_rule() -> None:
    assert planned_warmup(2749, 0.1, 4000) == 274
    assert planned_warmup(100_000, 0.1, 4000) == 4000
    assert planned_warmup(30, 0.1, 4000) == 3
    assert planned_warmup(5, 0.1, 4000) == 1
    assert Schedule("inverse_sqrt", 8, 0)(7) == pytest.approx(1.0)  # its peak at n = warmup


def test_translation_plans_its_default_warmup_under_max_minutes(tmp_path) -> None:
    from attnlab.tasks.translate import TranslateOptions, trainer_config

    timed = trainer_config(TranslateOptions(out=tmp_path, steps=100_000, max_minutes=60))
    assert (timed.warmup, timed.warmup_share, timed.max_seconds) == (4000, 0.1, 3600)
    given = trainer_config(
        TranslateOptions(out=tmp_path, steps=100_000, max_minutes=60, warmup=400)
    )
    assert (given.warmup, given.warmup_share) == (400, None)
    assert trainer_config(TranslateOptions(out=tmp_path, steps=400)).warmup == 40
