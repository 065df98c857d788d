"""`attnlab attention` and its page, in a real browser: headless Chromium (Debian's chromium,
which `make test` installs) opens the page from disk with the network cut off, finds no
console message, works the layer and head selectors and sees the drawing change; a 512-token,
24-layer, 16-head page loads and warns that it was down-sampled. Bad input: one line, exit 2."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from attnlab.cli import main
from attnlab.inspect.maps import AttentionMaps
from attnlab.inspect.page import render_page

pytestmark = pytest.mark.usefixtures("one_thread")

SENTENCE = "The river bank was muddy after the rain."


def chromium() -> str:
    """The Chromium (or Chrome) binary: a test dependency, installed by `make test`."""
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    raise AssertionError("no chromium on PATH: `make test` installs Debian's chromium")


def browse(tmp_path: Path, url: str, *flags: str) -> tuple[str, str]:
    """Headless Chromium on url with no network; (stdout, console lines of stderr)."""
    command = [
        chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0",
        "--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=127.0.0.1:9",
        "--proxy-bypass-list=<-loopback>", "--disable-background-networking",
        *flags, url,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    console = [line for line in done.stderr.splitlines() if "CONSOLE" in line]
    return done.stdout, console


def self_test(tmp_path: Path, page: Path) -> dict:
    """The page's own report after working its controls (#selftest), checked for console silence."""
    dom, console = browse(tmp_path, page.resolve().as_uri() + "#selftest", "--dump-dom")
    assert console == []  # no error, warning or log line at all
    match = re.search(r'<pre id="attnlab-selftest"[^>]*>([^<]*)</pre>', dom)
    assert match and match[1], "the page's script did not finish"
    report = json.loads(match[1].replace("&amp;", "&").replace("&quot;", '"'))
    assert report["errors"] == []
    return report


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk (and a check that it is a PNG)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def run_cli(capsys, *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def translation_dir(tmp_path_factory) -> Path:
    from test_attention_maps import make_translation_dir

    return make_translation_dir(tmp_path_factory.mktemp("mt") / "model")


def test_bert_page_works_offline_in_a_browser(minilm_dir, tmp_path, capsys):
    page = tmp_path / "bert.html"
    code, out, err = run_cli(capsys, "attention", "--model", minilm_dir, SENTENCE,
                             "--pair", "I took a loan from the bank.", "--out", page)  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["kinds"] == ["encoder"]
    html = page.read_text(encoding="utf-8")
    assert not re.search(r"""(src|href)\s*=|@import|url\(""", html)  # nothing to fetch
    report = self_test(tmp_path, page)
    [kind] = report["kinds"]
    assert kind["name"] == "encoder" and kind["changed"] and kind["selected"] == [0, 0]
    assert kind["before"]["ink"] > 1000 and kind["after"]["ink"] > 1000
    assert kind["all"]["hash"] not in (kind["before"]["hash"], kind["after"]["hash"])
    assert report["model"]["ink"] > 10000
    assert report["clicked"] == [5, 11] and report["headViewShown"]  # the last layer's last head
    assert report["warnings"] == []


def test_translation_page_shows_three_kinds(translation_dir, tmp_path, capsys):
    page = tmp_path / "mt.html"
    code, _, err = run_cli(capsys, "attention", "--model", translation_dir,
                             "ein Mann fährt Fahrrad.", "--out", page)  # fmt: skip
    assert code == 0, err
    report = self_test(tmp_path, page)
    assert [k["name"] for k in report["kinds"]] == ["encoder", "decoder", "cross"]
    assert all(k["changed"] for k in report["kinds"])
    assert report["clicked"] == [2, 3]  # the cross-attention's last layer and head


def test_gpt_page_shows_causal_attention(tmp_path, capsys):
    import transformers

    from attnlab.text.lm_tokenizer import char_tokenizer

    folder = tmp_path / "gpt"
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    char_tokenizer("abcdefghijklmnopqrstuvwxyz .").save(folder)
    page = tmp_path / "gpt.html"
    code, out, err = run_cli(capsys, "attention", "--model", folder, "the cat sat.", "--out", page)
    assert code == 0, err
    assert json.loads(out)["kinds"] == ["decoder"]
    report = self_test(tmp_path, page)
    assert [k["name"] for k in report["kinds"]] == ["decoder"] and report["kinds"][0]["changed"]
    assert "Causal self-attention" in page.read_text(encoding="utf-8")


def test_a_512_token_24_layer_16_head_page_loads_and_warns(tmp_path):
    torch.manual_seed(0)
    n, layers, heads = 512, 24, 16
    scores = torch.randn(layers, heads, n, n) * 3
    maps = AttentionMaps([f"t{i}" for i in range(n)], encoder=scores.softmax(-1))
    html, stats = render_page(maps, "long")
    assert stats.top_k is not None and 0 < stats.kept_share < 1
    page = tmp_path / "long.html"
    page.write_text(html, encoding="utf-8")
    assert page.stat().st_size < 40_000_000
    report = self_test(tmp_path, page)
    assert report["kinds"][0]["changed"]
    assert any("Down-sampled" in w for w in report["warnings"])
    print(f"512 tokens x 24 layers x 16 heads: script {report['renderMs']:.0f} ms, "
          f"load {report['loadMs']:.0f} ms")  # fmt: skip


def test_screenshots_of_both_views(minilm_dir, tmp_path, capsys):
    page = tmp_path / "bert.html"
    assert run_cli(capsys, "attention", "--model", minilm_dir, SENTENCE, "--out", page)[0] == 0
    for view in ("head", "model"):
        shot = tmp_path / f"{view}.png"
        url = page.resolve().as_uri() + f"#view={view}&layer=2&head=3"
        browse(tmp_path, url, "--window-size=900,700", f"--screenshot={shot}")
        assert png_size(shot) == (900, 700)
        pixels = _pixels(shot)
        assert pixels.min() < 100 and pixels.max() > 200  # ink on a white page


def _pixels(path: Path):
    import matplotlib.image

    return (matplotlib.image.imread(path)[..., :3] * 255).round()


def test_json_output(minilm_dir, tmp_path, capsys):
    out = tmp_path / "a.json"
    code, _, err = run_cli(capsys, "attention", "--model", minilm_dir, SENTENCE, "--out", out,
                           "--layers", "0,5", "--heads", "0-3")  # fmt: skip
    assert code == 0, err
    data = json.loads(out.read_text(encoding="utf-8"))
    assert set(data) == {"tokens", "attention"} and data["tokens"][0] == "[CLS]"
    weights = torch.tensor(data["attention"]["encoder"])
    assert weights.shape == (2, 4, len(data["tokens"]), len(data["tokens"]))
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, len(data["tokens"])))


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--out", "{tmp}/a.txt"], "must end in .html"),
        (
            ["--out", "{tmp}/a.png", "--layer", "6"],
            "--layer 6 is out of range: this model numbers them 0-5",
        ),
        (["--out", "{tmp}/a.png", "--head", "-1"], "--head -1 is out of range"),
        (
            ["--out", "{tmp}/a.html", "--heads", "12"],
            "--heads 12 is out of range: this model numbers them 0-11",
        ),
        (["--out", "{tmp}/a.html", "--layers", "x"], "--layers takes numbers"),
        (["--out", "{tmp}/a.png", "--kind", "cross"], "'cross' is not among"),
        (["--out", "{tmp}/a.png", "--target", "x"], "--target is for translation"),
        (["--out", "{tmp}/file/a.html"], "is a file"),
    ],
)
def test_bad_options_are_one_line(minilm_dir, tmp_path, capsys, flags, fragment):
    (tmp_path / "file").write_text("x")
    argv = [a.format(tmp=tmp_path) for a in flags]
    code, out, err = run_cli(capsys, "attention", "--model", minilm_dir, SENTENCE, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("attnlab: error:") and fragment in err, err
    assert not (tmp_path / "a.png").exists() and not (tmp_path / "a.html").exists()


def test_bad_models_and_long_text_are_one_line(minilm_dir, tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("no model here")
    out = tmp_path / "a.html"
    for model, text, fragment in [
        (other, SENTENCE, "no config.json"),
        (tmp_path / "missing", SENTENCE, "does not exist"),
        (minilm_dir, "word " * 600, "at most 512: shorten it or pass --truncate"),
    ]:
        code, _, err = run_cli(capsys, "attention", "--model", model, text, "--out", out)
        assert code == 2 and err.count("\n") == 1 and fragment in err, err
    code, _, err = run_cli(capsys, "attention", "--model", minilm_dir, "word " * 600,
                           "--truncate", "--out", out, "--layers", "0", "--heads", "0")  # fmt: skip
    assert code == 0, err
    code, _, err = run_cli(capsys, "attention", "--model", minilm_dir, SENTENCE, "--out", out)
    assert code == 2 and "exists" in err and "--overwrite" in err


def test_a_fine_tuned_checkpoint_shows_its_encoders_attention(minilm_dir, tmp_path, capsys):
    from attnlab.interop.hf import load_task_model, save_task_model
    from attnlab.text.tokenizer import BertTokenizer

    model, _ = load_task_model(minilm_dir, "classify", num_labels=2, new_head=True)
    save_task_model(model, tmp_path / "task", BertTokenizer.from_dir(minilm_dir), ["neg", "pos"])
    out, reference = tmp_path / "task.json", tmp_path / "encoder.json"
    for folder, path in ((tmp_path / "task", out), (minilm_dir, reference)):
        code, _, err = run_cli(capsys, "attention", "--model", folder, SENTENCE, "--out", path)
        assert code == 0, err
    assert json.loads(out.read_text()) == json.loads(reference.read_text())
