"""`attnlab translate train | translate | translate score` end to end on a tiny model and data:
outputs, checkpoint averaging, resume, and every bad input as one `attnlab: error:` line with
exit code 2 and nothing written."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_resume_after_two_sigkills_is_bit_identical
from safetensors.torch import load_file, save_file

from attnlab.cli import main
from attnlab.errors import AttnlabError
from attnlab.tasks.translate import average_checkpoints, bundled_pairs, load_translation_model

TINY = """[model_config]
d_model = 32
n_heads = 2
d_ff = 64
n_encoder_layers = 1
n_decoder_layers = 1
max_positions = 32
"""
STEPS = 12


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def cli(monkeypatch, capsys):
    """run(*argv, stdin="") -> (exit code, stdout, stderr) of attnlab.cli.main in-process."""

    def run(*argv: object, stdin: str = "") -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin.encode())))
        code = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def assert_one_error(code: int, out: str, err: str, *fragments: str) -> None:
    assert code == 2, (code, err)
    assert out == ""
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("attnlab: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """60 training pairs (two files, one pair with an empty side) and 8 validation pairs (TSV)."""
    root = tmp_path_factory.mktemp("data")
    pairs = [line.split("\t") for line in bundled_pairs().read_text().splitlines()]
    train, valid = pairs[:60], pairs[60:68]
    train[5] = [train[5][0], ""]  # skipped, with a note
    (root / "train.de").write_text("".join(de + "\n" for de, _ in train))
    (root / "train.en").write_text("".join(en + "\n" for _, en in train))
    (root / "valid.tsv").write_text("".join(f"{de}\t{en}\n" for de, en in valid))
    (root / "tiny.toml").write_text(TINY)
    return root


def train_args(
    data: Path, out: Path, *extra: object, tokenizer: Path | None = None
) -> list[object]:
    """A tiny run's arguments: a BPE of 300 learnt on the data, or the given tokenizer's."""
    vocabulary = ["--tokenizer", tokenizer] if tokenizer else ["--vocab-size", 300]
    return [
        "translate", "train", "--threads", 1, "--config", data / "tiny.toml",
        "--train", data / "train.de", data / "train.en", "--valid", data / "valid.tsv",
        "--out", out, *vocabulary, "--max-tokens", 256, "--steps", STEPS,
        "--save-every", 4, "--eval-every", 6, "--eval-sentences", 4, "--log-every", 2,
        "--no-progress", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def run_dir(data, tmp_path_factory) -> tuple[Path, dict, str]:
    """One finished training run: (out dir, printed summary, stderr)."""
    out = tmp_path_factory.mktemp("runs") / "run"
    capture = io.StringIO()
    old_out, old_err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = capture, io.StringIO()
    try:
        code = main([str(a) for a in train_args(data, out, "--average-last", 3)])
        err = sys.stderr.getvalue()
    finally:
        sys.stdout, sys.stderr = old_out, old_err
    assert code == 0, err
    return out, json.loads(capture.getvalue()), err


def test_training_writes_a_translation_model(run_dir):
    out, summary, err = run_dir
    for name in ("config.json", "model.safetensors", "tokenizer.json", "metrics.jsonl", "loss.png"):
        assert (out / name).is_file(), name
    assert (out / "best" / "model.safetensors").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "attnlab-transformer" and config["d_model"] == 32
    assert "skipped 1 training pair(s) with an empty side" in err
    assert summary["step"] == STEPS and summary["averaged_steps"] == [4, 8, 12]
    assert "valid_bleu" in summary["eval"] and "valid_loss" in summary["averaged_eval"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [row for row in rows if row.get("eval")]
    assert [row["step"] for row in evals] == [6, 12]
    train_rows = [row for row in rows if not row.get("eval")]
    assert train_rows[0]["lr"] > 0 and "nll_loss" in train_rows[0]


def test_final_model_is_the_mean_of_the_last_checkpoints(run_dir):
    out, _, _ = run_dir
    steps = [out / "checkpoints" / f"step-{s}" for s in (4, 8, 12)]
    final = load_file(str(out / "model.safetensors"))
    weights = [load_file(str(step / "model.safetensors")) for step in steps]
    assert final.keys() == weights[0].keys()
    for name, tensor in final.items():
        expected = torch.stack([w[name] for w in weights]).double().mean(0).float()
        torch.testing.assert_close(tensor, expected, rtol=0, atol=1e-7)
    assert average_checkpoints(steps[2:]).keys() == final.keys()
    torch.testing.assert_close(average_checkpoints(steps[2:])["src_embed.weight"],
                               weights[2]["src_embed.weight"], rtol=0, atol=0)  # fmt: skip


def test_translate_keeps_lines_and_order(run_dir, cli):
    out, _, _ = run_dir
    lines = ["Der Mann liest ein Buch.", "", "Guten Morgen!", "Das Wetter ist heute schön."]
    code, stdout, err = cli("translate", "--model", out, "--beam", 2, stdin="\n".join(lines) + "\n")
    assert code == 0, err
    hyps = stdout.split("\n")[:-1]
    assert len(hyps) == len(lines) and hyps[1] == ""
    # the same sentences one at a time give the same translations (batching changes nothing)
    code, single, _ = cli("translate", "--model", out, "--beam", 2, "--batch-size", 1,
                          stdin="\n".join(lines) + "\n")  # fmt: skip
    assert single == stdout
    # and so does decoding two of those batches at once (one thread each)
    code, two, _ = cli("translate", "--model", out, "--beam", 2, "--batch-size", 1,
                       "--workers", 2, stdin="\n".join(lines) + "\n")  # fmt: skip
    assert code == 0 and two == stdout
    assert_one_error(*cli("translate", "--model", out, "--workers", 0), "--workers must be")
    code, greedy, _ = cli("translate", "--model", out, "--greedy", stdin=lines[0] + "\n")
    assert code == 0 and len(greedy.splitlines()) == 1


def test_translate_progress_goes_to_stderr_and_leaves_stdout_unchanged(run_dir, cli):
    from attnlab.progress import LONG_INPUT
    from attnlab.tasks.translate import translate_lines

    out, _, _ = run_dir
    words = ["Der Mann liest.", "Guten Morgen!", "", "Das Wetter ist schön.", "Ein Hund."]
    lines = [words[i % len(words)] for i in range(LONG_INPUT + 1)]  # long: a bar in a log too
    stdin = "\n".join(lines) + "\n"
    args = ("translate", "--model", out, "--greedy", "--batch-size", 16, "--max-len-b", 4)
    code, with_bar, err = cli(*args, "--workers", 2, stdin=stdin)
    assert code == 0, err
    assert f"{len(lines)}/{len(lines)}" in err  # tqdm's count, finished
    code, without_bar, err = cli(*args, "--no-progress", stdin=stdin)
    assert (code, err) == (0, "")
    assert with_bar == without_bar and len(with_bar.split("\n")) == len(lines) + 1
    # the library's callback: told of every line once (the empty ones too)
    model, tokenizer = load_translation_model(out)
    done: list[int] = []
    hyps = translate_lines(model, tokenizer, lines[:40], beam=1, batch_size=4, max_len_b=4,
                           progress=done.append)  # fmt: skip
    assert sum(done) == 40 and len(done) > 1
    assert hyps == with_bar.split("\n")[:40]
    score = ("score", "--model", out, "--src", out, "--ref", out)
    assert_one_error(*cli("translate", "--no-progress", *score), "--no-progress", "score")


def test_translate_truncates_a_long_source_with_a_warning(run_dir, cli):
    out, _, _ = run_dir
    long_line = " ".join(["Der Mann liest ein Buch und"] * 20)
    code, stdout, err = cli("translate", "--model", out, "--greedy", stdin=long_line + "\n")
    assert code == 0 and len(stdout.splitlines()) == 1
    assert "warning: 1 source line(s) too long were truncated" in err


def test_score_prints_sacrebleu_json(run_dir, data, cli, tmp_path):
    out, _, _ = run_dir
    pairs = [line.split("\t") for line in (data / "valid.tsv").read_text().splitlines()]
    (tmp_path / "src").write_text("".join(de + "\n" for de, _ in pairs))
    (tmp_path / "ref").write_text("".join(en + "\n" for _, en in pairs))
    code, stdout, err = cli("translate", "score", "--model", out, "--src", tmp_path / "src",
                            "--ref", tmp_path / "ref", "--beam", 2)  # fmt: skip
    assert code == 0, err
    result = json.loads(stdout)
    assert 0 <= result["bleu"] <= 100 and result["sentences"] == len(pairs)
    assert result["signature"].startswith("nrefs:1|") and "tok:13a" in result["signature"]
    (tmp_path / "ref").write_text("one line\n")
    assert_one_error(*cli("translate", "score", "--model", out, "--src", tmp_path / "src",
                          "--ref", tmp_path / "ref"), "--src has 8 lines but --ref has 1")  # fmt: skip


def test_translate_options_before_a_subcommand_are_refused_not_dropped(run_dir, data, cli):
    # argparse gives `score` its own --beam default over a --beam before it: this scored
    # with beam 4 and said "beam": 4; before `train`, --threads went unused.
    out, _, _ = run_dir
    valid = data / "valid.tsv"
    assert_one_error(*cli("translate", "--beam", 1, "score", "--model", out, "--src", valid,
                          "--ref", valid), "--beam before 'score' would be ignored")  # fmt: skip
    assert_one_error(*cli("translate", "--greedy", "--threads", 1, "train", "--out", out),
                     "--greedy, --threads before 'train'")  # fmt: skip


def test_resume_continues_the_run(run_dir, data, cli, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(run_dir[0], out)
    args = train_args(data, out, "--resume")
    args[args.index("--steps") + 1] = STEPS + 2
    code, stdout, err = cli(*args)
    assert code == 0, err
    assert json.loads(stdout)["step"] == STEPS + 2
    model, tokenizer = load_translation_model(out)
    assert model.config.d_model == 32 and tokenizer.vocab_size <= 300


def test_resume_after_two_sigkills_is_bit_identical(run_dir, data, tmp_path):
    # Two token-count batches a step (they cross epochs), the best-BLEU model in best/ and the
    # final model the mean of the last 3 checkpoints. One vocabulary for both runs: each would
    # learn its own, and HF tokenizers may break ties between merges differently.
    def command(out: Path) -> list[object]:
        extra = ("--grad-accum", 2, "--average-last", 3)
        return train_args(data, out, *extra, tokenizer=run_dir[0])

    assert_resume_after_two_sigkills_is_bit_identical(command, tmp_path, 8, 10)  # 2: step 9
    assert (tmp_path / "killed" / "best" / "model.safetensors").is_file()


def test_resume_with_another_model_is_refused(run_dir, data, cli, tmp_path):
    # A resumed run keeps its own config.json; before, --preset or --dropout given on resume
    # were dropped in silence and the run went on with its first model.
    out = tmp_path / "copy"
    shutil.copytree(run_dir[0], out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    wider = tmp_path / "wider.toml"
    wider.write_text(TINY.replace("d_ff = 64", "d_ff = 128"))
    code, _, err = cli(*train_args(data, out, "--resume", "--dropout", 0.3))
    assert_one_error(code, _, err, "dropout 0.3 (the run's: 0.1)", "--overwrite")
    args = train_args(data, out, "--resume")
    args[args.index(data / "tiny.toml")] = wider
    assert_one_error(*cli(*args), "d_ff 128 (the run's: 64)")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


# ---- bad input: one line, exit 2, nothing written ---------------------------------------------


def test_mismatched_line_counts(data, cli, tmp_path):
    (tmp_path / "short.en").write_text("Hello.\n")
    out = tmp_path / "out"
    args = train_args(data, out)
    args[args.index(data / "train.en")] = tmp_path / "short.en"
    assert_one_error(*cli(*args), "has 60 lines but target", "has 1")
    assert not out.exists()


def test_out_holding_a_run_is_refused(run_dir, data, cli):
    out = run_dir[0]
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert_one_error(*cli(*train_args(data, out)), "holds a run", "--resume", "--overwrite")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_resume_of_another_kind_of_run_is_refused(data, cli, tmp_path):
    out = tmp_path / "bert-run"
    out.mkdir()
    (out / "config.json").write_text('{"model_type": "bert"}')
    (out / "metrics.jsonl").write_text("")
    assert_one_error(*cli(*train_args(data, out, "--resume")), "not an attnlab translation model")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "metrics.jsonl"]


def test_a_bert_directory_is_not_a_translation_model(minilm_dir, cli, tmp_path):
    assert_one_error(*cli("translate", "--model", minilm_dir, stdin="Hallo\n"),
                     "not an attnlab translation model", "'bert'")  # fmt: skip
    (tmp_path / "s").write_text("a\n")
    assert_one_error(*cli("translate", "score", "--model", minilm_dir, "--src", tmp_path / "s",
                          "--ref", tmp_path / "s"), "not an attnlab translation model")  # fmt: skip
    assert_one_error(*cli("translate", "--model", tmp_path / "nowhere"), "not found")
    assert_one_error(*cli("translate"), "translate needs --model DIR")


def test_bad_options_and_files(data, cli, tmp_path):
    out = tmp_path / "out"
    bad_tsv = tmp_path / "bad.tsv"
    bad_tsv.write_text("a\tb\nno tab\n")
    cases = [
        (["--preset", "transformer-huge"], "unknown --preset"),
        (["--steps", 0], "--steps must be at least 1"),
        (["--resume", "--overwrite"], "--resume and --overwrite contradict"),
        (["--max-tokens", 8], "below the longest sentence pair"),
    ]
    for extra, message in cases:
        assert_one_error(*cli(*train_args(data, out, *extra)), message)
    args = train_args(data, out)
    start = args.index("--train")
    args[start + 1 : start + 3] = [bad_tsv]
    assert_one_error(*cli(*args), "line 2: expected 'source<TAB>target'")
    args[start + 1] = tmp_path / "missing.tsv"
    assert_one_error(*cli(*args), "not found")
    assert_one_error(*cli("translate", "trian"), "invalid choice")
    assert not out.exists()


def test_vocab_size_with_a_tokenizer_is_refused_not_ignored(run_dir, data, cli, tmp_path):
    # The run trained with the --tokenizer's vocabulary whatever --vocab-size (300 here) said.
    out = tmp_path / "out"
    assert_one_error(*cli(*train_args(data, out, "--tokenizer", run_dir[0])),
                     "--tokenizer brings its own")  # fmt: skip
    assert not out.exists()


def test_an_unknown_model_config_field_is_named_as_such(data, cli, tmp_path):
    # A run option written after [model_config] in TOML lands in that table: the error said
    # "config: unknown field(s) average_last", though average_last is a --config option.
    config = tmp_path / "run.toml"
    config.write_text(TINY + "average_last = 3\n")
    args = train_args(data, tmp_path / "out")
    args[args.index("--config") + 1] = config
    assert_one_error(*cli(*args), "model_config: unknown TransformerConfig field(s) average_last",
                     "[model_config]")  # fmt: skip


def test_refused_options_leave_an_existing_run_and_a_new_out_as_they_were(run_dir, data, cli,
                                                                         tmp_path):  # fmt: skip
    # translate train wrote the config and vocabulary (and, with --overwrite, cleared the old
    # model) before the trainer's settings were checked.
    out = run_dir[0]
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    for extra in (["--lr", 0], ["--warmup", 0], ["--keep-last", -1], ["--lr", "inf"],
                  ["--eval-beam", 2**63 - 1]):  # fmt: skip
        assert_one_error(*cli(*train_args(data, out, "--overwrite", *extra)), extra[0][2:])
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
        fresh = tmp_path / "fresh"
        assert_one_error(*cli(*train_args(data, fresh, *extra)), extra[0][2:])
        assert not fresh.exists()


def test_empty_valid_files_are_refused_not_skipped(data, cli, tmp_path):
    (tmp_path / "empty.tsv").write_text("\n")
    args = train_args(data, tmp_path / "out")
    args[args.index(data / "valid.tsv")] = tmp_path / "empty.tsv"
    assert_one_error(*cli(*args), "--valid holds no sentence pair")


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--max-len-a", 0, "--max-len-b", 0.5], "sum to at least 1"),
        (["--max-len-b", -5], "--max-len-a and --max-len-b"),
        (["--max-len-a", "inf"], "finite"),
        (["--length-penalty", "nan"], "--length-penalty"),
        (["--beam", "9223372036854775807"], "--beam must be from 1 to 1024"),
        (["--length-penalty", 1000], "--length-penalty must be from -50.0 to 50.0"),  # overflowed
    ],
    ids=["below-one", "negative", "infinite", "nan-penalty", "huge-beam", "huge-penalty"],
)
def test_decoding_settings_that_give_no_output_are_refused(run_dir, cli, flags, fragment):
    assert_one_error(*cli("translate", "--model", run_dir[0], *flags, stdin="Hallo\n"), fragment)


def test_a_huge_max_len_is_capped_at_the_models_positions(run_dir, cli):
    # a * len + b past int64 became the minimum int, clamped to 0: every output line empty
    flags = ["--greedy", "--max-len-b", "0"]
    code, huge, err = cli("translate", "--model", run_dir[0], "--max-len-a", "1e20", *flags,
                          stdin="Der Mann liest.\n")  # fmt: skip
    assert code == 0, err
    _, capped, _ = cli("translate", "--model", run_dir[0], "--max-len-a", "1000", *flags,
                       stdin="Der Mann liest.\n")  # fmt: skip
    assert huge == capped and huge.strip()


def test_a_model_with_nan_or_integer_weights_is_refused(run_dir, cli, tmp_path):
    # NaN: it translated every line into garbage, exit 0
    model = tmp_path / "nan"
    shutil.copytree(run_dir[0], model)
    weights = load_file(str(model / "model.safetensors"))
    name = next(k for k in weights if weights[k].is_floating_point())
    weights[name][0] = float("nan")
    save_file(weights, str(model / "model.safetensors"))
    result = cli("translate", "--model", model, "--greedy", stdin="Hallo\n")
    assert_one_error(*result, f"weight {name}", "NaN or infinite")
    weights[name] = weights[name].nan_to_num().round().int()  # integers were cast in silence
    save_file(weights, str(model / "model.safetensors"))
    result = cli("translate", "--model", model, "--greedy", stdin="Hallo\n")
    assert_one_error(*result, f"weight {name}", "holds I32, not floats")


def test_score_of_empty_files_and_unknown_tokenizer(run_dir, cli, tmp_path):
    (tmp_path / "empty").write_text("")
    (tmp_path / "one").write_text("Hallo.\n")
    score = ["translate", "score", "--model", run_dir[0]]
    assert_one_error(*cli(*score, "--src", tmp_path / "empty", "--ref", tmp_path / "empty"),
                     "no sentences to score")  # fmt: skip
    result = cli(*score, "--src", tmp_path / "one", "--ref", tmp_path / "one", "--tokenize", "x")
    assert_one_error(*result, "unknown BLEU tokenizer 'x'", "13a")
    # spm needs sentencepiece and a download: one error line, without the notice sacreBLEU
    # logs first (to the stderr of a fresh process, which an in-process run does not catch)
    argv = [*score, "--src", tmp_path / "one", "--ref", tmp_path / "one", "--tokenize", "spm"]
    done = subprocess.run([sys.executable, "-m", "attnlab", *map(str, argv)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert_one_error(done.returncode, done.stdout, done.stderr, "BLEU tokenizer 'spm' cannot")
    assert_one_error(*cli("translate", "--model", tmp_path / "one"), "is a file")


def test_a_config_file_may_give_one_training_file_as_a_string(data, tmp_path):
    from attnlab.cli import build_parser, options_from
    from attnlab.tasks.translate import TranslateOptions

    (tmp_path / "run.toml").write_text(f'train = "{data / "valid.tsv"}"\nvocab_size = 300\n')
    args = build_parser().parse_args(["translate", "train", "--config", str(tmp_path / "run.toml"),
                                      "--out", str(tmp_path / "out")])  # fmt: skip
    opts = options_from(TranslateOptions, args, ("out",), ("out", "tokenizer"))
    assert opts.train == [data / "valid.tsv"] and opts.vocab_size == 300


def test_resume_of_a_start_killed_while_writing_its_vocabulary(run_dir, data, cli, tmp_path):
    # The config and the vocabulary are written one after the other, before the first step:
    # a kill between them left --resume asking for the missing tokenizer.json forever.
    for leftover in ("config.json", ".config.json.0123456789abcdef0123456789abcdef.tmp"):
        out = tmp_path / leftover.strip(".")
        out.mkdir()
        (out / leftover).write_bytes((run_dir[0] / "config.json").read_bytes())
        code, _, err = cli(*train_args(data, out, "--resume"))
        assert code == 0, err
        assert (out / "tokenizer.json").is_file() and (out / "model.safetensors").is_file()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "notes.txt").write_text("mine")
    assert_one_error(*cli(*train_args(data, tmp_path / "notes", "--resume")), "no translation run")


def test_translate_lines_takes_one_string_as_one_line(run_dir):
    # A str was read as a list of characters: one "translation" per letter.
    from attnlab.tasks.translate import translate_lines

    model, tokenizer = load_translation_model(run_dir[0])
    one = translate_lines(model, tokenizer, "ein hund läuft .", beam=1)
    assert one == translate_lines(model, tokenizer, ["ein hund läuft ."], beam=1) and len(one) == 1
    with pytest.raises(AttnlabError, match="lines must be strings, got a NoneType"):
        translate_lines(model, tokenizer, ["ein hund .", None], beam=1)


def test_clip_norm_is_an_option(tmp_path):
    # The paper does not clip gradients; the trainer does by default (norm 1.0).
    from attnlab.tasks.translate import TranslateOptions, trainer_config

    assert trainer_config(TranslateOptions(out=tmp_path / "a")).clip_norm == 1.0
    assert trainer_config(TranslateOptions(out=tmp_path / "b", clip_norm=0.0)).clip_norm is None
    for bad in (-1.0, float("inf")):
        with pytest.raises(AttnlabError, match=r"clip.norm must be a finite number"):
            TranslateOptions(out=tmp_path / "c", clip_norm=bad).validate()
