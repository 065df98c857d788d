"""`attnlab embed --output FILE` (.npy, .jsonl, .safetensors) and its progress bar on stderr.

The files are checked against the command's own JSON lines on stdout, which tests/test_cli.py
checks against HF transformers on all-MiniLM-L6-v2.
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Callable

import numpy as np
import pytest
import torch
from conftest import VARIED_SENTENCES
from safetensors.numpy import load_file

import attnlab.io
from attnlab.cli import main
from attnlab.io import is_leftover
from attnlab.progress import LONG_INPUT


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def cli(monkeypatch, capsys) -> Callable[..., tuple[int, str, str]]:
    """run(*argv, stdin=b"") -> (exit code, stdout, stderr) of attnlab.cli.main in-process."""

    def run(*argv: object, stdin: bytes = b"") -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
        code = main([str(arg) for arg in argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def text_lines(lines: list[str]) -> bytes:
    return "".join(line + "\n" for line in lines).encode("utf-8")


def json_rows(out: str) -> list:
    return [json.loads(line) for line in out.splitlines()]


def rounded(array: np.ndarray) -> list:
    """The array as the JSON output writes it: each float32 to 7 decimals."""
    return [[round(v, 7) for v in row] for row in array.tolist()]


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_npy_output_equals_the_json_output(cli, minilm_dir, tmp_path, pooling):
    stdin = text_lines(VARIED_SENTENCES)
    code, printed, err = cli("embed", "--model", minilm_dir, "--pooling", pooling, stdin=stdin)
    assert (code, err) == (0, "")
    target = tmp_path / "vectors.npy"
    code, out, err = cli(
        "embed", "--model", minilm_dir, "--pooling", pooling, "--output", target, stdin=stdin
    )
    assert (code, out, err) == (0, "", "")  # nothing on stdout with --output
    array = np.load(target, allow_pickle=False)
    assert array.dtype == np.float32
    assert array.shape == (len(VARIED_SENTENCES), 384)
    assert rounded(array) == json_rows(printed)  # same vectors, same (input) order


def test_jsonl_output_is_what_stdout_shows(cli, minilm_dir, tmp_path):
    stdin = text_lines(VARIED_SENTENCES[:5])
    _, printed, _ = cli("embed", "--model", minilm_dir, "--normalize", stdin=stdin)
    target = tmp_path / "vectors.jsonl"
    code, out, err = cli(
        "embed", "--model", minilm_dir, "--normalize", "--output", target, stdin=stdin
    )
    assert (code, out, err) == (0, "", "")
    assert target.read_text(encoding="utf-8") == printed


def test_safetensors_output_loads_pooled_and_per_token(cli, minilm_dir, tmp_path):
    lines = VARIED_SENTENCES[:6]
    stdin = text_lines(lines)
    _, printed, _ = cli("embed", "--model", minilm_dir, stdin=stdin)
    target = tmp_path / "vectors.safetensors"
    assert cli("embed", "--model", minilm_dir, "--output", target, stdin=stdin)[0] == 0
    assert set(load_file(target)) == {"embeddings"}
    assert rounded(load_file(target)["embeddings"]) == json_rows(printed)

    # pooling none: every line's token vectors, one after another, and where each line starts
    _, printed, _ = cli("embed", "--model", minilm_dir, "--pooling", "none", stdin=stdin)
    code, _, err = cli(
        "embed", "--model", minilm_dir, "--pooling", "none", "--output", target, "--overwrite",
        stdin=stdin,
    )  # fmt: skip
    assert (code, err) == (0, "")
    tensors = load_file(target)
    tokens, offsets = tensors["tokens"], tensors["offsets"]
    assert tokens.dtype == np.float32 and offsets.dtype == np.int64
    assert len(offsets) == len(lines) + 1 and offsets[0] == 0 and offsets[-1] == len(tokens)
    for i, matrix in enumerate(json_rows(printed)):
        assert rounded(tokens[offsets[i] : offsets[i + 1]]) == matrix


def assert_one_error(code: int, out: str, err: str, *fragments: str) -> None:
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith("attnlab: error: "), err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def test_bad_output_is_refused_before_any_work(cli, minilm_dir, tmp_path):
    stdin = text_lines(["a line"])
    result = cli("embed", "--model", minilm_dir, "--output", tmp_path / "v.txt", stdin=stdin)
    assert_one_error(*result, "--output", ".npy, .jsonl or .safetensors")
    result = cli("embed", "--model", minilm_dir, "--output", tmp_path / "v", stdin=stdin)
    assert_one_error(*result, "no suffix")
    result = cli(
        "embed", "--model", minilm_dir, "--pooling", "none", "--output", tmp_path / "v.npy",
        stdin=stdin,
    )  # fmt: skip
    assert_one_error(*result, "pooling none", ".jsonl or .safetensors")
    existing = tmp_path / "old.npy"
    existing.write_bytes(b"keep me")
    result = cli("embed", "--model", minilm_dir, "--output", existing, stdin=stdin)
    assert_one_error(*result, "exists", "--overwrite")
    assert existing.read_bytes() == b"keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.npy"]


def test_a_failed_write_leaves_no_file_and_the_old_one_whole(
    cli, minilm_dir, tmp_path, monkeypatch
):
    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(attnlab.io.os, "fsync", full_disk)  # the data is written, then fails
    stdin = text_lines(VARIED_SENTENCES)
    for name in ("new.npy", "new.safetensors", "new.jsonl"):
        result = cli("embed", "--model", minilm_dir, "--output", tmp_path / name, stdin=stdin)
        assert_one_error(*result, "No space left", name)
    old = tmp_path / "old.npy"
    old.write_bytes(b"old")
    result = cli("embed", "--model", minilm_dir, "--output", old, "--overwrite", stdin=stdin)
    assert_one_error(*result, "No space left")
    assert old.read_bytes() == b"old"
    assert not any(is_leftover(p) for p in tmp_path.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.npy"]


def test_progress_goes_to_stderr_and_leaves_stdout_unchanged(cli, minilm_dir):
    lines = [f"line {i}" for i in range(LONG_INPUT + 1)]  # long: a bar even without a terminal
    code, with_bar, err = cli("embed", "--model", minilm_dir, stdin=text_lines(lines))
    assert code == 0
    assert f"{len(lines)}/{len(lines)}" in err  # tqdm's count, finished
    assert "line" in err and "\x1b" not in with_bar and "/" not in with_bar
    code, without_bar, err = cli(
        "embed", "--model", minilm_dir, "--no-progress", stdin=text_lines(lines)
    )
    assert (code, err) == (0, "")
    assert with_bar == without_bar
    assert len(json_rows(with_bar)) == len(lines)
