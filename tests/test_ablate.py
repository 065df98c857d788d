"""The positional-encoding ablation (tasks/ablate.py): two tiny schemes, a few steps each.

Checked: every (scheme, length) cell of the table is present, ``learned`` past its table is
marked rather than crashed, rerunning skips finished schemes (and trains only the missing
one), the summary files agree with the per-run results, and perplexity is exp(loss).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from attnlab.errors import AttnlabError
from attnlab.tasks import ablate
from attnlab.tasks.ablate import (
    TABLE_NOTE,
    AblateOptions,
    ablate_positions,
    parse_lengths,
    parse_schemes,
    table_size,
)

CORPUS = Path(__file__).resolve().parents[1] / "src/attnlab/data/pretrain_sample.txt"


def _options(tmp_path: Path, **overrides) -> AblateOptions:
    settings = dict(
        out=tmp_path / "ablation", corpus=[CORPUS], task="mlm", preset="bert-tiny", steps=3,
        schemes=["learned", "alibi"], train_length=16, eval_lengths=[1, 2, 4], batch_size=4,
        eval_tokens=256, progress=False, cache_dir=tmp_path / "cache",
    )  # fmt: skip
    return AblateOptions(**{**settings, **overrides})


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[AblateOptions, dict]:
    tmp_path = tmp_path_factory.mktemp("ablate")
    opts = _options(tmp_path)
    return opts, ablate_positions(opts)


def test_every_cell_is_present_and_learned_past_its_table_is_marked(finished) -> None:
    opts, summary = finished
    lengths = ["16", "32", "64"]
    assert list(summary["schemes"]) == ["learned", "alibi"]
    for scheme, row in summary["schemes"].items():
        assert list(row["cells"]) == lengths and row["steps"] == 3
        for n in lengths:
            cell = row["cells"][n]
            if scheme == "learned" and n != "16":
                assert cell == {"note": TABLE_NOTE}
            else:
                assert math.isfinite(cell["loss"]) and cell["seeds"] == 1
                assert cell["perplexity"] == pytest.approx(math.exp(cell["loss"]))
    # the learned table has one row per trained position; the others reach the longest window
    assert table_size("learned", opts) == 16 and table_size("alibi", opts) == 64


def test_summary_files_hold_the_same_table(finished) -> None:
    opts, summary = finished
    saved = json.loads((opts.out / "results.json").read_text(encoding="utf-8"))
    assert saved["schemes"] == json.loads(json.dumps(summary["schemes"]))
    table = (opts.out / "results.md").read_text(encoding="utf-8")
    assert "| scheme | 16 (1x) | 32 (2x) | 64 (4x) | steps | training time |" in table
    learned = next(line for line in table.splitlines() if line.startswith("| learned "))
    assert learned.count(TABLE_NOTE) == 2
    alibi = next(line for line in table.splitlines() if line.startswith("| alibi "))
    # alibi alone scores 32 and 64: the best of those columns, in bold
    assert alibi.count("**") == 4
    assert (opts.out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for scheme in ("learned", "alibi"):
        result = json.loads((opts.out / "runs" / f"{scheme}-seed0" / "result.json").read_text())
        assert result["scheme"] == scheme and result["steps"] == 3


def test_a_rerun_skips_finished_schemes_and_trains_only_the_rest(finished, monkeypatch) -> None:
    opts, _ = finished
    trained: list[str] = []
    real_train = ablate.MaskedLMRuns.train

    def counting_train(self, scheme, seed, steps, run_dir):
        trained.append(scheme)
        return real_train(self, scheme, seed, steps, run_dir)

    monkeypatch.setattr(ablate.MaskedLMRuns, "train", counting_train)
    again = ablate_positions(opts)
    assert trained == []  # both were done
    assert again["schemes"] == json.loads(json.dumps(finished[1]["schemes"]))
    # as if killed after learned: alibi's result is gone, so only alibi trains again
    (opts.out / "runs" / "alibi-seed0" / "result.json").unlink()
    ablate_positions(opts)
    assert trained == ["alibi"]


def test_a_rerun_with_other_settings_is_refused(finished) -> None:
    opts, _ = finished
    other = _options(opts.out.parent, steps=4)
    with pytest.raises(AttnlabError, match=r"other settings \(steps\)"):
        ablate_positions(other)


def test_seeds_give_mean_and_spread(tmp_path) -> None:
    opts = _options(tmp_path, schemes=["sinusoidal"], seeds=2, eval_lengths=[1, 2], steps=2)
    summary = ablate_positions(opts)
    cell = summary["schemes"]["sinusoidal"]["cells"]["16"]
    runs = [r for r in summary["runs"] if r["scheme"] == "sinusoidal"]
    perplexities = [math.exp(r["loss"]["16"]) for r in runs]
    assert [r["seed"] for r in runs] == [0, 1] and cell["seeds"] == 2
    assert cell["perplexity"] == pytest.approx(sum(perplexities) / 2)
    assert cell["spread"] == pytest.approx(abs(perplexities[0] - perplexities[1]) / math.sqrt(2))
    assert " ± " in (opts.out / "results.md").read_text(encoding="utf-8")


def test_minutes_fix_one_step_count_for_every_scheme(tmp_path) -> None:
    opts = _options(tmp_path, minutes=0.02, steps=1000, eval_lengths=[1])
    summary = ablate_positions(opts)
    state = json.loads((opts.out / "ablation.json").read_text(encoding="utf-8"))
    assert state["steps"] == summary["steps"] >= 1 and state["probe_seconds_per_step"] > 0
    assert {row["steps"] for row in summary["schemes"].values()} == {state["steps"]}
    assert not (opts.out / "probe").exists()


def test_parsing_and_validation() -> None:
    assert parse_schemes("all")[0] == "learned" and "shaw" in parse_schemes("all")
    assert parse_schemes("rope, alibi") == ["rope", "alibi"]
    assert parse_lengths("1,2,4,8") == [1, 2, 4, 8]
    with pytest.raises(AttnlabError, match="eval_lengths must be integers"):
        parse_lengths("1,two")
    with pytest.raises(AttnlabError, match="unknown: wavelet"):
        _options(Path("/tmp/x"), schemes=["rope", "wavelet"]).validate()
    with pytest.raises(AttnlabError, match="increasing multiples"):
        _options(Path("/tmp/x"), eval_lengths=[2, 1]).validate()
    with pytest.raises(AttnlabError, match="task must be lm or mlm"):
        _options(Path("/tmp/x"), task="seq2seq").validate()


def test_the_command_line_runs_it_and_names_flags_in_errors(tmp_path, capsys) -> None:
    from attnlab.cli import main

    argv = [
        "ablate", "positions", "--corpus", str(CORPUS), "--out", str(tmp_path / "cli"),
        "--task", "mlm", "--preset", "bert-tiny", "--steps", "2", "--schemes", "learned,rope",
        "--train-length", "16", "--eval-lengths", "1,2", "--batch-size", "4",
        "--eval-tokens", "128", "--cache-dir", str(tmp_path / "cache"), "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["steps"] == 2 and printed["perplexity"]["learned"]["32"] == TABLE_NOTE
    assert printed["perplexity"]["rope"]["32"] > 1
    assert main([*argv, "--schemes", "rope,wavelet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnlab: error: --schemes must name each scheme once")
    assert main([*argv, "--steps", "3"]) == 2  # the same --out, another budget
    assert "holds an ablation with other settings (steps)" in capsys.readouterr().err


def test_the_lm_task_scores_every_length(tmp_path) -> None:
    pytest.importorskip("attnlab.models.gpt")
    pytest.importorskip("attnlab.tasks.lm")
    tiny = {"n_layers": 1, "d_model": 32, "n_heads": 2, "d_ff": 64}
    opts = _options(tmp_path, task="lm", preset=None, model_config=tiny, lr=1e-3,
                    schemes=["learned", "shaw"], eval_tokens=512)  # fmt: skip
    summary = ablate_positions(opts)
    cells = summary["schemes"]
    assert cells["learned"]["cells"]["32"] == {"note": TABLE_NOTE}
    assert all(math.isfinite(cells["shaw"]["cells"][n]["loss"]) for n in ("16", "32", "64"))
    assert (opts.out / "runs" / "shaw-seed0" / "config.json").is_file()


def test_model_config_cannot_set_what_the_ablation_varies() -> None:
    opts = _options(Path("/tmp/x"), model_config={"position_encoding": "rope", "max_positions": 9})
    with pytest.raises(AttnlabError, match="sets max_positions, position_encoding itself"):
        opts.validate()
