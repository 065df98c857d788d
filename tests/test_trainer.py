"""The trainer: optimiser groups, schedules, the loop, exact resume after SIGKILL, DDP, accumulation."""

from __future__ import annotations

import errno
import fcntl
import itertools
import json
import math
import multiprocessing
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _kill import exit_code, forked, running
from _trainer_run import TinyClassifier, make_data, make_evaluate, train
from safetensors.torch import load_file
from torch import nn

from attnlab.config import BertConfig
from attnlab.errors import AttnlabError
from attnlab.fast.training import TrainingSpeedups
from attnlab.models.bert import BertForPreTraining
from attnlab.train import (
    TensorBatches,
    TrainConfig,
    Trainer,
    build_optimizer,
    inverse_sqrt,
    linear_warmup_decay,
    read_rows,
    seed_everything,
)
from attnlab.train.hooks import TrainerHooks
from attnlab.train.trainer import steps_within

HELPER = Path(__file__).with_name("_trainer_run.py")
WALL_CLOCK = ("tokens_per_s", "elapsed_s")


def _weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step-{step}" / "model.safetensors"))


def _rows(run: Path) -> list[dict]:
    return [
        {k: v for k, v in row.items() if k not in WALL_CLOCK}
        for row in read_rows(run / "metrics.jsonl")
    ]


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _forked(out: Path, **options) -> multiprocessing.Process:
    """train(out, **options) in a forked child, SIGKILLed as its kill_* options ask (_kill.py)."""
    kills = {name: options.pop(name) for name in list(options) if name.startswith("kill_")}
    return forked(lambda: train(out, **options), **kills)


# ---- optimiser and schedules ------------------------------------------------------------


def test_adamw_groups_exclude_biases_and_layernorm_and_count_tied_weights_once() -> None:
    config = BertConfig(vocab_size=40, d_model=16, n_layers=1, n_heads=2, d_ff=32)
    model = BertForPreTraining(config)
    optimizer = build_optimizer(model, lr=1e-4)
    assert isinstance(optimizer, torch.optim.AdamW)
    decay, no_decay = optimizer.param_groups
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.01, 0.0)
    assert decay["betas"] == (0.9, 0.999) and decay["eps"] == 1e-6

    names = {id(p): name for name, p in model.named_parameters()}
    layer_norm = {
        names[id(p)] for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()
    }
    biases = {name for name in names.values() if name.endswith("bias")}
    assert {names[id(p)] for p in no_decay["params"]} == biases | layer_norm
    assert {names[id(p)] for p in decay["params"]} == set(names.values()) - biases - layer_norm
    assert "mlm.bias" in biases and "bert.embeddings.norm.weight" in layer_norm
    # Embeddings are decayed, as in BERT.
    assert any(p is model.bert.embeddings.word_embeddings.weight for p in decay["params"])
    # The MLM decoder shares the word embeddings: that tensor is optimised once.
    ids = [id(p) for g in optimizer.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert model.mlm.word_embeddings.weight is model.bert.embeddings.word_embeddings.weight


@pytest.mark.parametrize("encoding", ["learned", "relative_bias", "rope"])
@pytest.mark.parametrize("norm_position", ["post", "pre"])
def test_adamw_decays_exactly_what_hf_trainer_decays(encoding: str, norm_position: str) -> None:
    # HF's Trainer (and BERT's optimizer) skip every parameter named "bias" or "LayerNorm".
    # Before, the rule was by shape alone and decayed relative_bias's 2-D bias table.
    from transformers import Trainer as HFTrainer

    config = BertConfig(
        vocab_size=40, d_model=16, n_layers=1, n_heads=2, d_ff=32,
        position_encoding=encoding, norm_position=norm_position,
    )  # fmt: skip
    model = BertForPreTraining(config)
    decay, no_decay = build_optimizer(model, lr=1e-4).param_groups
    hf_names = set(HFTrainer.get_decay_parameter_names(None, model))  # self is unused
    hf_decay = {id(p) for n, p in model.named_parameters(remove_duplicate=False) if n in hf_names}
    assert {id(p) for p in decay["params"]} == hf_decay
    assert {id(p) for p in no_decay["params"]} == {id(p) for p in model.parameters()} - hf_decay


@pytest.mark.parametrize("fused", [True, False])
def test_adamw_steps_follow_the_decoupled_weight_decay_formula(fused: bool) -> None:
    # Loshchilov & Hutter's AdamW, written out: decay p by lr*wd, then the bias-corrected
    # Adam step. The fused kernel (the default) and the foreach path must both follow it.
    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    optimizer = build_optimizer(model, lr=1e-2, weight_decay=0.1, fused=fused)
    assert optimizer.param_groups[0].get("fused") is (True if fused else None)
    (b1, b2), eps = optimizer.param_groups[0]["betas"], optimizer.param_groups[0]["eps"]
    w = model.weight.detach().clone()
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    for t in (1, 2, 3):
        grad = torch.randn_like(w)
        model.weight.grad, model.bias.grad = grad.clone(), torch.zeros_like(model.bias)
        optimizer.step()
        w = w * (1 - 1e-2 * 0.1)
        m, v = b1 * m + (1 - b1) * grad, b2 * v + (1 - b2) * grad**2
        w = w - 1e-2 * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
    torch.testing.assert_close(model.weight.detach(), w, rtol=1e-6, atol=1e-7)


def test_adam_has_the_transformer_papers_settings() -> None:
    optimizer = build_optimizer(TinyClassifier(), lr=1.0, kind="adam")
    assert isinstance(optimizer, torch.optim.Adam) and len(optimizer.param_groups) == 1
    group = optimizer.param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.9, 0.98), 1e-9, 0.0)
    with pytest.raises(AttnlabError, match="optimizer must be one of"):
        build_optimizer(TinyClassifier(), lr=1.0, kind="sgd")


def _lrs(scheduler: torch.optim.lr_scheduler.LambdaLR, steps: int) -> list[float]:
    lrs = []
    for _ in range(steps):
        lrs.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return lrs


def _optimizer(lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def test_linear_warmup_decay_follows_the_formula() -> None:
    lr, warmup, total = 2e-4, 10, 50
    lrs = _lrs(linear_warmup_decay(_optimizer(lr), warmup, total), total + 5)
    for step in (0, 1, 5, 9):
        assert lrs[step] == pytest.approx(lr * step / warmup)
    for step in (10, 11, 30, 49, 50, 54):
        assert lrs[step] == pytest.approx(lr * max(0.0, (total - step) / (total - warmup)))
    assert max(lrs) == pytest.approx(lr) and lrs[total] == 0.0


def test_inverse_sqrt_follows_the_formula_with_its_peak_at_lr() -> None:
    lr, warmup = 1e-3, 8
    lrs = _lrs(inverse_sqrt(_optimizer(lr), warmup), 40)
    for step in (0, 3, 7, 8, 20, 39):
        n = step + 1
        expected = lr * math.sqrt(warmup) * min(n**-0.5, n * warmup**-1.5)
        assert lrs[step] == pytest.approx(expected)
    assert max(lrs) == pytest.approx(lr) == lrs[warmup - 1]
    # With d_model: the paper's lrate = d_model^-0.5 * min(n^-0.5, n * warmup^-1.5).
    paper = _lrs(inverse_sqrt(_optimizer(1.0), 4000, d_model=512), 4001)
    assert paper[3999] == pytest.approx(512**-0.5 * 4000**-0.5)
    assert paper[99] == pytest.approx(512**-0.5 * 100 * 4000**-1.5)


# ---- batches ------------------------------------------------------------------------------


def test_tensor_batches_shard_the_global_batch_and_resume_in_place() -> None:
    data = {"x": torch.arange(20)}
    single = TensorBatches(data, batch_size=4, seed=3)
    ranks = [TensorBatches(data, batch_size=4, seed=3) for _ in range(2)]
    for rank, source in enumerate(ranks):
        source.set_rank(rank, 2)
    streams = [iter(single), *(iter(r) for r in ranks)]
    for _ in range(12):  # more than two epochs of 5 batches
        whole, first, second = (next(s)["x"] for s in streams)
        assert torch.equal(whole, torch.cat([first, second]))

    resumed = TensorBatches(data, batch_size=4, seed=3)
    resumed.load_state_dict(single.state_dict())
    for _, batch in zip(range(7), resumed, strict=False):
        assert torch.equal(batch["x"], next(streams[0])["x"])
    with pytest.raises(AttnlabError, match="not divisible"):
        TensorBatches(data, batch_size=3).set_rank(0, 2)


# ---- the loop -----------------------------------------------------------------------------


def test_fit_trains_logs_evaluates_plots_and_keeps_the_last_checkpoints(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _, summary = train(
        out, steps=40, log_every=5, eval_every=10, save_every=10, keep_last=2, lr=3e-2
    )
    rows = read_rows(out / "metrics.jsonl")
    train_rows = [r for r in rows if not r.get("eval")]
    eval_rows = [r for r in rows if r.get("eval")]
    assert [r["step"] for r in train_rows] == list(range(5, 41, 5))
    for row in train_rows:
        assert {"step", "loss", "lr", "tokens_per_s", "elapsed_s", "accuracy", "grad_norm"} <= set(
            row
        )
    assert train_rows[-1]["loss"] < 0.8 * train_rows[0]["loss"]
    # tokens counts real tokens (the attention mask): 40 steps of 8 examples, 5 epochs of 64.
    assert train_rows[-1]["tokens"] == 5 * int(make_data()["attention_mask"].sum())
    assert [r["step"] for r in eval_rows] == [10, 20, 30, 40]
    assert {"loss", "accuracy"} <= set(eval_rows[0])
    assert eval_rows[-1]["loss"] < eval_rows[0]["loss"]
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-30", "step-40"]
    assert summary["step"] == 40 and summary["loss"] == train_rows[-1]["loss"]
    assert summary["eval"]["accuracy"] == eval_rows[-1]["accuracy"]
    assert summary["tokens_per_s"] > 0 and summary["wall_s"] > 0
    assert summary["checkpoint"] == str(out / "checkpoints" / "step-40")
    state = torch.load(out / "checkpoints/step-40/trainer.pt", weights_only=True)
    assert state["step"] == 40 and state["config"]["steps"] == 40


def test_loss_plot_draws_scores_not_the_best_mark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An improving dev row is marked "best": true; drawn, the mark read as a score of 1.0.
    from matplotlib.axes import Axes

    from attnlab.train.log import plot_loss_curve

    labels = []
    plot = Axes.plot

    def recording_plot(self, *args, **kwargs):
        labels.append(kwargs.get("label"))
        return plot(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", recording_plot)
    rows = [
        {"step": 5, "loss": 0.7},
        {"step": 5, "eval": True, "loss": 0.6, "accuracy": 0.5, "best": True},
        {"step": 10, "loss": 0.5},
        {"step": 10, "eval": True, "loss": 0.65, "accuracy": 0.4},
    ]
    assert plot_loss_curve(rows, tmp_path / "loss.png")
    assert labels == ["train loss", "eval loss", "accuracy"]


def test_bf16_runs_the_forward_pass_under_autocast(tmp_path: Path) -> None:
    trainer, summary = train(tmp_path / "run", steps=3, precision="bf16", save_every=0)
    assert trainer.model.seen_dtype == torch.bfloat16
    assert math.isfinite(summary["loss"])
    assert next(trainer.model.parameters()).dtype == torch.float32  # master weights stay fp32


@pytest.mark.parametrize("native", [False, True, None])
def test_bf16_on_a_cpu_without_bf16_instructions_warns(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, native
) -> None:
    import attnlab.fast.training as training_module

    monkeypatch.setattr(training_module, "fast_bf16_matmul", lambda: native)
    train(tmp_path / "run", steps=1, precision="bf16", save_every=0, speedups=TrainingSpeedups())
    warned = "multiplies bf16 no faster than fp32" in capsys.readouterr().err
    assert warned == (native is False)  # unknown (not Linux): no warning


def test_grad_accum_of_half_batches_equals_one_full_batch(tmp_path: Path) -> None:
    common = {"steps": 5, "dropout": 0.0, "eval_every": 0, "save_every": 0}
    _, whole = train(tmp_path / "whole", batch_size=8, grad_accum=1, **common)
    _, halves = train(tmp_path / "halves", batch_size=4, grad_accum=2, **common)
    a, b = _weights(tmp_path / "whole", 5), _weights(tmp_path / "halves", 5)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-5)
    assert halves["loss"] == pytest.approx(whole["loss"], abs=1e-6)


def test_compiled_training_matches_eager_training(tmp_path: Path) -> None:
    common = {"steps": 3, "dropout": 0.0, "eval_every": 0, "save_every": 0}
    _, eager = train(tmp_path / "eager", **common)
    trainer, compiled = train(tmp_path / "compiled", compile=True, **common)
    assert trainer.network is not trainer.model  # the forward pass really ran compiled
    a, b = _weights(tmp_path / "eager", 3), _weights(tmp_path / "compiled", 3)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-4)
    assert compiled["loss"] == pytest.approx(eager["loss"], abs=1e-5)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("max_norm", [0.05, 1e9, math.inf])
def test_clipped_step_equals_torchs_clipping_then_step(fused: bool, max_norm: float) -> None:
    # With a fused or a foreach AdamW the step must equal torch's clip_grad_norm_ followed by
    # the same optimiser's step, and the norm returned be torch's.
    torch.manual_seed(2)
    models = [nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [build_optimizer(m, lr=1e-2, weight_decay=0.01, fused=fused) for m in models]
    x = torch.randn(8, 6)
    for _ in range(3):
        for m in models:
            (m(x) ** 2).sum().backward()
        expected = torch.nn.utils.clip_grad_norm_(models[0].parameters(), max_norm)
        opts[0].step()
        norm = TrainerHooks().clipped_step(opts[1], models[1].parameters(), max_norm)
        torch.testing.assert_close(norm, expected)
        for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        for opt in opts:
            opt.zero_grad(set_to_none=True)
    if max_norm == 0.05:
        assert float(expected) > 10 * max_norm  # the clipping did act


def test_on_best_is_called_exactly_when_the_tracked_metric_improves(tmp_path: Path) -> None:
    calls: list[float] = []

    def on_best(model: nn.Module, metrics: dict[str, float]) -> None:
        assert isinstance(model, TinyClassifier)  # the model itself, never a DDP wrapper
        calls.append(metrics["loss"])

    _, summary = train(
        tmp_path / "run",
        steps=30,
        eval_every=2,
        lr=5e-2,
        best_metric="loss",
        best_mode="min",
        on_best=on_best,
    )
    evals = [r for r in read_rows(tmp_path / "run" / "metrics.jsonl") if r.get("eval")]
    # The improvements, recomputed from the logged losses: a running minimum.
    expected, best = [], math.inf
    for row in evals:
        if row["loss"] < best:
            best = row["loss"]
            expected.append(row)
    assert 1 < len(expected) < len(evals)  # some evaluations improve, some do not
    assert calls == [r["loss"] for r in expected]
    assert [r["step"] for r in evals if r.get("best")] == [r["step"] for r in expected]
    assert summary["best"]["step"] == expected[-1]["step"]
    assert summary["best"]["loss"] == min(r["loss"] for r in evals)


def test_tokens_per_s_of_a_row_leaves_out_evaluation_and_checkpoint_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # metrics.jsonl's tokens_per_s counts training time only (fit()): before, the window
    # after an evaluation or a checkpoint started before them, so its row counted their
    # time too (here 0.5 s each against a few milliseconds of training).
    from attnlab.train import trainer as trainer_module

    real_save = trainer_module.save_checkpoint

    def slow_save(*args, **kwargs):
        time.sleep(0.5)
        return real_save(*args, **kwargs)

    def slow_evaluate(model: nn.Module) -> dict[str, float]:
        time.sleep(0.5)
        return {"score": 1.0}

    monkeypatch.setattr(trainer_module, "save_checkpoint", slow_save)
    seed_everything(0)
    config = TrainConfig(
        out_dir=tmp_path / "run", steps=6, log_every=2, eval_every=2, save_every=3,
        progress=False, device="cpu",
    )  # fmt: skip
    Trainer(TinyClassifier(), TensorBatches(make_data(), 8), config, slow_evaluate).fit()
    rows = [r for r in read_rows(tmp_path / "run" / "metrics.jsonl") if not r.get("eval")]
    assert [r["step"] for r in rows] == [2, 4, 6]  # 4: after step 2's evaluation, step 3's save
    for before, row in itertools.pairwise(rows):
        seconds = (row["tokens"] - before["tokens"]) / row["tokens_per_s"]
        assert seconds < 0.5, row


def test_tokens_per_s_of_a_row_resumed_mid_window_counts_the_time_before_the_checkpoint(
    tmp_path: Path,
) -> None:
    # The checkpoint of step 2 falls inside the window logged at step 4: the resumed run
    # restores the window's tokens of steps 1-2, and must restore their seconds too (before,
    # its row divided four steps' tokens by the two steps' time after the resume: 2x).
    def run(steps: int, resume: bool = False) -> None:
        seed_everything(0)
        config = TrainConfig(
            out_dir=tmp_path / "run", steps=steps, log_every=4, save_every=2,
            progress=False, device="cpu", resume=resume,
        )  # fmt: skip
        Trainer(TinyClassifier(), _SlowBatches(make_data(), 8, seed=1), config).fit()

    run(steps=3)  # its checkpoint of step 2, and a final one of step 3 (deleted: resume at 2)
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step-3")
    run(steps=4, resume=True)
    (row,) = read_rows(tmp_path / "run" / "metrics.jsonl")
    assert row["step"] == 4
    assert row["tokens"] / row["tokens_per_s"] >= 4 * 0.05  # four batches of 50 ms each


def test_eval_at_start_scores_step_0_once_and_changes_no_training(tmp_path: Path) -> None:
    train(tmp_path / "plain", steps=8)
    start = tmp_path / "start"
    train(start, steps=8, eval_at_start=True)
    evals = [r for r in _rows(start) if r.get("eval")]
    assert [r["step"] for r in evals] == [0, 3, 6, 8]
    seed_everything(0)  # the model as train() builds it, scored by hand
    fresh = TinyClassifier().eval()
    with torch.no_grad():
        expected = make_evaluate(make_data(32, seed=2))(fresh)
    assert evals[0] == {"step": 0, "eval": True, **expected}
    # the evaluation leaves every RNG as it was: the same weights as without it
    plain, scored = _weights(tmp_path / "plain", 8), _weights(start, 8)
    assert all(torch.equal(plain[k], scored[k]) for k in plain)
    # resumed from step 4, the step-0 row stays and is not redone
    resumed = tmp_path / "resumed"
    shutil.copytree(start, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-8")
    train(resumed, steps=8, eval_at_start=True, resume=True)
    assert _rows(resumed) == _rows(start)
    # a start killed before its first checkpoint runs again from step 0: one step-0 row
    restarted = tmp_path / "restarted"
    restarted.mkdir()
    (restarted / "metrics.jsonl").write_text(json.dumps(evals[0]) + "\n")
    train(restarted, steps=8, eval_at_start=True, resume=True)
    assert _rows(restarted) == _rows(start)


def test_resume_warning_says_when_warmup_moved_with_steps(tmp_path: Path, capsys) -> None:
    train(tmp_path / "run", steps=8, warmup=0)
    capsys.readouterr()
    train(tmp_path / "run", steps=12, warmup=1, resume=True)  # a job deriving it from --steps
    err = capsys.readouterr().err
    assert "warmup 1 (checkpoint: 0) (a job's default warm-up follows --steps" in err
    train(tmp_path / "run", steps=12, warmup=2, lr=2e-2, resume=True)  # steps unchanged
    err = capsys.readouterr().err
    assert "warmup 2 (checkpoint: 1)" in err and "follows --steps" not in err


def test_a_finished_run_resumed_reports_what_it_reported(tmp_path: Path) -> None:
    # Before, the summary rebuilt from metrics.jsonl carried the row's "best": true flag
    # among the metrics (finetune wrote it into results.json).
    out = tmp_path / "run"
    _, first = train(out, steps=6, eval_every=3, save_every=3, best_metric="loss", best_mode="min")
    assert [r.get("best") for r in _rows(out) if r.get("eval")][-1] is True
    _, again = train(out, steps=6, eval_every=3, save_every=3, best_metric="loss",
                     best_mode="min", resume=True)  # fmt: skip
    assert again["eval"] == first["eval"] and "best" not in again["eval"]
    assert again["loss"] == first["loss"] and again["best"] == first["best"]


def test_metrics_rows_are_strict_json_with_null_for_nan(tmp_path: Path) -> None:
    from attnlab.train.log import MetricsLog

    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.append({"step": 1, "loss": float("nan"), "eval": True, "pearson": float("inf")})
    line = (tmp_path / "metrics.jsonl").read_text()
    assert json.loads(line) == {"step": 1, "loss": None, "eval": True, "pearson": None}
    assert "NaN" not in line and "Infinity" not in line  # was bare NaN: not JSON


def test_best_metric_must_be_one_the_evaluation_returns(tmp_path: Path) -> None:
    with pytest.raises(AttnlabError, match="best_metric 'f1' is not among"):
        train(tmp_path / "run", steps=4, eval_every=2, best_metric="f1")


class _SlowBatches(TensorBatches):
    def __iter__(self):
        for batch in super().__iter__():
            time.sleep(0.05)
            yield batch


def test_max_seconds_stops_with_a_checkpoint_and_a_resume_continues(tmp_path: Path) -> None:
    from _trainer_run import make_evaluate

    def run(**options: object) -> dict:
        seed_everything(0)
        config = TrainConfig(
            out_dir=tmp_path / "run",
            steps=200,
            log_every=1,
            save_every=0,
            progress=False,
            device="cpu",
            **options,
        )
        batches = _SlowBatches(make_data(), 8, seed=1)
        evaluate = make_evaluate(make_data(32, seed=2))
        return Trainer(TinyClassifier(), batches, config, evaluate=evaluate).fit()

    first = run(max_seconds=0.5)
    assert 3 <= first["step"] < 200  # stopped by the clock, not by steps
    assert first["checkpoint"] == str(tmp_path / "run" / "checkpoints" / f"step-{first['step']}")
    assert first["eval"]  # the early stop counts as the end: evaluated and saved
    second = run(max_seconds=1.0, resume=True)
    assert first["step"] < second["step"] < 200
    rows = [r for r in read_rows(tmp_path / "run" / "metrics.jsonl") if not r.get("eval")]
    assert [r["step"] for r in rows] == list(range(1, second["step"] + 1))
    assert rows[-1]["elapsed_s"] >= 1.0


def test_a_clock_running_out_during_an_evaluation_still_ends_with_a_checkpoint(
    tmp_path: Path,
) -> None:
    # The limit passes while step 2's evaluation runs (after step 2 was found in time).
    # Before, the loop's own check then ended training at once: no final row, evaluation or
    # checkpoint (none at all here), and a resume would redo the steps.
    slept: list[bool] = []

    def evaluate(model: nn.Module) -> dict[str, float]:
        if not slept:
            slept.append(True)
            time.sleep(1.0)
        return {"score": 1.0}

    seed_everything(0)
    config = TrainConfig(
        out_dir=tmp_path / "run", steps=200, log_every=5, eval_every=2, save_every=0,
        max_seconds=1.0, progress=False, device="cpu",
    )  # fmt: skip
    summary = Trainer(TinyClassifier(), TensorBatches(make_data(), 8), config, evaluate).fit()
    step = summary["step"]
    assert step == 3  # the step after the evaluation finds the clock out and ends the run
    assert summary["checkpoint"] == str(tmp_path / "run" / "checkpoints" / f"step-{step}")
    rows = read_rows(tmp_path / "run" / "metrics.jsonl")
    assert [(r["step"], bool(r.get("eval"))) for r in rows] == [(2, True), (3, False), (3, True)]


def test_steps_within_a_time_limit() -> None:
    assert steps_within(10_000, 10, 10.0, 60.0, 2.0) == 110  # 50 s left at 2 steps/s
    assert steps_within(50, 10, 10.0, 60.0, 2.0) == 50  # the step count ends it first
    assert steps_within(10_000, 10, 70.0, 60.0, 2.0) == 10  # past the limit: stops now
    assert steps_within(10_000, 0, 0.0, 60.0, None) == 10_000  # no rate measured yet


def test_progress_bar_of_a_time_limited_run_counts_to_where_the_clock_stops_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run of a million steps and half a second: its bar's total and ETA follow the clock."""
    seed_everything(0)
    config = TrainConfig(
        out_dir=tmp_path / "run", steps=1_000_000, log_every=1, save_every=0,
        max_seconds=0.5, device="cpu",
    )  # fmt: skip
    result = Trainer(TinyClassifier(), _SlowBatches(make_data(), 8, seed=1), config).fit()
    counts = re.findall(r"\| *(\d+)/(\d+) \[", capsys.readouterr().err)
    assert len(counts) >= 3
    done, total = map(int, counts[-1])
    assert done == result["step"] and total < 1_000  # ~20 steps/s for the 0.5 s left


# ---- resume -------------------------------------------------------------------------------


def test_resume_after_two_sigkills_is_bit_identical_to_an_uninterrupted_run(
    tmp_path: Path,
) -> None:
    """Killed while writing the step-8 checkpoint, then mid-step 10; resumed each time."""
    ref, run = tmp_path / "uninterrupted", tmp_path / "killed"
    job = {"steps": 12, "batch_size": 4, "grad_accum": 2}
    reference = _forked(ref, **job)  # runs alongside the killed chain

    assert exit_code(_forked(run, kill_in_save=8, **job)) == -signal.SIGKILL
    checkpoints = run / "checkpoints"
    (partial,) = checkpoints.glob(".step-8.*.tmp")  # the kill came mid-write
    assert (partial / "trainer.pt").is_file() and not (partial / "COMPLETE").exists()
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-4"]

    # Resumes from step 4; killed at its 12th micro-batch, the 2nd of step 10, after step 8
    # was saved: a backward pass has run that no checkpoint holds.
    resumed = _forked(run, resume=True, kill_at_batch=12, **job)
    assert exit_code(resumed) == -signal.SIGKILL
    assert not list(checkpoints.glob(".step-*"))
    assert max(r["step"] for r in read_rows(run / "metrics.jsonl")) == 9

    assert exit_code(_forked(run, resume=True, **job)) == 0
    assert exit_code(reference) == 0
    final, expected = _weights(run, 12), _weights(ref, 12)
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[name], expected[name]) for name in expected)
    assert _rows(run) == _rows(ref)
    assert [r["step"] for r in _rows(ref) if not r.get("eval")] == list(range(1, 13))
    state, ref_state = (
        torch.load(r / "checkpoints/step-12/trainer.pt", weights_only=True) for r in (run, ref)
    )
    for key, moments in ref_state["optimizer"]["state"].items():
        assert all(torch.equal(moments[m], state["optimizer"]["state"][key][m]) for m in moments)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-12", "step-8"]


def test_a_kill_before_the_last_checkpoint_pruned_the_old_ones_leaves_keep_last(tmp_path):
    """Killed once the final checkpoint is in place, before the one beyond --keep-last went."""
    run = tmp_path / "run"
    job = {"steps": 8, "keep_last": 1, "eval_every": 0}
    assert exit_code(_forked(run, kill_in_prune=8, **job)) == -signal.SIGKILL
    checkpoints = run / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-4", "step-8"]
    # The resumed run has no step left to train, so no save of its own would prune them:
    # before, step-4 stayed for good (a whole model and optimiser state beyond keep_last 1).
    assert exit_code(_forked(run, resume=True, **job)) == 0
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-8"]


@pytest.mark.parametrize("damaged", ["model.safetensors", "trainer.pt"])
def test_a_corrupt_checkpoint_is_named_and_nothing_is_overwritten(
    tmp_path: Path, damaged: str
) -> None:
    out = tmp_path / "run"
    train(out, steps=4, save_every=2, eval_every=0)
    target = out / "checkpoints" / "step-4" / damaged
    target.write_bytes(target.read_bytes()[:40])
    before = _snapshot(out)
    with pytest.raises(AttnlabError) as error:
        train(out, steps=6, save_every=2, eval_every=0, resume=True)
    message = str(error.value)
    assert "step-4" in message and "unreadable" in message and "\n" not in message
    assert _snapshot(out) == before


def test_a_strategy_other_than_ddp_or_fsdp_is_refused(tmp_path: Path) -> None:
    refused = r"^train: strategy must be one of \['ddp', 'fsdp'\], got 'zero3'$"
    with pytest.raises(AttnlabError, match=refused):
        TrainConfig(out_dir=tmp_path, steps=1, strategy="zero3")
    with pytest.raises(AttnlabError, match=r"^train: strategy fsdp does not combine with compile$"):
        TrainConfig(out_dir=tmp_path, steps=1, strategy="fsdp", compile=True)
    assert TrainConfig(out_dir=tmp_path, steps=1, strategy="fsdp").strategy == "fsdp"


def test_an_existing_run_needs_resume_or_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "run"
    train(out, steps=2, save_every=2, eval_every=0)
    before = _snapshot(out)
    with pytest.raises(AttnlabError, match=r"holds a run: pass resume .* or overwrite"):
        train(out, steps=3, save_every=3, eval_every=0)
    assert _snapshot(out) == before
    with pytest.raises(AttnlabError, match="not both"):
        TrainConfig(out_dir=out, steps=3, resume=True, overwrite=True)

    train(out, steps=3, save_every=3, eval_every=0, overwrite=True)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-3"]
    assert [r["step"] for r in read_rows(out / "metrics.jsonl")] == [1, 2, 3, 3]  # 3: eval


def test_sigterm_during_a_save_leaves_the_last_complete_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    real_save = torch.save

    def save_then_sigterm(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        if Path(f).parent.name.startswith(".step-4."):
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(torch, "save", save_then_sigterm)
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        train(out, steps=6, save_every=2, eval_every=0, keep_last=0)
    assert signal.getsignal(signal.SIGTERM) is handler
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2"]


# ---- distributed --------------------------------------------------------------------------


def test_two_ddp_processes_match_one_process_on_the_same_global_batch(tmp_path: Path) -> None:
    job = ["--steps", "6", "--batch-size", "8", "--dropout", "0"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", "2", str(HELPER), "--out", str(tmp_path / "ddp"), *job]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ddp = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    _, single = train(tmp_path / "single", steps=6, batch_size=8, dropout=0.0)
    try:
        output, _ = ddp.communicate(timeout=180)
    finally:
        ddp.kill()  # a no-op once it has exited
    assert ddp.returncode == 0, output.decode()[-3000:]

    a, b = _weights(tmp_path / "single", 6), _weights(tmp_path / "ddp", 6)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-4)
    rows = _rows(tmp_path / "ddp")  # written once, by rank 0, with the all-reduced mean loss
    single_rows = _rows(tmp_path / "single")
    assert [r["step"] for r in rows] == [r["step"] for r in single_rows]
    for row, expected in zip(rows, single_rows, strict=True):
        assert row["loss"] == pytest.approx(expected["loss"], abs=1e-5)
        assert row.get("tokens") == expected.get("tokens")
    (line,) = [s for s in output.decode().splitlines() if s.startswith('{"step"')]
    summary = json.loads(line)
    assert summary["step"] == 6 and summary["loss"] == pytest.approx(single["loss"], abs=1e-5)


def test_resuming_with_another_number_of_processes_keeps_the_mean_of_a_logging_window(
    tmp_path: Path, capsys
) -> None:
    # A checkpoint inside a logging window holds its sums over the saving run's ranks. Before,
    # a 2-process run resumed with 1 process divided them by 1 rank: the row after the resume
    # showed about 1.5x the loss (and 1 -> 2 processes about 0.75x).
    job = ["--steps", "6", "--batch-size", "8", "--dropout", "0"]
    job += ["--log-every", "2", "--save-every", "3"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", "2", str(HELPER), "--out", str(tmp_path / "ddp"), *job]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ddp = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "ddp", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-6")  # resume from step 3, mid-window
    train(resumed, steps=6, batch_size=8, dropout=0.0, log_every=2, save_every=3, resume=True)
    # Before, the change went unsaid, unlike a changed learning rate or seed.
    assert "with 1 process(es) (checkpoint: 2): it goes on" in capsys.readouterr().err
    rows = [r for r in _rows(resumed) if not r.get("eval")]
    expected = [r for r in _rows(tmp_path / "ddp") if not r.get("eval")]
    assert [r["step"] for r in rows] == [r["step"] for r in expected] == [2, 4, 6]
    for row, want in zip(rows, expected, strict=True):
        assert row["loss"] == pytest.approx(want["loss"], abs=1e-5)
        assert row["accuracy"] == pytest.approx(want["accuracy"], abs=1e-5)


def test_workers_end_with_a_sigkilled_launcher(tmp_path: Path) -> None:
    # torchrun starts each worker in a session of its own: its launcher SIGKILLed (or its
    # process group), they trained on as orphans, and a job resumed at once had two runs
    # writing one --out (pretrain, 150 steps: metrics.jsonl ended 146, 150, 148, 150, 150).
    out = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", "2", str(HELPER), "--out", str(out), "--steps", "100000"]
    command += ["--kill-launcher-at-batch", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # No pipes: an orphan holding one open would keep the test waiting.
    launcher = subprocess.run(command, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=180)  # fmt: skip
    assert launcher.returncode == -signal.SIGKILL
    workers = [int(path.read_text()) for path in tmp_path.glob("run.rank*.pid")]
    assert len(workers) == 2
    deadline = time.monotonic() + 10
    while any(map(running, workers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    orphans = [pid for pid in workers if running(pid)]
    for pid in orphans:  # a failing test leaves none behind
        os.kill(pid, signal.SIGKILL)
    assert not orphans


def _job_options(tmp_path: Path) -> list:
    """One options object of each training job, valid as built."""
    from attnlab.tasks.distill import DistillOptions
    from attnlab.tasks.finetune import FinetuneOptions
    from attnlab.tasks.pretrain import PretrainOptions
    from attnlab.tasks.translate import TranslateOptions

    return [
        PretrainOptions(out=tmp_path / "p"),
        DistillOptions(teacher=tmp_path / "t", out=tmp_path / "d", student_layers=2),
        FinetuneOptions(
            task="classify", model=tmp_path / "m", train=tmp_path / "f.tsv", out=tmp_path / "f"
        ),
        TranslateOptions(out=tmp_path / "tr"),
    ]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"resume": True, "overwrite": True}, "resume and overwrite contradict"),
        ({"precision": "fp16"}, "precision must be one of fp32, bf16"),
        ({"log_every": 0}, "log_every must be at least 1"),
    ],
)
def test_every_job_checks_the_shared_run_options(
    tmp_path: Path, change: dict, message: str
) -> None:
    for opts in _job_options(tmp_path):
        opts.validate()  # valid as built
        for name, value in change.items():
            setattr(opts, name, value)
        with pytest.raises(AttnlabError, match=message):
            opts.validate()


def test_jobs_keep_their_own_run_defaults(tmp_path: Path) -> None:
    pretrain, distill, finetune, translate = _job_options(tmp_path)
    assert (pretrain.save_every, pretrain.keep_last, pretrain.eval_every) == (500, 3, 0)
    assert (distill.save_every, distill.keep_last, distill.log_every) == (500, 3, 10)
    assert (finetune.save_every, finetune.keep_last, finetune.eval_every) == (1000, 1, None)
    assert (translate.keep_last, translate.log_every) == (5, 50)
    assert translate.save_every == translate.eval_every == 100  # the bundled sample's


# ---- one run per output directory ---------------------------------------------------------


def _held_lock(out: Path, holder: str) -> int:
    """Lock out as a run in another process would (.NAME.lock beside it, holding 'PID HOST')."""
    fd = os.open(out.with_name(f".{out.name}.lock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, holder.encode())
    return fd


def test_every_training_job_is_refused_while_another_run_holds_its_out(tmp_path: Path) -> None:
    # Before: a second job into the --out of a running one trained beside it (pretrain,
    # distill, finetune and translate train alike).
    from attnlab.tasks.distill import distill
    from attnlab.tasks.finetune import finetune
    from attnlab.tasks.pretrain import pretrain
    from attnlab.tasks.translate import train_translation

    jobs = [pretrain, distill, finetune, train_translation]
    for job, opts in zip(jobs, _job_options(tmp_path), strict=True):
        opts.steps = 1  # on a failure, a short run
        held = _held_lock(opts.out, "4242 elsewhere\n")  # a run on another machine
        try:
            with pytest.raises(AttnlabError) as error:
                job(opts)
        finally:
            os.close(held)
        assert str(error.value) == (
            f"another run (pid 4242 on elsewhere) is training in {opts.out}: wait for it to "
            "end or choose another --out"
        )
        assert not opts.out.exists()


def test_fit_is_refused_while_another_run_holds_out_however_it_is_spelled(
    tmp_path: Path,
) -> None:
    out, link = tmp_path / "run", tmp_path / "link"
    out.mkdir()
    link.symlink_to(out)
    held = _held_lock(out, f"{os.getpid()} {socket.gethostname()}\n")
    try:
        for spelled in (out, link, tmp_path / "sub" / ".." / "run"):
            with pytest.raises(AttnlabError, match=rf"^another run \(pid {os.getpid()}\) is "):
                train(spelled, steps=2, eval_every=0)
        assert not any(out.iterdir())
        train(tmp_path / "runs", steps=2, eval_every=0)  # a neighbour of another name trains
    finally:
        os.close(held)
    train(out, steps=2, eval_every=0)
    assert (out / "checkpoints" / "step-2").is_dir()
    assert not (tmp_path / ".run.lock").exists()  # the lock file goes with the run


def test_a_file_system_without_locks_trains_unlocked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    def unsupported(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", unsupported)
    out = tmp_path / "run"
    train(out, steps=2, eval_every=0)
    assert (out / "checkpoints" / "step-2").is_dir()
    assert f"note: --out {out} cannot be locked (No locks available)" in capsys.readouterr().err


def test_a_lock_file_is_neither_content_nor_leftover(tmp_path: Path) -> None:
    from attnlab.io import check_out_dir, contents, remove_leftovers

    (tmp_path / ".run.lock").write_text("4242 host\n")  # a SIGKILLed run's
    assert contents(tmp_path) == []
    check_out_dir(tmp_path)  # an export or tokenizer into the folder: not refused
    remove_leftovers(tmp_path)  # a run's clean-up of its --out leaves it: it may be held
    assert (tmp_path / ".run.lock").is_file()

    from attnlab.io import lock_out_dir

    with lock_out_dir(tmp_path / "new" / "deeper" / "run") as locked:
        assert locked and (tmp_path / "new" / "deeper" / ".run.lock").is_file()
    assert not (tmp_path / "new").exists()  # the folders made for the lock went with it


# ---- the allocator --------------------------------------------------------------------------

_MAPPED_BYTES = """
import ctypes, os, sys, tempfile
from pathlib import Path
import torch
sys.path.insert(0, sys.argv[1])
from _trainer_run import train
from attnlab.fast import TrainingSpeedups

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
with tempfile.TemporaryDirectory() as out:
    speedups = None if sys.argv[2] == "plain" else TrainingSpeedups()
    train(Path(out) / "run", steps=1, save_every=0, eval_every=0, speedups=speedups)
before = libc.mallinfo2().hblkhd
block = torch.empty(16 * 2**20)  # 64 MB: above any mmap threshold glibc picks by itself
print(libc.mallinfo2().hblkhd - before)
"""


@pytest.mark.skipif(
    sys.platform != "linux" or os.confstr("CS_GNU_LIBC_VERSION") is None,
    reason="glibc's malloc settings",
)
@pytest.mark.parametrize("setting", ["keep", "default", "plain"])
def test_the_trainer_keeps_large_blocks_in_the_heap_unless_told_not_to(setting: str) -> None:
    # A 64 MB tensor after training started: glibc maps it (and unmaps it when freed, so the
    # next step faults it in again) unless the trainer's speed-ups told malloc to keep freed
    # memory: not when keep_freed_memory is left out, nor for a trainer without speed-ups.
    speedups = "-keep_freed_memory" if setting == "default" else "all"
    env = {**os.environ, "ATTNLAB_SPEEDUPS": speedups}
    child = subprocess.run(
        [sys.executable, "-c", _MAPPED_BYTES, str(Path(__file__).parent), setting],
        env=env, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    mapped = int(child.stdout.strip().splitlines()[-1])
    if setting == "keep":
        assert mapped == 0
    else:
        assert mapped >= 64 * 2**20


_RELEASED_BYTES = """
import time
from pathlib import Path
import torch
from attnlab.fast import TrainingSpeedups
from attnlab.fast.training import keep_freed_memory

def resident() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

hooks = TrainingSpeedups("all")
keep_freed_memory()
block = torch.ones(64 * 2**20)  # 256 MB, touched: resident
del block  # kept by malloc for the next step
held = resident()
hooks.after_step(None)  # not yet due: nothing changes
not_due = resident()
hooks.released_at = time.monotonic() - hooks.RELEASE_SECONDS
hooks.after_step(None)
print(held - not_due, held - resident())
"""


@pytest.mark.skipif(
    sys.platform != "linux" or os.confstr("CS_GNU_LIBC_VERSION") is None,
    reason="glibc's malloc settings",
)
def test_memory_kept_for_the_next_step_goes_back_once_a_release_is_due() -> None:
    # keep_freed_memory holds freed blocks in the heap; without a periodic release a run whose
    # temporaries change size (translation, evaluation) grew without bound. The process's own
    # resident size (the kernel's count) must fall by the freed 256 MB when a release is due.
    child = subprocess.run(
        [sys.executable, "-c", _RELEASED_BYTES], capture_output=True, text=True, timeout=300,
        check=True,
    )  # fmt: skip
    before_due, released = map(int, child.stdout.split())
    assert abs(before_due) < 16 * 2**20
    assert released >= 240 * 2**20


def test_an_unknown_speedup_name_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNLAB_SPEEDUPS", "-keep_memory")
    with pytest.raises(AttnlabError, match="unknown speed-up keep_memory: choose from"):
        TrainingSpeedups()


class _NumpyStateBatches(TensorBatches):
    def state_dict(self) -> dict:
        import numpy as np

        return {**super().state_dict(), "where": np.int64(3)}


def test_plain_mistakes_with_the_python_api_are_clear_errors(tmp_path: Path, capsys) -> None:
    # Raw AttributeError, StopIteration or TypeError before; a checkpoint that could not be read
    # back (its state held numpy scalars) whose error said to delete it.
    def config(**options: object) -> TrainConfig:
        return TrainConfig(out_dir=tmp_path / "run", progress=False, device="cpu", **options)

    data = make_data()
    with pytest.raises(AttnlabError, match=r"train: steps must be an integer, got 4\.5"):
        config(steps=4.5)
    with pytest.raises(AttnlabError, match=r"batches must be a BatchSource .* list is not"):
        Trainer(TinyClassifier(), [data] * 4, config(steps=4))
    with pytest.raises(AttnlabError, match="on_best needs a best_metric"):
        Trainer(TinyClassifier(), TensorBatches(data, 8), config(steps=4), on_best=print)

    class Ending(TensorBatches):
        def __iter__(self):
            return iter([{k: v[:8] for k, v in data.items()}] * 3)

    with pytest.raises(AttnlabError, match="the batches ran out at step 4"):
        Trainer(TinyClassifier(), Ending(data, 8), config(steps=5, overwrite=True)).fit()

    class Tuples(TensorBatches):
        def __iter__(self):
            return ((b["input_ids"], b["labels"]) for b in super().__iter__())

    with pytest.raises(AttnlabError, match=r"a batch must be a dict .* got a tuple"):
        Trainer(TinyClassifier(), Tuples(data, 8), config(steps=2, overwrite=True)).fit()
    for result, fragment in ((0.5, "must return a dict of named numbers, got float"),
                             ({"acc": "high"}, r"evaluate\(model\)\['acc'\] is not a number")):  # fmt: skip
        trainer = Trainer(
            TinyClassifier(), TensorBatches(data, 8), config(steps=2, eval_every=1, overwrite=True),
            evaluate=lambda model, r=result: r,
        )  # fmt: skip
        with pytest.raises(AttnlabError, match=fragment):
            trainer.fit()
    batches = _NumpyStateBatches(data, 8)
    with pytest.raises(AttnlabError, match=r"state_dict\(\)\['where'\] holds a int64"):
        Trainer(TinyClassifier(), batches, config(steps=2, save_every=1, overwrite=True)).fit()


def test_resuming_a_linear_schedule_with_more_steps_warns(tmp_path: Path, capsys) -> None:
    train(tmp_path / "run", steps=4, save_every=2)
    capsys.readouterr()
    train(tmp_path / "run", steps=8, save_every=2, resume=True)
    assert "the linear decay is stretched to the new last step" in capsys.readouterr().err


def test_a_librarys_write_error_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    # A full disk reaches safetensors and torch.save as their own errors (SafetensorError,
    # RuntimeError "unexpected pos"), not OSError: they were tracebacks.
    from attnlab.io import write_with_atomic
    from attnlab.train import checkpoint

    def full_disk(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64\nmore")

    def writer(tmp):
        tmp.write_bytes(b"partial")
        full_disk()

    with pytest.raises(AttnlabError, match=r"cannot write .*weights\.bin: \[enforce fail"):
        write_with_atomic(tmp_path / "weights.bin", writer)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(checkpoint.torch, "save", full_disk)
    with pytest.raises(AttnlabError, match=r"cannot write .*step-3: \[enforce fail"):
        checkpoint.save_checkpoint(tmp_path / "checkpoints", 3, nn.Linear(2, 2), {"step": 3})
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_a_replaced_file_keeps_its_permissions(tmp_path):
    # predict --output x --overwrite onto a private (0600) x, a resumed run's metrics.jsonl, a
    # translation model's weights: the new file came with the umask's 0644, readable by all.
    from attnlab import io

    for write in (
        lambda path: io.write_text_atomic(path, "new\n"),
        lambda path: io.write_with_atomic(path, lambda tmp: tmp.write_text("new\n")),
    ):
        path = tmp_path / "private.jsonl"
        path.write_text("old\n")
        path.chmod(0o600)
        write(path)
        assert path.read_text() == "new\n" and path.stat().st_mode & 0o777 == 0o600
        path.unlink()


def test_an_out_filled_while_a_staged_write_ran_is_not_replaced(tmp_path):
    # Two exports (or tokenizer trainings) into one new --out at once: each checked that out
    # was free when it began, and the one that finished last deleted the other's output.
    from attnlab import io

    out = tmp_path / "model"
    filled = pytest.raises(AttnlabError, match="filled by another command")
    with filled as caught, io.staged_dir(out) as stage:
        (stage / "mine.txt").write_text("mine")
        out.mkdir()
        (out / "theirs.txt").write_text("theirs")  # the other command, done first
    assert "--overwrite" in str(caught.value)
    assert os.listdir(out) == ["theirs.txt"] and os.listdir(tmp_path) == ["model"]
    # an empty folder (or one with only a killed write's temp files) is still no output
    (out / "theirs.txt").unlink()
    (out / f".x.{'0' * 32}.tmp").write_text("")
    with io.staged_dir(out) as stage:
        (stage / "mine.txt").write_text("mine")
    assert os.listdir(out) == ["mine.txt"] and os.listdir(tmp_path) == ["model"]
    with io.staged_dir(out, overwrite=True) as stage:
        (stage / "again.txt").write_text("again")
    assert os.listdir(out) == ["again.txt"] and os.listdir(tmp_path) == ["model"]


@pytest.mark.parametrize("writer", ["write_bytes_atomic", "write_with_atomic", "staged_dir"])
def test_a_read_only_disk_is_named_at_the_users_path(tmp_path, monkeypatch, writer):
    # A read-only file system refuses even the unlink of a temp file that was never made, and
    # that error replaced the real one: "Read-only file system: DIR/.notes.txt.<hex>.tmp".
    import errno

    from attnlab import io

    def read_only(path, *args, **kwargs):
        if Path(path).exists():  # what Linux says first, as for a folder that is there
            raise FileExistsError(errno.EEXIST, "File exists", str(path))
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(io, "open", read_only, raising=False)  # before the builtin
    monkeypatch.setattr(io.os, "mkdir", read_only)
    monkeypatch.setattr(io.os, "unlink", read_only)
    target = tmp_path / "notes.txt"
    with pytest.raises(OSError) as caught:
        if writer == "staged_dir":
            with io.staged_dir(target):
                pass
        elif writer == "write_with_atomic":
            io.write_with_atomic(target, read_only)
        else:
            io.write_bytes_atomic(target, b"x")
    assert (caught.value.errno, caught.value.filename) == (errno.EROFS, str(target))


def test_write_errors_name_the_users_path_not_the_temp_file(tmp_path, monkeypatch):
    # A full disk surfaces while the temp file (.NAME.<hex>.tmp) or staged directory is
    # written; the error named that path, which the user never gave and which is gone.
    import errno

    from attnlab import io

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    def library_error(tmp):
        raise RuntimeError("unexpected pos 64")

    monkeypatch.setattr(io.os, "fsync", no_space)
    with pytest.raises(OSError) as caught:
        io.write_bytes_atomic(tmp_path / "notes.txt", b"x")
    assert (caught.value.errno, caught.value.filename) == (
        errno.ENOSPC,
        str(tmp_path / "notes.txt"),
    )
    out = tmp_path / "model"
    with pytest.raises(OSError) as caught, io.staged_dir(out) as stage:
        io.write_bytes_atomic(stage / "weights.bin", b"x")
    assert (caught.value.errno, caught.value.filename) == (errno.ENOSPC, str(out / "weights.bin"))
    monkeypatch.undo()
    with pytest.raises(AttnlabError) as named, io.staged_dir(out) as stage:
        io.write_with_atomic(stage / "model.safetensors", library_error)
    assert str(named.value) == f"cannot write {out / 'model.safetensors'}: unexpected pos 64"
    assert list(tmp_path.iterdir()) == []
    # a checkpoint is written in a temp directory beside step-<N> too
    from attnlab.train import checkpoint

    monkeypatch.setattr(checkpoint.os, "fsync", no_space)
    with pytest.raises(OSError) as caught:
        checkpoint.save_checkpoint(tmp_path / "checkpoints", 3, nn.Linear(2, 2), {"step": 3})
    assert caught.value.filename.startswith(str(tmp_path / "checkpoints" / "step-3"))
    assert list((tmp_path / "checkpoints").iterdir()) == []
