"""Language modelling (tasks/lm.py, text/token_stream.py): token streams equal to the whole
text's encoding, nanoGPT's split and windows, `lm train` (metrics, held-out perplexity =
exp(loss), warm-up planning, bit-identical resume after SIGKILL, torchrun DDP = one process),
and `lm eval` against hand-computed negative log-likelihoods."""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from attnlab.cli import main
from attnlab.errors import AttnlabError
from attnlab.text import token_stream
from attnlab.text.lm_tokenizer import train_byte_bpe, train_char
from attnlab.text.token_stream import (
    TokenStream,
    WindowBatches,
    evaluation_windows,
    held_out_split,
    text_chunks,
)

LINES = [
    "First Citizen:",
    "Before we proceed any further, hear me speak.",
    "",
    "All:",
    "Speak, speak.   ",
    "  You are all resolved rather to die than to famish?",
    "Resolved. resolved.",
]
TEXT = "\n".join(LINES * 30) + "\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("lm") / "corpus.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------- token streams


@pytest.mark.parametrize("kind", ["char", "byte-bpe"])
def test_a_stream_in_chunks_equals_the_whole_texts_encoding(corpus, kind, tmp_path):
    tokenizer = train_char([corpus]) if kind == "char" else train_byte_bpe([corpus], 300)
    chunks = list(text_chunks(corpus, chunk_chars=40, exact_anywhere=kind == "char"))
    assert len(chunks) > 10 and "".join(chunks) == TEXT
    ids = [i for chunk in chunks for i in tokenizer.encode(chunk)]
    assert ids == tokenizer.encode(TEXT)  # GPT-2's split regex cut only where it is exact


def test_a_stream_is_cached_once_and_closes_files_with_end_of_text(corpus, tmp_path, monkeypatch):
    tokenizer = train_byte_bpe([corpus], 300)
    stream = TokenStream.build([corpus, corpus], tokenizer, tmp_path / "cache")
    whole = tokenizer.encode(TEXT)
    assert list(stream.tokens) == [*whole, tokenizer.eos_id, *whole, tokenizer.eos_id]
    assert stream.tokens.dtype == np.uint16

    def refuse(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(token_stream, "_write_stream", refuse)
    again = TokenStream.build([corpus, corpus], tokenizer, tmp_path / "cache")
    assert again.directory == stream.directory


def test_an_empty_corpus_is_refused(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(AttnlabError, match="has no text"):
        train_char([empty])
    tokenizer = train_byte_bpe([Path(__file__)], 300)
    with pytest.raises(AttnlabError, match="has no text"):
        TokenStream.build([empty], tokenizer, tmp_path / "cache")
    assert not list((tmp_path / "cache" / "lm").iterdir())  # no cache left behind


def test_held_out_split_is_nanogpts_last_ten_percent():
    tokens = np.arange(1000)
    train, held = held_out_split(tokens)
    assert list(train) == list(range(900)) and list(held) == list(range(900, 1000))


def test_windows_predict_the_next_token_and_split_over_ranks_and_steps():
    tokens = np.arange(500, dtype=np.uint16)
    one = WindowBatches(tokens, seq_len=8, batch_size=6, grad_accum=2, seed=5)
    batches = iter(one)
    first = [next(batches) for _ in range(4)]  # two steps of two micro-batches
    assert one.step == 2
    for batch in first:
        assert torch.equal(batch["targets"], batch["input_ids"] + 1)
        assert batch["input_ids"].shape == (3, 8)
    ranks = []
    for rank in range(3):  # three processes read the rows one process reads
        source = WindowBatches(tokens, seq_len=8, batch_size=6, grad_accum=2, seed=5)
        source.set_rank(rank, 3)
        it = iter(source)
        ranks.append([next(it) for _ in range(4)])
    for i, batch in enumerate(first):
        joined = torch.cat([ranks[r][i]["input_ids"] for r in range(3)])
        assert torch.equal(joined, batch["input_ids"])
    resumed = WindowBatches(tokens, seq_len=8, batch_size=6, grad_accum=2, seed=5)
    resumed.load_state_dict({"step": 1})
    assert torch.equal(next(iter(resumed))["input_ids"], first[2]["input_ids"])


def test_evaluation_windows_tile_the_held_out_stream():
    assert evaluation_windows(np.arange(50), 16, 0) == [(0, 16), (16, 16), (32, 16)]
    assert evaluation_windows(np.arange(50), 16, 20) == [(0, 16)]
    assert evaluation_windows(np.arange(5), 16, 0) == [(0, 4)]


# ---------------------------------------------------------------------------- the job

TINY_MODEL = {"n_layers": 1, "d_model": 32, "n_heads": 2, "d_ff": 64, "max_positions": 32}
RUNNER = Path(__file__).with_name("_pretrain_run.py")  # the CLI with the SIGKILL hooks


@pytest.fixture(scope="module")
def lm():
    return pytest.importorskip("attnlab.tasks.lm")  # until the GPT (models/gpt.py) lands


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("config") / "tiny.toml"
    lines = [f"{key} = {value}" for key, value in TINY_MODEL.items()]
    path.write_text("dropout = 0.0\n[model_config]\n" + "\n".join(lines) + "\n")
    return path


def train_args(corpus: Path, out: Path, config: Path, *extra: object) -> list[str]:
    args = ["lm", "train", "--corpus", corpus, "--out", out, "--config", config]
    args += [
        "--seq-len",
        16,
        "--batch-size",
        4,
        "--lr",
        "3e-3",
        "--cache-dir",
        out.parent / "cache",
    ]
    return [str(a) for a in (*args, "--no-progress", *extra)]


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_lm_train_learns_and_reports_held_out_perplexity(lm, corpus, tiny_config, tmp_path, capsys):
    out = tmp_path / "run"
    args = train_args(
        corpus, out, tiny_config, "--steps", 40, "--eval-every", 20, "--log-every", 10
    )
    assert main(args) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert "holding out the last" in captured.err
    for name in ("config.json", "model.safetensors", "tokenizer.json", "metrics.jsonl", "loss.png"):
        assert (out / name).is_file(), name
    assert summary["planned_warmup"] == 4  # 10% of the 40 steps
    train = [r for r in rows(out) if not r.get("eval")]
    evals = [r for r in rows(out) if r.get("eval")]
    assert [r["step"] for r in evals] == [20, 40]
    assert train[-1]["loss"] < train[0]["loss"] - 0.5
    for row in evals:
        assert row["valid_ppl"] == pytest.approx(math.exp(row["valid_loss"]))
    # the held-out loss is the mean NLL of the last 10% of the text, scored independently here
    model, tokenizer = lm.load_lm(out)
    ids = tokenizer.encode(TEXT)
    held = torch.tensor(ids[int(len(ids) * 0.9) :])
    starts = range(0, len(held) - 16, 16)
    with torch.no_grad():
        logits = torch.stack([model(held[s : s + 16][None]).logits[0] for s in starts])
    targets = torch.stack([held[s + 1 : s + 17] for s in starts])
    nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    assert evals[-1]["valid_loss"] == pytest.approx(float(nll), rel=1e-4)


def test_a_runs_plan_of_steps_and_warm_up(lm, corpus, tiny_config, tmp_path, capsys):
    config = lm.GPTConfig.preset("gpt-char", vocab_size=30, **TINY_MODEL)

    def plan(**given: object) -> tuple[int, int]:
        found = lm.plan_run(lm.LMOptions(out=tmp_path, corpus=[corpus], **given), config)
        return found.steps, found.warmup

    assert plan() == (5000, 500)  # 10% of the default 5,000 steps
    assert plan(steps=20_000) == (20_000, 1000)  # at most 1,000
    assert plan(steps=300, warmup=50) == (300, 30)  # never above 10%, with a note
    assert "warmup 50 cut to 30" in capsys.readouterr().err
    # Under a time limit the trainer plans both from its step rate (tests/test_schedule.py):
    # the run starts with the longest warm-up it may keep and no length but --steps.
    assert plan(max_minutes=1.0) == (10**9, 1000)
    assert plan(max_minutes=1.0, steps=300, warmup=50) == (300, 50)
    options = lm.LMOptions(out=tmp_path, corpus=[corpus], max_minutes=1.0, lr=1e-3)
    timed = lm.trainer_config(options, lm.plan_run(options, config))
    assert (timed.warmup_share, timed.max_seconds, timed.schedule) == (0.1, 60.0, "linear")


def test_the_default_learning_rate_follows_the_width_and_a_given_one_wins(
    lm, corpus, tiny_config, tmp_path, capsys
):
    # GPT-3's table 2.1: 6e-4 at d_model 768, 3e-4 at 1024; nanoGPT's baby GPT 1e-3 at 384
    assert [lm.default_lr(d) for d in (32, 192, 384, 768, 1024, 1600)] == [
        2e-3, 2e-3, 1e-3, 6e-4, 3e-4, 2e-4
    ]  # fmt: skip
    args = train_args(corpus, tmp_path / "run", tiny_config, "--steps", 12, "--log-every", 1)
    default = args[: args.index("--lr")] + args[args.index("--lr") + 2 :]
    assert main(default) == 0
    assert "lr 0.002 (default for d_model 32)" in capsys.readouterr().err
    assert max(r["lr"] for r in rows(tmp_path / "run") if "lr" in r) == pytest.approx(2e-3)
    given = train_args(corpus, tmp_path / "given", tiny_config, "--steps", 12, "--log-every", 1)
    assert main(given) == 0
    assert "default for d_model" not in capsys.readouterr().err
    assert max(r["lr"] for r in rows(tmp_path / "given") if "lr" in r) == pytest.approx(3e-3)


def test_a_time_limited_run_stops_near_its_plan(lm, corpus, tiny_config, tmp_path, capsys):
    out = tmp_path / "timed"
    args = train_args(corpus, out, tiny_config, "--max-minutes", "0.1", "--eval-every", 0)
    assert main([*args, "--steps", "100000"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert 10 <= summary["planned_steps"] < 100000  # planned at step 10, from the step rate
    # 10% of the steps planned when the warm-up ended; the decay's end follows the clock after
    assert summary["planned_warmup"] <= 0.2 * summary["planned_steps"] + 1
    assert summary["step"] <= summary["planned_steps"]
    lrs = [row["lr"] for row in rows(out) if "lr" in row]
    if summary["step"] == summary["planned_steps"]:  # the decay ended with the run
        assert lrs[-1] < 0.1 * max(lrs)


def test_resume_after_two_sigkills_is_bit_identical(lm, corpus, tiny_config, tmp_path):
    from conftest import assert_resume_after_two_sigkills_is_bit_identical

    def command(out: Path) -> list[str]:
        extra = ("--steps", 8, "--save-every", 3, "--eval-every", 4, "--log-every", 2)
        return train_args(corpus, out, tiny_config, *extra, "--grad-accum", 2)

    # killed writing step 6's checkpoint; resumed from step 3, killed again reading its 9th
    # batch (the first half of step 8, two micro-batches a step)
    assert_resume_after_two_sigkills_is_bit_identical(command, tmp_path, 6, 9)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(args: list[str], nodes: int = 1, rank: int = 0, port: int = 0) -> list[str]:
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes)]
    launch += ["--node_rank", str(rank), "--nproc_per_node", str(2 // nodes)]
    launch += ["--master_addr", "127.0.0.1", "--master_port", str(port or _free_port())]
    return [*launch, str(RUNNER), *args]


def _same_weights(one: Path, two: Path) -> None:
    from safetensors.torch import load_file

    a, b = load_file(str(one / "model.safetensors")), load_file(str(two / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-5), name


def _same_training(one: Path, two: Path) -> None:
    _same_weights(one, two)
    losses = [[r["loss"] for r in rows(out) if not r.get("eval")] for out in (one, two)]
    assert losses[0] == pytest.approx(losses[1], abs=1e-4)


def test_two_processes_and_two_loopback_nodes_equal_one_process(lm, corpus, tiny_config, tmp_path):
    """torchrun, 2 CPU processes (gloo): on one node, and as two nodes meeting on 127.0.0.1
    (the nodes share --out, here one folder), each = one process reading the same windows."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    extra = ("--steps", 4, "--save-every", 0, "--eval-every", 0, "--log-every", 1)
    one, two, nodes = tmp_path / "one", tmp_path / "two", tmp_path / "nodes"
    done = subprocess.run([sys.executable, str(RUNNER), *train_args(corpus, one, tiny_config, *extra)],
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    done = subprocess.run(_torchrun(train_args(corpus, two, tiny_config, *extra)), env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(done.stdout.splitlines()) == 1  # the summary once, from rank 0
    _same_training(one, two)
    port = _free_port()
    launches = [subprocess.Popen(_torchrun(train_args(corpus, nodes, tiny_config, *extra), 2, rank, port),
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for rank in (0, 1)]  # fmt: skip
    for launch in launches:
        _, errors = launch.communicate(timeout=300)
        assert launch.returncode == 0, errors[-3000:]
    _same_training(one, nodes)


def test_lm_train_refuses_an_unknown_strategy(lm, corpus, tmp_path, capsys):
    opts = lm.LMOptions(out=tmp_path / "x", corpus=[corpus], strategy="zero3")
    with pytest.raises(AttnlabError, match=r"^strategy must be one of ddp, fsdp, got 'zero3'$"):
        opts.validate()
    args = ["lm", "train", "--corpus", str(corpus), "--out", str(tmp_path / "y")]
    assert main([*args, "--strategy", "zero3"]) == 2
    assert "argument --strategy: invalid choice: 'zero3'" in capsys.readouterr().err


def _run(command: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_fsdp_trains_as_ddp_writes_its_checkpoints_and_resumes(corpus, tiny_config, tmp_path):
    """torchrun, 2 CPU processes: --strategy fsdp (torch's fully_shard) = DDP, the reference,
    in losses, gradient norms, held-out scores, weights and checkpoint files; a run resumed
    from its middle checkpoint ends as the uninterrupted one."""
    extra = ("--steps", 4, "--save-every", 2, "--eval-every", 2, "--log-every", 1,
             "--grad-accum", 2, "--keep-last", 0)  # fmt: skip
    ddp, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    _run(_torchrun(train_args(corpus, ddp, tiny_config, *extra)))
    _run(_torchrun(train_args(corpus, fsdp, tiny_config, *extra, "--strategy", "fsdp")))
    _same_training(ddp, fsdp)
    for key in ("grad_norm", "valid_loss"):
        ours, reference = ([r[key] for r in rows(out) if key in r] for out in (fsdp, ddp))
        assert len(ours) >= 2 and ours == pytest.approx(reference, rel=1e-4), key
    steps = [ddp / "checkpoints" / "step-2", fsdp / "checkpoints" / "step-2"]
    _same_weights(*steps)  # the same model.safetensors (full tensors) ...
    states = [torch.load(step / "trainer.pt", weights_only=True)["optimizer"] for step in steps]
    assert [g["params"] for g in states[0]["param_groups"]] == [
        g["params"] for g in states[1]["param_groups"]
    ]  # ... and optimizer.state_dict(), parameters by number
    assert states[0]["state"].keys() == states[1]["state"].keys()
    for number, reference in states[0]["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(states[1]["state"][number][name], reference[name], atol=1e-6)
    from safetensors.torch import load_file

    whole = fsdp / "model.safetensors"
    first = {k: v.clone() for k, v in load_file(str(whole)).items()}
    shutil.rmtree(fsdp / "checkpoints" / "step-4")  # resumed from step 2
    _run(_torchrun(train_args(corpus, fsdp, tiny_config, *extra, "--strategy", "fsdp", "--resume")))
    resumed = load_file(str(whole))
    assert all(torch.equal(resumed[name], first[name]) for name in first)
    assert [r["step"] for r in rows(fsdp) if not r.get("eval")] == [1, 2, 3, 4]


# ---------------------------------------------------------------------------- lm eval


@pytest.fixture(scope="module")
def model_dir(lm, corpus, tiny_config, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("model") / "run"
    assert main(train_args(corpus, out, tiny_config, "--steps", 10, "--eval-every", 0)) == 0
    return out


def test_lm_eval_per_line_equals_hand_computed_nll(lm, model_dir, tmp_path, capsys):
    data = tmp_path / "data.txt"
    lines = ["Speak, speak.", "", "All:", "resolved rather to die", "a"]
    data.write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    assert main(["lm", "eval", "--model", str(model_dir), "--data", str(data)]) == 0
    result = json.loads(capsys.readouterr().out)
    model, tokenizer = lm.load_lm(model_dir)
    nll, count = 0.0, 0
    with torch.no_grad():
        for line in lines:  # one line at a time, no padding: log p(x_t | x_<t), t >= 2
            ids = tokenizer.encode(line)
            for t in range(1, len(ids)):
                logits = model(torch.tensor([ids[:t]])).logits[0, -1]
                nll -= float(torch.log_softmax(logits.double(), -1)[ids[t]])
                count += 1
    assert result["tokens"] == count == 12 + 3 + 21
    assert result["loss"] == pytest.approx(nll / count, rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-5)


def test_lm_eval_stride_is_hfs_sliding_window_method(lm, model_dir, corpus, capsys):
    model, tokenizer = lm.load_lm(model_dir)
    ids = torch.tensor(tokenizer.encode(TEXT[:300]))
    window, stride = 32, 12
    nll, count, prev_end = 0.0, 0, 0  # the loop of HF's "Perplexity of fixed-length models"
    with torch.no_grad():
        for begin in range(0, len(ids), stride):
            end = min(begin + window, len(ids))
            trg_len = end - prev_end
            input_ids = ids[begin:end][None]
            targets = input_ids.clone()
            targets[:, :-trg_len] = -100
            shifted = targets[:, 1:]
            loss = model(input_ids[:, :-1], targets=shifted).loss
            n = int((shifted != -100).sum())
            nll, count = nll + float(loss) * n, count + n
            prev_end = end
            if end == len(ids):
                break
    result = lm.score_stream(model, ids.tolist(), stride, window)
    assert result["tokens"] == count == len(ids) - 1
    assert result["loss"] == pytest.approx(nll / count, rel=1e-5)
    data = corpus.parent / "head.txt"
    data.write_text(TEXT[:300])
    capsys.readouterr()
    args = ["lm", "eval", "--model", str(model_dir), "--data", str(data), "--stride", "12"]
    assert main([*args, "--seq-len", "32"]) == 0
    assert json.loads(capsys.readouterr().out)["loss"] == pytest.approx(nll / count, rel=1e-5)


def test_sliding_windows_score_every_token_but_the_first_once():
    from attnlab.tasks.lm import sliding_windows

    spans = sliding_windows(50, 16, 6)
    scored = [t for _, end, first in spans for t in range(first, end)]
    assert scored == list(range(1, 50))
    assert all(end - begin <= 16 for begin, end, _ in spans)


# ---------------------------------------------------------------------------- bad input


def _one_error(capsys, args: list[str]) -> str:
    capsys.readouterr()
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith("attnlab: error: ")
    return captured.err


def test_bad_training_input_is_one_line_and_writes_nothing(
    lm, corpus, tiny_config, tmp_path, capsys
):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    out = tmp_path / "out"
    assert "has no text" in _one_error(capsys, train_args(empty, out, tiny_config))
    assert "--steps must be at least 1" in _one_error(
        capsys, train_args(corpus, out, tiny_config, "--steps", 0)
    )
    assert "--seq-len 64 is above" in _one_error(
        capsys, train_args(corpus, out, tiny_config, "--seq-len", 64)
    )
    assert "unknown preset" in _one_error(
        capsys, [*train_args(corpus, out, tiny_config), "--preset", "gpt9"]
    )
    assert not out.exists()


def test_lm_train_flags_name_option_fields_and_leave_their_defaults_to_them(lm, capsys):
    import dataclasses

    from attnlab.cli import build_parser

    fields = {f.name: f for f in dataclasses.fields(lm.LMOptions)}
    parser = build_parser().parse_args(["lm", "train"]).command_parser
    own = {"help", "threads", "config"}
    flags = {a.dest: a.default for a in parser._actions if a.option_strings and a.dest not in own}
    assert set(flags) <= set(fields), sorted(set(flags) - set(fields))
    assert all(value is None for value in flags.values()), flags


def test_a_byte_bpe_run_is_an_hf_gpt2_folder_and_can_start_another(
    lm, corpus, tiny_config, tmp_path, capsys
):
    from transformers import GPT2LMHeadModel, GPT2TokenizerFast

    out = tmp_path / "bpe"
    args = train_args(corpus, out, tiny_config, "--tokenizer", "byte-bpe", "--vocab-size", 300)
    assert main([*args, "--steps", "6", "--eval-every", "0"]) == 0
    hf_tokenizer = GPT2TokenizerFast.from_pretrained(str(out))
    ours_model, ours_tokenizer = lm.load_lm(out)
    ids = ours_tokenizer.encode("Speak, speak. hear me")
    assert hf_tokenizer("Speak, speak. hear me")["input_ids"] == ids
    hf = GPT2LMHeadModel.from_pretrained(str(out)).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits
        assert torch.allclose(ours_model(torch.tensor([ids])).logits, expected, atol=1e-5)
    more = ["lm", "train", "--corpus", str(corpus), "--out", str(tmp_path / "more"), "--init",
            str(out), "--seq-len", "16", "--batch-size", "4", "--steps", "2", "--no-progress",
            "--cache-dir", str(tmp_path / "cache"), "--eval-every", "0"]  # fmt: skip
    assert main(more) == 0
    assert lm.LMTokenizer.from_dir(tmp_path / "more").vocab_size == ours_tokenizer.vocab_size
    assert "--init takes the model's shape" in _one_error(capsys, [*more[:-2], "--dropout", "0.1"])


def test_a_gpt_folder_given_to_finetune_is_refused(lm, model_dir, tmp_path, capsys):
    train = tmp_path / "train.tsv"
    train.write_text("good\tpositive\nbad\tnegative\n")
    out = tmp_path / "ft"
    err = _one_error(capsys, ["finetune", "--task", "classify", "--model", str(model_dir),
                              "--train", str(train), "--out", str(out)])  # fmt: skip
    assert "gpt2" in err and not out.exists()
