"""`attnlab pretrain` end to end: outputs, resume after SIGKILL, two processes, config files, errors."""

from __future__ import annotations

import fcntl
import gzip
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import SHARED_DATA, assert_same_run
from safetensors.torch import load_file, save_file

from attnlab.cli import main
from attnlab.train import read_rows

RUNNER = Path(__file__).parent / "_pretrain_run.py"
BENCH_COMMON = Path(__file__).parents[1] / "bench" / "common.py"
SHAPE = ["--preset", "bert-tiny", "--batch-size", "8", "--seq-len", "32"]  # for --tokenizer runs
TINY = [*SHAPE, "--vocab-size", "400"]


def _bench_common():
    """bench/common.py, the benchmarks' helpers (the synthetic pretraining batch)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_common", BENCH_COMMON)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """~300 real multi-sentence Chinese review documents plus English play lines."""
    folder = tmp_path_factory.mktemp("corpus")
    with gzip.open(SHARED_DATA / "zh-corpus/reviews.txt.gz", "rt", encoding="utf-8") as f:
        zh = list(itertools.islice(f, 900))
    with gzip.open(SHARED_DATA / "tinyshakespeare/input.txt.gz", "rt", encoding="utf-8") as f:
        en = list(itertools.islice(f, 600))
    path = folder / "mixed.txt"
    path.write_text("".join(zh) + "\n" + "".join(en), encoding="utf-8")
    return path


def _command(args: list[str], processes: int = 1) -> list[str]:
    """`attnlab ARGS` through RUNNER (its kill hooks): in one process, or under torchrun."""
    if processes == 1:
        return [sys.executable, str(RUNNER), *args]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
    torchrun += ["--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
    return [*torchrun, str(RUNNER), *args]


def _run(
    args: list[str], env: dict[str, str] | None = None, processes: int = 1
) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        _command(args, processes), capture_output=True, text=True, env=full_env, timeout=300
    )


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model.safetensors"))


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_pretrain_writes_an_hf_checkpoint_and_learns(corpus, tmp_path, capsys):
    from transformers import BertForPreTraining as HFPreTraining

    out = tmp_path / "run"
    args = ["pretrain", "--corpus", str(corpus), "--out", str(out), *TINY, "--steps", "40"]
    args += ["--lr", "1e-3", "--warmup", "4", "--save-every", "10", "--keep-last", "2"]
    args += ["--eval-every", "20", "--log-every", "5", "--cache-dir", str(tmp_path / "cache")]
    assert main(args) == 0
    for name in ("config.json", "model.safetensors", "vocab.txt", "metrics.jsonl", "loss.png"):
        assert (out / name).is_file(), name
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-30", "step-40"]
    rows = _rows(out)
    train_rows = [r for r in rows if not r.get("eval")]
    assert [r["step"] for r in train_rows] == list(range(5, 41, 5))
    for row in train_rows:
        assert {"step", "loss", "lr", "tokens_per_s", "mlm_loss", "nsp_loss"} <= set(row)
    assert train_rows[-1]["mlm_loss"] < train_rows[0]["mlm_loss"] - 0.3  # it learns
    evals = [r for r in rows if r.get("eval")]
    assert [r["step"] for r in evals] == [20, 40]
    assert 0 <= evals[-1]["eval_mlm_accuracy"] <= 1 and "eval_nsp_accuracy" in evals[-1]
    # HF transformers loads the result with nothing missing or unexpected
    _, info = HFPreTraining.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    capsys.readouterr()
    assert main(["fill-mask", "--model", str(out), "--json", "今天天气很[MASK]。[MASK]"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["masks"]) == 2
    for options in result["masks"]:
        probs = [p for _, p in options]
        assert len(options) == 5 and probs == sorted(probs, reverse=True) and sum(probs) <= 1.0


@pytest.fixture(scope="module")
def vocab(corpus, tmp_path_factory) -> Path:
    """One WordPiece vocabulary of 400 tokens, trained once, for runs that must match bit for bit.

    Two runs that each train their vocabulary get the same one (see
    test_a_second_run_training_its_vocabulary_reuses_the_corpus_cache); one trained here keeps
    the runs small and spares each its training.
    """
    out = tmp_path_factory.mktemp("vocab") / "tok"
    assert (
        main(
            [
                "tokenizer",
                "train",
                "--corpus",
                str(corpus),
                "--vocab-size",
                "400",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    return out


def test_a_second_run_training_its_vocabulary_reuses_the_corpus_cache(
    corpus, tmp_path, monkeypatch
):
    # Each run trained another vocabulary (HF tokenizers broke ties in hash-map order), so
    # the cache key changed and the corpus was tokenized again: on zh-corpus reviews two
    # identical runs left two caches and vocabularies of 6,425 and 6,427 tokens.
    from attnlab.text import corpus_cache

    args = ["pretrain", "--corpus", str(corpus), *SHAPE, "--steps", "1"]
    args += ["--cache-dir", str(tmp_path / "cache")]
    assert main([*args, "--out", str(tmp_path / "first")]) == 0

    def refuse(tokenizer, sentences):
        raise AssertionError("the second run tokenized the corpus again")

    monkeypatch.setattr(corpus_cache, "_encode_chunk", refuse)
    assert main([*args, "--out", str(tmp_path / "second")]) == 0
    assert len(list((tmp_path / "cache").iterdir())) == 1
    vocab = [(tmp_path / run / "vocab.txt").read_bytes() for run in ("first", "second")]
    assert vocab[0] == vocab[1]
    assert _weights(tmp_path / "first").keys() == _weights(tmp_path / "second").keys()
    for name, value in _weights(tmp_path / "first").items():
        assert torch.equal(value, _weights(tmp_path / "second")[name]), name


def test_resume_after_sigkill_is_bit_identical(corpus, vocab, tmp_path):
    """Two kills (one mid-step, one inside a checkpoint write) change nothing."""
    base = [*SHAPE, "--corpus", str(corpus), "--steps", "12", "--save-every", "3"]
    base += ["--tokenizer", str(vocab)]
    base += ["--log-every", "1", "--cache-dir", str(tmp_path / "cache"), "--eval-every", "6"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    done = _run(["pretrain", *base, "--out", str(straight)])
    assert done.returncode == 0, done.stderr[-2000:]

    first = _run(["pretrain", *base, "--out", str(killed)], {"ATTNLAB_KILL_AT_BATCH": "5"})
    assert first.returncode == -9  # SIGKILL during step 5 (checkpoint of step 3 exists)
    second = _run(
        ["pretrain", *base, "--out", str(killed), "--resume"], {"ATTNLAB_KILL_IN_SAVE": "9"}
    )
    assert second.returncode == -9  # SIGKILL while writing the checkpoint of step 9
    assert not (killed / "checkpoints" / "step-9").exists()
    third = _run(["pretrain", *base, "--out", str(killed), "--resume"])
    assert third.returncode == 0, third.stderr[-2000:]

    assert_same_run(straight, killed)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_equal_one(corpus, vocab, tmp_path):
    """torchrun with 2 CPU processes (gloo) = one process with the same global batch."""
    base = [*SHAPE, "--corpus", str(corpus), "--steps", "4", "--save-every", "0", "--dropout", "0"]
    base += ["--tokenizer", str(vocab)]
    base += ["--cache-dir", str(tmp_path / "cache"), "--lr", "1e-3", "--warmup", "1"]
    one = _run(["pretrain", *base, "--out", str(tmp_path / "one")])
    assert one.returncode == 0, one.stderr[-2000:]
    two = _run(["pretrain", *base, "--out", str(tmp_path / "two")], processes=2)
    assert two.returncode == 0, two.stderr[-3000:]
    assert len(two.stdout.splitlines()) == 1  # the result once, from rank 0
    assert not list(tmp_path.glob(".*.lock"))  # rank 0's lock, gone with the run
    a, b = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-5), name
    loss_one = [r["loss"] for r in _rows(tmp_path / "one") if not r.get("eval")]
    loss_two = [r["loss"] for r in _rows(tmp_path / "two") if not r.get("eval")]
    assert loss_one == pytest.approx(loss_two, abs=1e-4)


def test_two_processes_killed_and_resumed_end_as_an_uninterrupted_run(corpus, vocab, tmp_path):
    """torchrun, 2 processes: rank 0 SIGKILLed writing step 6's checkpoint, resumed from step 3."""
    # Step 3 falls inside a logging window (rows at steps 2, 4, 6). Before, the resumed row of
    # step 4 differed in its last bits (loss 6.613506794 for 6.613506556): the checkpoint kept
    # the ranks' total of the window, which the row then added in another order.
    base = [*SHAPE, "--corpus", str(corpus), "--tokenizer", str(vocab), "--steps", "6"]
    base += ["--save-every", "3", "--log-every", "2", "--cache-dir", str(tmp_path / "cache")]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    reference = subprocess.Popen(  # runs beside the killed one
        _command(["pretrain", *base, "--out", str(straight)], processes=2),
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    first = _run(["pretrain", *base, "--out", str(killed)], {"ATTNLAB_KILL_IN_SAVE": "6"}, 2)
    assert first.returncode != 0  # torchrun's 1: its rank 0 was killed
    checkpoints = killed / "checkpoints"
    assert list(checkpoints.glob(".step-6.*.tmp")) and not (checkpoints / "step-6").exists()
    second = _run(["pretrain", *base, "--out", str(killed), "--resume"], processes=2)
    assert second.returncode == 0, second.stderr[-3000:]
    _, errors = reference.communicate(timeout=300)
    assert reference.returncode == 0, errors.decode()[-3000:]
    assert_same_run(straight, killed)  # the temp directory gone too


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_second_run_into_the_out_of_a_training_run_is_refused(corpus, vocab, tmp_path, capsys):
    # Before: `pretrain --resume` (two terminals, a scheduler's retry) or `--overwrite`
    # started while another run trained in --out trained beside it: two processes wrote
    # checkpoints, metrics.jsonl and the final model into one folder.
    out, paused = tmp_path / "run", tmp_path / "paused"
    out.mkdir()  # an old run, which the first run's --overwrite replaces by a rename
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    base = [*SHAPE, "--corpus", str(corpus), "--tokenizer", str(vocab), "--steps", "6"]
    base += ["--save-every", "2", "--eval-every", "0", "--cache-dir", str(tmp_path / "cache")]
    base += ["--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ATTNLAB_PAUSE_FILE": str(paused)}
    first = subprocess.Popen(  # paused as it reads its 4th batch: steps 1-3 done, step 2 saved
        _command(["pretrain", *base, "--overwrite", "--log-every", "1"]),
        env={**env, "ATTNLAB_PAUSE_AT_BATCH": "4"}, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not paused.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert paused.exists(), "the first run did not reach its 4th batch"
        before = _snapshot(out)
        assert "checkpoints/step-2/COMPLETE" in before
        refusal = (
            f"attnlab: error: another run (pid {first.pid}) is training in {out}: wait for it "
            "to end or choose another --out"
        )
        second = _run(["pretrain", *base, "--resume"])  # a second process, as from a terminal
        assert second.returncode == 2 and second.stderr.splitlines() == [refusal], second.stderr
        for extra in (["--overwrite"], [], ["--resume", "--steps", "8"]):
            assert _error(["pretrain", *base, *extra], capsys) == refusal
        assert _snapshot(out) == before
    finally:
        paused.unlink(missing_ok=True)  # the first run trains on
        _, errors = first.communicate(timeout=120)
    assert first.returncode == 0, errors[-2000:]
    steps = [r["step"] for r in _rows(out) if not r.get("eval")]
    assert steps == [1, 2, 3, 4, 5, 6]  # one run's rows, each once
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4", "step-6"]
    assert not (tmp_path / ".run.lock").exists()  # released and removed at the end


def test_a_sigkilled_run_leaves_no_lock_that_blocks_its_resume(corpus, vocab, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["pretrain", *SHAPE, "--corpus", str(corpus), "--tokenizer", str(vocab)]
    args += ["--steps", "4", "--save-every", "2", "--eval-every", "0", "--out", str(out)]
    args += ["--cache-dir", str(tmp_path / "cache")]
    killed = _run(args, {"ATTNLAB_KILL_AT_BATCH": "3"})
    assert killed.returncode == -9
    lock = tmp_path / ".run.lock"
    assert lock.is_file()  # the file stays; the kernel let go of its lock with the process
    capsys.readouterr()
    assert main([*args, "--resume"]) == 0
    assert "step-4" in {p.name for p in (out / "checkpoints").iterdir()}
    assert not lock.exists()


def test_a_refused_lock_stops_every_torchrun_process(corpus, vocab, tmp_path):
    # Only rank 0 locks (the ranks of one run must not shut each other out); the others learn
    # of its refusal at once, rather than wait for it at a barrier.
    out = tmp_path / "run"
    args = ["pretrain", *SHAPE, "--corpus", str(corpus), "--tokenizer", str(vocab)]
    args += ["--steps", "2", "--out", str(out), "--cache-dir", str(tmp_path / "cache")]
    with open(tmp_path / ".run.lock", "w") as held:  # as another run holds it
        fcntl.flock(held, fcntl.LOCK_EX)
        ddp = _run(args, processes=2)
    assert ddp.returncode == 1, ddp.stderr[-3000:]  # torchrun's, after its workers' 2
    # each once (the two processes' lines may interleave on the one stderr)
    refusal = f"attnlab: error: another run is training in {out}: wait for it to end or choose"
    assert ddp.stderr.count(refusal) == 1, ddp.stderr[-3000:]  # rank 0's
    other = "attnlab: error: another rank could not prepare the run (see its message)"
    assert ddp.stderr.count(other) == 1, ddp.stderr[-3000:]  # rank 1 did not wait on
    assert not out.exists()


def test_a_failed_command_leaves_the_process_group(tmp_path, capsys):
    # Before: a command that failed under torchrun exited with its process group up, and the
    # gloo threads then aborted the process as Python shut down ("terminate called without an
    # active exception", SIGABRT; 4 runs of 4 at one time, 1 of 5 at another, of `torchrun
    # --nproc_per_node 2 -m attnlab pretrain --batch-size 7`): torchrun blamed that abort.
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)  # fmt: skip
    try:
        missing = tmp_path / "missing.txt"
        assert main(["pretrain", "--corpus", str(missing), "--out", str(tmp_path / "o")]) == 2
        assert "corpus file" in capsys.readouterr().err
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_batch_ranks_cannot_split_is_refused_before_overwrite_clears_out(
    corpus, vocab, tmp_path, capsys, monkeypatch
):
    # Before: under torchrun, --overwrite deleted the old run (leaving only a new tokenizer/)
    # and only then did the trainer refuse a --batch-size the processes cannot split.
    import attnlab.tasks.job
    import attnlab.train.trainer

    for module in (attnlab.tasks.job, attnlab.train.trainer):  # rank 0 of 2
        monkeypatch.setattr(module, "init_distributed", lambda: (0, 2, 0))
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    args = ["pretrain", "--preset", "bert-tiny", "--batch-size", "7", "--seq-len", "32"]
    args += ["--corpus", str(corpus), "--tokenizer", str(vocab), "--steps", "2"]
    args += ["--cache-dir", str(tmp_path / "cache"), "--out", str(out), "--overwrite"]
    assert main(args) == 2
    assert "must be divisible by the 2 processes" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]  # the old run, untouched


def test_options_from_toml_and_yaml_with_flags_winning(corpus, tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(
        f'preset = "bert-tiny"\ncorpus = ["{corpus}"]\nbatch-size = 4\nseq_len = 24\n'
        f'steps = 2\nvocab_size = 300\nobjective = "mlm+sop"\nsave_every = 0\n'
        f'cache_dir = "{tmp_path / "cache"}"\nembedding_size = 32\nshare_layers = true\n'
    )
    out = tmp_path / "toml-run"
    assert main(["pretrain", "--config", str(toml), "--out", str(out), "--steps", "3"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["attnlab"]["embedding_size"] == 32 and config["attnlab"]["share_layers"]
    assert [r["step"] for r in _rows(out) if not r.get("eval")][-1] == 3  # the flag won
    yaml = tmp_path / "run.yaml"
    yaml.write_text(
        f"preset: bert-tiny\ncorpus: {corpus}\nout: {tmp_path / 'yaml-run'}\nsteps: 2\n"
        f"batch_size: 4\nseq_len: 24\nvocab_size: 300\nobjective: mlm\nsave_every: 0\n"
        f"cache_dir: {tmp_path / 'cache'}\n"
    )
    assert main(["pretrain", "--config", str(yaml)]) == 0
    config = json.loads((tmp_path / "yaml-run" / "config.json").read_text())
    assert config["architectures"] == ["BertForMaskedLM"]


def test_an_empty_file_list_in_a_config_is_refused(tmp_path, capsys):
    # It trained on the bundled sample, as if corpus had been left out.
    toml = tmp_path / "run.toml"
    toml.write_text("corpus = []\n")
    message = _error(["pretrain", "--config", str(toml), "--out", str(tmp_path / "o")], capsys)
    assert "corpus is an empty list: name a file, or leave corpus out" in message
    assert not (tmp_path / "o").exists()


def test_compile_flag_reaches_the_trainer_config(tmp_path):
    import argparse

    from attnlab.cli import build_parser, options_from
    from attnlab.tasks.distill import DistillOptions
    from attnlab.tasks.pretrain import PretrainOptions, trainer_config

    for command, cls, extra in (
        ("pretrain", PretrainOptions, []),
        ("distill", DistillOptions, ["--teacher", "t", "--student-layers", "2"]),
    ):
        argv = [command, "--out", str(tmp_path / command), "--compile", *extra]
        args: argparse.Namespace = build_parser().parse_args(argv)
        opts = options_from(cls, args, ("out",), ("out",))
        assert opts.compile and trainer_config(opts, warmup_divisor=10).compile
        plain = options_from(cls, build_parser().parse_args(argv[:3] + extra), ("out",), ("out",))
        assert not plain.compile


def _error(args: list[str], capsys) -> str:
    """Exit 2 with one error line and nothing else on stderr (no progress bar either)."""
    code = main(args)
    err = capsys.readouterr().err
    errors = err.splitlines()
    assert code == 2 and len(errors) == 1 and errors[0].startswith("attnlab: error:"), err
    return errors[0]


def test_bad_input_is_one_line_and_writes_nothing(corpus, tmp_path, capsys):
    cache = ["--cache-dir", str(tmp_path / "cache")]
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    out = tmp_path / "o1"
    assert "no text" in _error(
        ["pretrain", "--corpus", str(empty), "--out", str(out), *TINY, *cache], capsys
    )

    single = tmp_path / "single.txt"
    single.write_text("第一句话。第二句话。第三句话。\n", encoding="utf-8")  # one document
    message = _error(["pretrain", "--corpus", str(single), "--out", str(tmp_path / "o2"), *TINY,
                      "--vocab-size", "50", *cache], capsys)  # fmt: skip
    assert "single document" in message

    small = tmp_path / "small.txt"
    small.write_text("一句。两句。\n\n三句。四句。\n", encoding="utf-8")
    message = _error(["pretrain", "--corpus", str(small), "--out", str(tmp_path / "o6"), *TINY,
                      "--vocab-size", "50", *cache], capsys)  # fmt: skip
    assert "fewer than --batch-size" in message

    bad = tmp_path / "bad.txt"
    bad.write_bytes("好的。\n\n".encode() * 3 + b"\xff\xfe broken\n")
    message = _error(
        ["pretrain", "--corpus", str(bad), "--out", str(tmp_path / "o3"), *TINY, *cache], capsys
    )
    assert "bad.txt" in message and "line 7" in message

    message = _error(["pretrain", "--corpus", str(corpus), "--out", str(tmp_path / "o4"),
                      "--preset", "bert-tiny", "--seq-len", "600", *cache], capsys)  # fmt: skip
    assert "max positions" in message

    other = tmp_path / "other-run"
    other.mkdir()
    (other / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    message = _error(
        ["pretrain", "--corpus", str(corpus), "--out", str(other), *TINY, *cache], capsys
    )
    assert (
        "--resume" in message
        and (other / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'
    )

    assert "unknown preset" in _error(
        ["pretrain", "--out", str(tmp_path / "o5"), "--preset", "bert-huge"], capsys
    )
    huge = "99999999999999999999"  # overflowed in itertools / numpy: tracebacks
    for command, option, fragment in [
        ("pretrain", "--batch-size", "--batch-size must be at most 1048576"),
        ("pretrain", "--seq-len", "--seq-len must be at most 65536"),
        ("pretrain", "--grad-accum", "grad_accum must be <= 65536"),
        ("distill", "--batch-size", "--batch-size must be at most 1048576"),
    ]:
        extra = ["--teacher", str(tmp_path / "nowhere"), "--student-layers", "1"]
        args = [command, "--corpus", str(corpus), "--out", str(tmp_path / "o7")]
        args += [*(extra if command == "distill" else TINY), option, huge, *cache]
        assert fragment in _error(args, capsys)
    for leftover in ("o1", "o2", "o3", "o4", "o5", "o6", "o7"):
        assert not (tmp_path / leftover).exists() or not any((tmp_path / leftover).iterdir())


def test_corrupt_checkpoint_on_resume_is_refused(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["pretrain", "--corpus", str(corpus), "--out", str(out), *TINY, "--steps", "2"]
    args += ["--save-every", "1", "--cache-dir", str(tmp_path / "cache")]
    assert main(args) == 0
    capsys.readouterr()
    state = out / "checkpoints" / "step-2" / "trainer.pt"
    state.write_bytes(b"not a checkpoint")
    before = (out / "model.safetensors").read_bytes()
    message = _error(
        [*args[:-2], "--steps", "4", "--resume", "--cache-dir", str(tmp_path / "cache")], capsys
    )
    assert "step-2" in message
    assert (out / "model.safetensors").read_bytes() == before
    assert state.read_bytes() == b"not a checkpoint"


def test_resume_into_another_jobs_run_is_refused(corpus, tmp_path, capsys):
    # A checkpointed run of another job (no tokenizer/): the error said the missing
    # tokenizer was "not a directory: expected a BERT checkpoint directory".
    from _trainer_run import train

    out = tmp_path / "run"
    train(out, steps=4, save_every=2)
    before = _snapshot(out)
    args = ["pretrain", "--corpus", str(corpus), "--out", str(out), *TINY, "--resume"]
    message = _error([*args, "--cache-dir", str(tmp_path / "cache")], capsys)
    assert "holds no pretraining run (no tokenizer/ beside its checkpoints)" in message
    assert _snapshot(out) == before


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_refused_options_leave_an_existing_run_as_it_was(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    cache = ["--cache-dir", str(tmp_path / "cache")]
    args = ["pretrain", "--corpus", str(corpus), "--out", str(out), *TINY, "--steps", "2", *cache]
    assert main([*args, "--save-every", "1"]) == 0
    capsys.readouterr()
    before = _snapshot(out)
    # Each is refused before anything is written: with --overwrite the tokenizer of another
    # --vocab-size used to replace the run's own before the learning rate was checked.
    for bad in (["--lr", "-1"], ["--lr", "inf"], ["--warmup", "-1"], ["--keep-last", "-1"],
                ["--seed", "-1"]):  # fmt: skip
        message = _error([*args, "--overwrite", "--vocab-size", "300", *bad], capsys)
        assert bad[0].lstrip("-") in message.replace("_", "-"), message
        assert _snapshot(out) == before
    fresh = tmp_path / "fresh"
    _error([*args[:4], str(fresh), *args[5:], "--lr", "0"], capsys)
    assert not fresh.exists()

    # A string where a config file needs true/false or a number is refused, not truthy.
    for line in ('overwrite = "no"', "steps = 3.5", 'lr = "1e-4"', "corpus = 5", 'out = ["a"]'):
        (tmp_path / "run.toml").write_text(line + "\n")
        message = _error([*args, "--config", str(tmp_path / "run.toml")], capsys)
        assert line.split(" =")[0] in message and "must be" in message, message
        assert _snapshot(out) == before

    # Resuming with other settings names the mismatch; it does not call the checkpoint broken.
    message = _error([*args, "--steps", "4", "--resume", "--preset", "bert-mini"], capsys)
    assert "holds another model" in message and "delete" not in message
    assert _snapshot(out) == before


def test_yaml_numbers_in_exponent_form_are_numbers(tmp_path):
    from attnlab.cli import read_config_file

    (tmp_path / "run.yaml").write_text("lr: 1e-4\nwarmup: 10\nname: 1e-4x\n")
    assert read_config_file(str(tmp_path / "run.yaml")) == {
        "lr": 1e-4, "warmup": 10, "name": "1e-4x",
    }  # fmt: skip


def test_compiled_pretraining_step_equals_eager_with_dropout() -> None:
    # `--compile` on BERT with dropout (and attention dropout): the compiled forward and
    # backward give eager's loss and gradients from the same seed (the dropout masks are drawn
    # outside the compiled graphs, in the same order). Before 2026-12-01 tracing failed on the
    # masks' int64 -> int16 view (in AOT autograd, so its eager backend shows it in 14 s where
    # inductor's C++ code generation takes 50).
    from attnlab.config import BertConfig
    from attnlab.models.bert import BertForPreTraining

    synthetic_batch = _bench_common().synthetic_batch

    torch.manual_seed(0)
    config = BertConfig(vocab_size=120, d_model=32, n_layers=1, n_heads=2, d_ff=64, dropout=0.1)
    config.attention_dropout = 0.1
    eager = BertForPreTraining(config).train()
    compiled = BertForPreTraining(config).train()
    compiled.load_state_dict(eager.state_dict())
    batch = synthetic_batch(config.vocab_size, 4, 32)
    results = []
    for model, network in (
        (eager, eager),
        (compiled, torch.compile(compiled, backend="aot_eager")),
    ):
        torch.manual_seed(1)
        loss = network(**batch)["loss"]
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_e, grads_e), (loss_c, grads_c) = results
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-5)
    for name, grad in grads_e.items():
        torch.testing.assert_close(grads_c[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_bf16_pretraining_by_the_fp32_kernel_equals_autocasts_own(monkeypatch) -> None:
    # On a CPU without fast bf16 products attnlab computes autocast's bf16 products with
    # the fp32 kernel (fast/linear.py). A whole BERT forward and backward (with attention
    # dropout: the explicit path's matmuls) must then give what PyTorch's bf16 kernels give,
    # up to bf16 roundings of sums taken in another order: within one bf16 epsilon (2^-8)
    # relative, and far nearer to them than fp32 is (no rounding to bf16). Measured: 2e-7
    # relative at most on a Xeon; on a Zen without AVX-512, whose bf16 kernels are PyTorch's
    # own, 1.7e-3 at most, 0.2x fp32's distance.
    import attnlab.fast.linear as linear_module
    from attnlab.config import BertConfig
    from attnlab.fast import for_training
    from attnlab.models.bert import BertForPreTraining

    synthetic_batch = _bench_common().synthetic_batch

    torch.manual_seed(0)
    config = BertConfig(vocab_size=300, d_model=64, n_layers=2, n_heads=4, d_ff=128, dropout=0.1)
    config.attention_dropout = 0.1
    model = for_training(BertForPreTraining(config).train())
    batch = synthetic_batch(config.vocab_size, 4, 32)
    calls, results = [], []
    apply = linear_module._Bf16MatMul.apply
    monkeypatch.setattr(linear_module._Bf16MatMul, "apply", lambda *a: calls.append(1) or apply(*a))
    # PyTorch's bf16 kernel, then attnlab's route, then fp32 (autocast off)
    for native, autocast in ((True, True), (False, True), (False, False)):
        monkeypatch.setattr(linear_module, "fast_bf16_matmul", lambda native=native: native)
        calls.clear()
        torch.manual_seed(1)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(**batch)["loss"]
        loss.backward()
        assert len(calls) == (2 * config.n_layers if autocast and not native else 0)
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_native, grads_native), (loss_ours, grads_ours), (_, grads_fp32) = results
    torch.testing.assert_close(loss_ours, loss_native, rtol=1e-3, atol=0)
    for name, grad in grads_native.items():
        error = float((grads_ours[name] - grad).norm() / grad.norm())
        fp32_error = float((grads_fp32[name] - grad).norm() / grad.norm())
        assert error < 2**-8 and error <= 0.35 * fp32_error, (name, error, fp32_error)


def test_held_out_scores_are_the_same_with_the_inference_twins(
    corpus, vocab, tmp_path, monkeypatch
):
    # The periodic evaluation runs the model with its inference twins (fast.inference_twins:
    # no padding computed); its metrics must be those of the plain model, to float rounding.
    import contextlib

    import attnlab.tasks.pretrain as pretrain_module
    from attnlab.config import BertConfig
    from attnlab.models.bert import BertForPreTraining
    from attnlab.text.tokenizer import BertTokenizer

    tokenizer = BertTokenizer.from_dir(vocab)
    opts = pretrain_module.PretrainOptions(
        out=tmp_path / "run", corpus=[corpus], preset="bert-tiny", batch_size=8, seq_len=32,
        eval_documents=40, eval_examples=48, cache_dir=tmp_path / "cache", progress=False,
    )  # fmt: skip
    evaluate = pretrain_module.prepare_data(opts, [corpus], tokenizer).evaluate
    torch.manual_seed(0)
    config = BertConfig.preset("bert-tiny", vocab_size=tokenizer.vocab_size, max_positions=32)
    model = BertForPreTraining(config).eval()
    entered = []
    twins = pretrain_module.fast.inference_twins
    monkeypatch.setattr(
        pretrain_module.fast, "inference_twins", lambda m: entered.append(1) or twins(m)
    )
    with torch.no_grad():
        with_twins = evaluate(model)
    monkeypatch.setattr(pretrain_module.fast, "inference_twins", lambda m: contextlib.nullcontext())
    with torch.no_grad():
        plain = evaluate(model)
    assert entered == [1]
    assert with_twins.keys() == plain.keys() >= {"eval_mlm_loss", "eval_mlm_accuracy"}
    for name, value in plain.items():
        assert with_twins[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


def test_added_special_tokens_are_never_masked(corpus, vocab, tmp_path):
    # An added special token (an entity marker, say) is never chosen nor put in as a random token
    import attnlab.tasks.pretrain as pretrain_module
    from attnlab.text.tokenizer import BertTokenizer

    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(vocab / "vocab.txt", folder)
    config = json.loads((vocab / "tokenizer_config.json").read_text(encoding="utf-8"))
    e1 = len((vocab / "vocab.txt").read_text(encoding="utf-8").splitlines())
    entry = {"content": "<e1>", "special": True, "normalized": False}
    config["added_tokens_decoder"] = {str(e1): entry}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    tokenizer = BertTokenizer.from_dir(folder)
    assert tokenizer.vocab_size == e1 + 1 and e1 in tokenizer.special_ids
    marked = tmp_path / "marked.txt"
    lines = corpus.read_text(encoding="utf-8").splitlines()
    marked.write_text("".join(f"<e1> {line}\n" if line else "\n" for line in lines), "utf-8")
    opts = pretrain_module.PretrainOptions(
        out=tmp_path / "run", corpus=[marked], preset="bert-tiny", batch_size=32, seq_len=64,
        eval_documents=40, eval_examples=48, cache_dir=tmp_path / "cache", progress=False,
    )  # fmt: skip
    batches = pretrain_module.prepare_data(opts, [marked], tokenizer).batches
    markers = chosen = 0
    for batch in itertools.islice(batches, 20):
        markers += int((batch["input_ids"] == e1).sum())
        chosen += int((batch["mlm_labels"] != -100).sum())
        assert not (batch["mlm_labels"] == e1).any()
    assert markers > 500 and chosen > 2000  # 15% of the markers would be ~150


def test_max_predictions_caps_the_masked_tokens_of_each_sequence(corpus, vocab, tmp_path, capsys):
    # google-research/bert's max_predictions_per_seq; the held-out examples are capped too
    import attnlab.tasks.pretrain as pretrain_module
    from attnlab.text.tokenizer import BertTokenizer

    tokenizer = BertTokenizer.from_dir(vocab)
    counts = {}
    for cap in (None, 3):
        opts = pretrain_module.PretrainOptions(
            out=tmp_path / "run", corpus=[corpus], preset="bert-tiny", batch_size=16,
            seq_len=64, eval_documents=40, eval_examples=48, cache_dir=tmp_path / "cache",
            progress=False, max_predictions=cap,
        )  # fmt: skip
        batches = pretrain_module.prepare_data(opts, [corpus], tokenizer).batches
        rows = torch.cat(
            [(b["mlm_labels"] != -100).sum(dim=1) for b in itertools.islice(batches, 8)]
        )
        counts[cap] = rows
    assert counts[None].max() > 3 and counts[3].max() == 3 and counts[3].min() >= 1
    args = ["pretrain", "--corpus", str(corpus), "--out", str(tmp_path / "o"), *TINY]
    assert "--max-predictions must be at least 1" in _error(
        [*args, "--max-predictions", "0"], capsys
    )


def test_overwrite_clears_the_old_run_before_it_writes_anything(corpus, tmp_path, capsys,
                                                                monkeypatch):  # fmt: skip
    from attnlab.tasks import pretrain as recipe

    out = tmp_path / "run"
    cache = ["--cache-dir", str(tmp_path / "cache")]
    args = ["pretrain", "--corpus", str(corpus), "--out", str(out), *TINY, "--steps", "2", *cache]
    assert main([*args, "--save-every", "1"]) == 0
    (out / "notes.txt").write_text("mine")

    class Killed(BaseException):
        pass

    def killed(*_args, **_kwargs):
        raise Killed  # stands for a SIGKILL once the new run's vocabulary is written

    monkeypatch.setattr(recipe, "Trainer", killed)
    with pytest.raises(Killed):
        main([*args, "--overwrite", "--lr", "3e-4"])
    # The old run went as a whole: --resume cannot continue its checkpoints by mistake
    # (they were deleted only when the trainer started, after the new vocabulary was saved).
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer"]
    monkeypatch.undo()
    capsys.readouterr()
    # it said "holds a run: pass --resume to continue", though nothing could be continued
    message = _error([*args, "--lr", "3e-4"], capsys)
    assert "holds only the vocabulary of a run stopped before its first checkpoint" in message
    assert main([*args, "--resume", "--lr", "3e-4"]) == 0  # a start killed early begins again
    rows = _rows(out)
    assert [r["step"] for r in rows if not r.get("eval")][-1] == 2
    assert rows[0]["lr"] == pytest.approx(1.5e-4)  # the new run's schedule (old: 5e-5 there)


def test_resume_cleans_leftovers_and_warns_of_changed_settings(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    cache = ["--cache-dir", str(tmp_path / "cache")]
    args = ["pretrain", "--corpus", str(corpus), "--out", str(out), *TINY, *cache]
    assert main([*args, "--steps", "2", "--save-every", "1"]) == 0
    # what kills during atomic writes leave: a temp file, a staged folder, an old copy
    (out / ".model.safetensors.0123456789abcdef0123456789abcdef.tmp").write_bytes(b"half")
    (out / ".final.tmp.0123456789abcdef0123456789abcdef.tmp").mkdir()
    (out / "final.tmp").mkdir(exist_ok=True)
    (out / "final.tmp" / ".vocab.txt.0123456789abcdef0123456789abcdef.tmp").write_text("x")
    (out / ".best.k2j4h5g6.old").mkdir()
    (out / "notes.txt").write_text("mine")
    # and beside out: an --overwrite killed while it cleared the old run (clear_dir's trash)
    (tmp_path / ".run.a1b2c3d4.old" / "old" / "checkpoints").mkdir(parents=True)
    capsys.readouterr()
    assert main([*args, "--steps", "3", "--resume", "--lr", "5e-4", "--batch-size", "4"]) == 0
    err = capsys.readouterr().err
    assert "warning: resuming" in err and "lr 0.0005 (checkpoint: 0.0001)" in err
    assert "batch_size 4 (checkpoint: 8)" in err  # the job's own settings too
    assert "whole_word_masking" not in err  # the same masking: nothing said of it
    left = sorted(p.name for p in out.iterdir() if p.name.startswith("."))
    assert left == [] and (out / "notes.txt").read_text() == "mine"
    assert not (tmp_path / ".run.a1b2c3d4.old").exists()
    assert not (out / "final.tmp").exists()


def test_resume_with_other_masking_warns(corpus, tmp_path, capsys):
    # Resumed without --whole-word-masking (or with another --max-predictions), a BERT-wwm
    # run went on with character-level masking, and nothing said so.
    out = tmp_path / "run"
    cache = ["--cache-dir", str(tmp_path / "cache")]
    args = ["pretrain", "--corpus", str(corpus), "--out", str(out), *TINY, *cache]
    assert main([*args, "--steps", "2", "--save-every", "1", "--whole-word-masking"]) == 0
    capsys.readouterr()
    assert main([*args, "--steps", "2", "--resume", "--max-predictions", "5"]) == 0
    err = capsys.readouterr().err
    assert "warning: resuming" in err and "whole_word_masking False (checkpoint: True)" in err
    assert "max_predictions 5 (checkpoint: None)" in err


def test_config_file_nulls_threads_formats_and_its_place(corpus, tmp_path, capsys):
    import argparse

    import torch

    from attnlab.cli import build_parser, options_from
    from attnlab.tasks.pretrain import PretrainOptions

    def options(text: str, name: str, *flags: str) -> PretrainOptions:
        (tmp_path / name).write_bytes(text.encode("utf-8-sig"))  # a BOM, as some editors write
        argv = ["pretrain", "--config", str(tmp_path / name), "--out", str(tmp_path / "o"), *flags]
        args: argparse.Namespace = build_parser().parse_args(argv)
        return options_from(PretrainOptions, args, ("out",), ("out",))

    before = torch.get_num_threads()
    try:
        # null means "not given" (it gave a TypeError); threads applies; JSON and .YAML are YAML
        opts = options("save_every: null\nthreads: 1\nsteps: 7\n", "run.YAML")
        assert opts.save_every == PretrainOptions(out=tmp_path).save_every and opts.steps == 7
        assert torch.get_num_threads() == 1
        assert options('{"steps": 5, "lr": 2e-4}', "run.json").lr == 2e-4
    finally:
        torch.set_num_threads(before)
    (tmp_path / "bad.toml").write_text("eval_examples = -5\n")
    assert "eval_examples must be >= 0" in _error(
        ["pretrain", "--config", str(tmp_path / "bad.toml"), "--out", str(tmp_path / "o")], capsys
    )
    # an option given twice: the last (YAML) or one of two spellings won in silence; a path
    # holding NUL was a traceback (ValueError: embedded null byte), and YAML's escape of half
    # a UTF-16 pair "cannot write '\\ud800' in utf-8" (finetune: after training)
    for name, text, fragment in (
        ("twice.yaml", "steps: 2\nsteps: 3\n", "duplicate key 'steps'"),
        ("twice.toml", "batch-size = 3\nbatch_size = 4\n", "'batch-size' and 'batch_size' are"),
        ("nul.toml", 'cache_dir = "a\\u0000b"\n', r"cache_dir must be a path or null"),
        ("nul.yaml", 'corpus: "a\\0b"\n', r"corpus must be a list of paths, got ['a\x00b']"),
        ("half.yaml", 'cache_dir: "\\ud800"\n', r"the text '\ud800' holds the escape \ud800"),
    ):
        (tmp_path / name).write_text(text)
        argv = ["pretrain", "--config", str(tmp_path / name), "--out", str(tmp_path / "o")]
        assert fragment in _error(argv, capsys)
    # --overwrite replaces --out as a whole: a config file inside it is refused
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.toml").write_text(f'corpus = "{corpus}"\n')
    message = _error(["pretrain", "--config", str(run / "run.toml"), "--out", str(run),
                      "--overwrite"], capsys)  # fmt: skip
    assert "holds the input" in message and (run / "run.toml").is_file()


def test_init_with_shape_flags_is_refused_not_ignored(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    cache = ["--cache-dir", str(tmp_path / "cache")]
    args = ["pretrain", "--corpus", str(corpus), "--out", str(out), *TINY, "--steps", "1", *cache]
    assert main(args) == 0
    capsys.readouterr()
    small = ["--batch-size", "8", "--seq-len", "32", "--steps", "1", *cache]
    message = _error(["pretrain", "--corpus", str(corpus), "--out", str(tmp_path / "two"),
                      "--init", str(out), "--preset", "bert-base", "--position-encoding", "rope",
                      *small], capsys)  # fmt: skip
    assert "drop --preset, --position-encoding" in message
    assert main(["pretrain", "--corpus", str(corpus), "--out", str(tmp_path / "two"),
                 "--init", str(out), *small]) == 0  # fmt: skip


def test_init_checks_its_heads_token_types_and_vocabulary_size(corpus, tmp_path, capsys):
    cache = ["--cache-dir", str(tmp_path / "cache")]
    small = ["--batch-size", "8", "--seq-len", "32", "--steps", "2", "--save-every", "0", *cache]
    mlm_only = tmp_path / "mlm_only"
    args = ["pretrain", "--corpus", str(corpus), "--out", str(mlm_only), *TINY, "--steps", "1"]
    assert main([*args, "--objective", "mlm", *cache]) == 0
    # Before, an MLM-only checkpoint given to mlm+nsp trained no sentence head in silence.
    capsys.readouterr()
    out = tmp_path / "nsp"
    assert main(["pretrain", "--corpus", str(corpus), "--out", str(out), "--init",
                 str(mlm_only), *small]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "note: --init" in err and "no sentence (NSP/SOP) head" in err
    rows = [r for r in read_rows(out / "metrics.jsonl") if not r.get("eval")]
    assert all("nsp_loss" in r for r in rows)
    assert any(k.startswith("cls.seq_relationship") for k in load_file(out / "model.safetensors"))
    # --vocab-size with --init was ignored in silence
    message = _error(["pretrain", "--corpus", str(corpus), "--out", str(tmp_path / "v"),
                      "--init", str(mlm_only), "--vocab-size", "500", *small], capsys)  # fmt: skip
    assert "--vocab-size sizes a vocabulary trained on the corpus" in message
    # one token type: NSP's second segment had no embedding (an IndexError mid-run)
    one_type = tmp_path / "one_type"
    shutil.copytree(out, one_type, ignore=shutil.ignore_patterns("checkpoints"))
    config = json.loads((one_type / "config.json").read_text())
    (one_type / "config.json").write_text(json.dumps({**config, "type_vocab_size": 1}))
    weights = load_file(one_type / "model.safetensors")
    name = "bert.embeddings.token_type_embeddings.weight"
    save_file({**weights, name: weights[name][:1].clone()}, one_type / "model.safetensors")
    message = _error(["pretrain", "--corpus", str(corpus), "--out", str(tmp_path / "t"),
                      "--init", str(one_type), *small], capsys)  # fmt: skip
    assert "one token type (type_vocab_size 1)" in message and "--objective mlm" in message
    assert not (tmp_path / "t").exists() and not (tmp_path / "v").exists()


@pytest.mark.parametrize("demo", ["pretrain_demo.py", "translate_demo.py"])
def test_the_make_demo_scripts_run_a_few_steps(demo, tmp_path):
    # `make demo` broke once when an option's default changed (--vocab-size became refused
    # with --tokenizer) and no test ran the scripts; here each runs three steps.
    script = Path(__file__).parents[1] / "examples" / demo
    done = subprocess.run([sys.executable, str(script), "3"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loss.png in runs/" in done.stdout
