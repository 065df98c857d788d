"""The `attnlab` command line against HF transformers on a real checkpoint (all-MiniLM-L6-v2).

Every command's output is checked against transformers (BertTokenizerFast ids, BertModel
hidden states and parameter count, from_pretrained of an export); every bad input must give
exit code 2, exactly one `attnlab: error:` line on stderr, no traceback and no output. Most
runs call `attnlab.cli.main` in-process; a few run `python -m attnlab` as a real process to
prove the exit codes and stderr a shell sees.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import VARIED_SENTENCES
from safetensors.torch import load_file, save_file

from attnlab.cli import main
from attnlab.config import BertConfig
from attnlab.errors import AttnlabError
from attnlab.interop.hf import save_bert
from attnlab.models.bert import BertForPreTraining, BertModel
from attnlab.text.tokenizer import SPECIAL_TOKENS, BertTokenizer

TINY_MAX_POSITIONS = 32  # small, so over-long input is cheap to make
TOLERANCE = 1e-4  # the CLI rounds to 7 decimals; HF and attnlab differ by ~1e-6


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """One torch thread: the inputs here are tiny, and when other processes hold the cores a
    multi-threaded pool spins and runs small forward passes many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """--threads sets torch's global thread count; give every test the count it started with."""
    before = torch.get_num_threads()
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


def assert_one_error(code: int, out: str, err: str, *fragments: str) -> str:
    """Exit 2, nothing on stdout, one `attnlab: error:` line holding every fragment."""
    assert code == 2, (code, err)
    assert out == ""
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("attnlab: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def text_lines(lines: list[str]) -> bytes:
    return "".join(line + "\n" for line in lines).encode("utf-8")


def json_lines(out: str) -> list:
    return [json.loads(line) for line in out.splitlines()]


def link_files(source: Path, target: Path, names: tuple[str, ...]) -> None:
    """Symlink some files of a checkpoint into target (no copies of the weights)."""
    target.mkdir(parents=True, exist_ok=True)
    for name in names:
        (target / name).symlink_to(source / name)


TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json")


def save_tiny(folder: Path, minilm_dir: Path, heads: bool = False) -> Path:
    """A random bert-tiny (2 layers, d_model 128, 32 positions) with MiniLM's vocabulary."""
    tokenizer = BertTokenizer.from_vocab(minilm_dir / "vocab.txt")
    torch.manual_seed(0)
    config = BertConfig.preset(
        "bert-tiny", vocab_size=tokenizer.vocab_size, max_positions=TINY_MAX_POSITIONS
    )
    model = BertForPreTraining(config) if heads else BertModel(config)
    save_bert(model.eval(), folder / "model", tokenizer)
    return folder / "model"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, minilm_dir: Path) -> Path:
    """save_tiny's encoder."""
    return save_tiny(tmp_path_factory.mktemp("tiny"), minilm_dir)


@pytest.fixture(scope="module")
def hf_reference(hf_minilm, hf_tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's last_hidden_state (batch, seq, 384) and attention_mask for VARIED_SENTENCES."""
    batch = hf_tokenizer(VARIED_SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = hf_minilm(**batch).last_hidden_state
    return hidden, batch["attention_mask"]


def hf_mean(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over real tokens, as sentence-transformers pools all-MiniLM-L6-v2."""
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1)


def max_diff(vectors: list, reference: torch.Tensor) -> float:
    return (torch.tensor(vectors) - reference).abs().max().item()


# ---------------------------------------------------------------------------- info


def test_info_reports_config_and_hf_parameter_count(cli, minilm_dir, hf_minilm):
    code, out, err = cli("info", "--model", minilm_dir)
    assert (code, err) == (0, "")
    info = json.loads(out)
    assert info["parameters"] == hf_minilm.num_parameters()
    assert info["parameters"] == sum(p.numel() for p in hf_minilm.parameters())
    assert 22_000_000 < info["parameters"] < 23_000_000
    config = info["config"]
    expected = {"vocab_size": 30522, "d_model": 384, "n_layers": 6, "n_heads": 12}
    assert {key: config[key] for key in expected} == expected
    assert (config["d_ff"], config["max_positions"]) == (1536, 512)
    assert config["position_encoding"] == "learned"


# ---------------------------------------------------------------------------- tokenize


def test_tokenize_matches_hf(cli, minilm_dir, hf_tokenizer):
    code, out, err = cli("tokenize", "--model", minilm_dir, stdin=text_lines(VARIED_SENTENCES))
    assert (code, err) == (0, "")
    records = json_lines(out)
    reference = hf_tokenizer(VARIED_SENTENCES)
    assert all(set(record) == {"input_ids", "token_type_ids"} for record in records)
    assert [r["input_ids"] for r in records] == reference["input_ids"]
    assert [r["token_type_ids"] for r in records] == reference["token_type_ids"]


def test_tokenize_pairs_match_hf_pair_encoding(cli, minilm_dir, hf_tokenizer):
    first, second = VARIED_SENTENCES[:4], VARIED_SENTENCES[4:]
    # CRLF line ends, as from a Windows editor, must not reach the tokenizer.
    stdin = "".join(f"{a}\t{b}\r\n" for a, b in zip(first, second, strict=True)).encode()
    code, out, err = cli("tokenize", "--model", minilm_dir, "--pair", stdin=stdin)
    assert (code, err) == (0, "")
    records = json_lines(out)
    reference = hf_tokenizer(first, second)
    assert [r["input_ids"] for r in records] == reference["input_ids"]
    assert [r["token_type_ids"] for r in records] == reference["token_type_ids"]
    for record, a in zip(records, first, strict=True):
        n_first = len(hf_tokenizer(a)["input_ids"])  # [CLS] A [SEP] has type 0, B [SEP] type 1
        types = record["token_type_ids"]
        assert types[:n_first] == [0] * n_first
        assert types[n_first:] == [1] * (len(types) - n_first) and len(types) > n_first


def test_tokenize_pair_line_without_tab_is_an_error_naming_it(cli, tiny_dir):
    stdin = text_lines(["a\tb", "no tab on this line", "c\td"])
    result = cli("tokenize", "--model", tiny_dir, "--pair", stdin=stdin)
    assert_one_error(*result, "line 2", "TAB")


# ---------------------------------------------------------------------------- embed


def test_embed_mean_matches_hf_mean_pooling(cli, minilm_dir, hf_reference):
    code, out, err = cli("embed", "--model", minilm_dir, stdin=text_lines(VARIED_SENTENCES))
    assert (code, err) == (0, "")
    vectors = json_lines(out)
    assert len(vectors) == len(VARIED_SENTENCES)
    assert all(len(vector) == 384 for vector in vectors)
    assert max_diff(vectors, hf_mean(*hf_reference)) <= TOLERANCE


def test_embed_cls_matches_hf_first_token(cli, minilm_dir, hf_reference):
    stdin = text_lines(VARIED_SENTENCES)
    code, out, err = cli("embed", "--model", minilm_dir, "--pooling", "cls", stdin=stdin)
    assert (code, err) == (0, "")
    hidden, _ = hf_reference
    assert max_diff(json_lines(out), hidden[:, 0]) <= TOLERANCE


def test_embed_pooling_none_gives_one_vector_per_token(cli, minilm_dir, hf_reference):
    stdin = text_lines(VARIED_SENTENCES)
    code, out, err = cli("embed", "--model", minilm_dir, "--pooling", "none", stdin=stdin)
    assert (code, err) == (0, "")
    matrices = json_lines(out)
    hidden, mask = hf_reference
    assert len(matrices) == len(VARIED_SENTENCES)
    for row, matrix in enumerate(matrices):
        n_tokens = int(mask[row].sum())
        assert len(matrix) == n_tokens
        assert all(len(vector) == 384 for vector in matrix)
        assert max_diff(matrix, hidden[row, :n_tokens]) <= TOLERANCE
    # --normalize makes each token's vector unit length (it was ignored with pooling none)
    code, out, _ = cli("embed", "--model", minilm_dir, "--pooling", "none", "--normalize",
                       stdin=stdin)  # fmt: skip
    assert code == 0
    for row, matrix in enumerate(json_lines(out)):
        expected = F.normalize(hidden[row, : int(mask[row].sum())], dim=-1)
        assert max_diff(matrix, expected) <= TOLERANCE


def test_embed_normalize_gives_unit_vectors(cli, minilm_dir, hf_reference):
    stdin = text_lines(VARIED_SENTENCES)
    code, out, err = cli("embed", "--model", minilm_dir, "--normalize", stdin=stdin)
    assert (code, err) == (0, "")
    vectors = torch.tensor(json_lines(out))
    assert (vectors.norm(dim=-1) - 1).abs().max().item() <= 1e-5
    assert max_diff(vectors.tolist(), F.normalize(hf_mean(*hf_reference), dim=-1)) <= TOLERANCE


def test_embed_small_batches_keep_input_order(cli, minilm_dir, hf_minilm, hf_tokenizer):
    lines = VARIED_SENTENCES[:7]  # lengths 3 to 25 tokens, not sorted
    code, out, err = cli(
        "embed", "--model", minilm_dir, "--batch-size", "2", stdin=text_lines(lines)
    )
    assert (code, err) == (0, "")
    vectors = json_lines(out)
    assert len(vectors) == len(lines)
    for vector, line in zip(vectors, lines, strict=True):
        alone = hf_tokenizer([line], return_tensors="pt")  # no padding: the line by itself
        with torch.no_grad():
            reference = hf_mean(hf_minilm(**alone).last_hidden_state, alone["attention_mask"])
        assert max_diff(vector, reference[0]) <= TOLERANCE


def test_embed_and_fill_mask_from_python_switch_dropout_off(minilm_dir, tiny_mlm_dir, hf_reference):
    # A model left in training mode (after fine-tuning, say) must not drop out while it
    # embeds or fills masks, and comes back in training mode; a single string is one text.
    from attnlab.interop.hf import load_bert
    from attnlab.tasks.embed import embed
    from attnlab.tasks.pretrain import fill_mask

    model = load_bert(minilm_dir).train()
    tokenizer = BertTokenizer.from_vocab(minilm_dir / "vocab.txt")
    vectors = embed(model, tokenizer, VARIED_SENTENCES)
    assert model.training
    assert max_diff([v.tolist() for v in vectors], hf_mean(*hf_reference)) <= 1e-5
    (one,) = embed(model, tokenizer, VARIED_SENTENCES[0])
    torch.testing.assert_close(one, vectors[0], rtol=1e-5, atol=1e-6)
    for bad in (0, 1):  # 0 meant "the default" in silence
        with pytest.raises(AttnlabError, match="--max-length must be at least 2"):
            embed(model, tokenizer, "hello", max_length=bad)

    mlm = load_bert(tiny_mlm_dir, heads=True)
    tokenizer = BertTokenizer.from_vocab(tiny_mlm_dir / "vocab.txt")
    with pytest.raises(AttnlabError, match="needs a model with its masked-LM head, got BertModel"):
        fill_mask(mlm.bert, tokenizer, "the [MASK].")
    assert torch.equal(
        embed(mlm, tokenizer, "the cat.")[0], embed(mlm.bert, tokenizer, "the cat.")[0]
    )
    expected = fill_mask(mlm.eval(), tokenizer, "the [MASK] sat on the [MASK].")
    mlm.train()
    for _ in range(2):
        assert fill_mask(mlm, tokenizer, "the [MASK] sat on the [MASK].") == expected
    assert mlm.training


@pytest.mark.parametrize("pooling", ["mean", "cls", "none"])
def test_embed_from_python_sends_the_batches_to_the_models_device(minilm_dir, pooling):
    # A model moved to a GPU got CPU batches ("Expected all tensors to be on the same
    # device"). Here the model sits on the meta device and its forward pass records where its
    # inputs are (no second real device on a CPU machine).
    from attnlab.models.bert import BertOutput
    from attnlab.tasks.embed import embed

    model = BertModel(BertConfig.preset("bert-tiny")).to("meta")
    seen = []

    def forward(input_ids, attention_mask, token_type_ids, keep=None):
        seen.append({t.device.type for t in (input_ids, attention_mask, token_type_ids)})
        rows = input_ids.shape if keep is None else input_ids.shape[:1]  # [CLS] alone
        return BertOutput(torch.zeros(*rows, 128, device=input_ids.device), None)

    model.forward = forward
    tokenizer = BertTokenizer.from_vocab(minilm_dir / "vocab.txt")
    vectors = embed(model, tokenizer, ["a sentence", "another longer sentence"], pooling=pooling)
    assert seen == [{"meta"}]
    assert all(v.device.type == "meta" for v in vectors)


def test_embed_input_file_equals_stdin(cli, tiny_dir, tmp_path):
    lines = ["short", "", VARIED_SENTENCES[1], "x y"]
    file = tmp_path / "lines.txt"
    file.write_bytes(text_lines(lines))
    code, from_file, err = cli("embed", "--model", tiny_dir, "--input", file)
    assert (code, err) == (0, "")
    assert len(json_lines(from_file)) == len(lines)
    assert cli("embed", "--model", tiny_dir, stdin=text_lines(lines))[1] == from_file


def test_embed_truncates_over_long_input_with_a_warning(cli, tiny_dir):
    long_line = " ".join(["word"] * 50)  # 52 tokens > 32 positions
    code, out, err = cli("embed", "--model", tiny_dir, stdin=text_lines(["short", long_line]))
    assert code == 0
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: 1 input line"), err
    vectors = json_lines(out)
    assert len(vectors) == 2
    # Truncated to [CLS] + 30 words + [SEP]: the same as giving 30 words.
    kept = " ".join(["word"] * (TINY_MAX_POSITIONS - 2))
    _, reference, _ = cli("embed", "--model", tiny_dir, stdin=text_lines([kept]))
    assert max_diff(vectors[1], torch.tensor(json_lines(reference)[0])) <= 1e-5


def test_embed_cuts_where_sentence_transformers_does(cli, minilm_dir, hf_minilm, hf_tokenizer):
    # all-MiniLM-L6-v2's sentence_bert_config.json says max_seq_length 256 (positions: 512):
    # sentence-transformers' encode() cuts there, so the default must too.
    long_line = " ".join(f"word{i % 50}" for i in range(200))  # two tokens a word
    assert 300 < len(hf_tokenizer(long_line)["input_ids"]) <= 512
    stdin = text_lines([long_line])
    code, by_default, err = cli("embed", "--model", minilm_dir, stdin=stdin)
    assert code == 0 and "longer than 256 tokens were truncated" in err
    _, at_512, _ = cli("embed", "--model", minilm_dir, "--max-length", 512, stdin=stdin)
    for out, max_length in ((by_default, 256), (at_512, 512)):  # an explicit flag still wins
        batch = hf_tokenizer([long_line], truncation=True, max_length=max_length,
                             return_tensors="pt")  # fmt: skip
        with torch.no_grad():
            expected = hf_mean(hf_minilm(**batch).last_hidden_state, batch["attention_mask"])
        assert max_diff(json_lines(out), expected) <= TOLERANCE


def test_embed_refuses_a_broken_sentence_transformers_config(cli, tiny_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    for text, fragment in (("[256]", "not a valid"), ('{"max_seq_length": 1.5}', "at least 2")):
        (model / "sentence_bert_config.json").write_text(text)
        result = cli("embed", "--model", model, stdin=text_lines(["a b"]))
        assert_one_error(*result, "sentence_bert_config.json", fragment)


def test_tokenize_truncates_over_long_input_with_a_warning(cli, tiny_dir):
    long_line = " ".join(["word"] * 50)
    code, out, err = cli("tokenize", "--model", tiny_dir, stdin=text_lines([long_line]))
    assert code == 0
    assert len(err.splitlines()) == 1 and err.startswith("warning: "), err
    (record,) = json_lines(out)
    assert len(record["input_ids"]) == TINY_MAX_POSITIONS


@pytest.mark.parametrize("command", ["embed", "tokenize"])
def test_no_truncate_refuses_over_long_input_naming_the_line(cli, tiny_dir, command):
    stdin = text_lines(["fine", "fine too", " ".join(["word"] * 50)])
    result = cli(command, "--model", tiny_dir, "--no-truncate", stdin=stdin)
    assert_one_error(*result, "line 3", f"longer than {TINY_MAX_POSITIONS} tokens")


@pytest.mark.parametrize("command", ["embed", "tokenize"])
@pytest.mark.parametrize(
    ("value", "fragment"),
    [(str(TINY_MAX_POSITIONS + 1), f"maximum ({TINY_MAX_POSITIONS})"), ("1", "at least 2")],
)
def test_max_length_outside_the_model_range_is_refused(cli, tiny_dir, command, value, fragment):
    result = cli(command, "--model", tiny_dir, "--max-length", value, stdin=b"hello\n")
    assert_one_error(*result, "--max-length", fragment)


@pytest.mark.parametrize("command", ["embed", "tokenize"])
def test_non_utf8_stdin_is_an_error_naming_the_line(cli, tiny_dir, command):
    result = cli(command, "--model", tiny_dir, stdin=b"fine\nalso fine\nbad \xff\xfe here\n")
    assert_one_error(*result, "stdin, line 3", "UTF-8")


def test_non_utf8_input_file_and_missing_input_file(cli, tiny_dir, tmp_path):
    file = tmp_path / "latin1.txt"
    file.write_bytes("ok\ncaf\u00e9\n".encode("latin-1"))
    assert_one_error(*cli("embed", "--model", tiny_dir, "--input", file), "line 2", "UTF-8")
    missing = tmp_path / "nowhere.txt"
    assert_one_error(*cli("embed", "--model", tiny_dir, "--input", missing), "not found")


# ---------------------------------------------------------------------------- export


def test_export_loads_in_transformers_with_the_same_outputs(
    cli, minilm_dir, hf_minilm, hf_tokenizer, tmp_path
):
    from transformers import BertModel as HFBertModel
    from transformers import BertTokenizerFast

    out = tmp_path / "exported"
    code, stdout, err = cli("export", "--model", minilm_dir, "--format", "hf", "--out", out)
    assert (code, stdout) == (0, "")
    assert len(err.splitlines()) == 1 and "exported" in err
    exported, loading = HFBertModel.from_pretrained(str(out), output_loading_info=True)
    assert not loading["missing_keys"]
    assert not loading["unexpected_keys"] and not loading["mismatched_keys"]
    exported_tokenizer = BertTokenizerFast.from_pretrained(str(out))
    batch = hf_tokenizer(VARIED_SENTENCES, padding=True, return_tensors="pt")
    assert exported_tokenizer(VARIED_SENTENCES, padding=True)["input_ids"] == (
        batch["input_ids"].tolist()
    )
    with torch.no_grad():
        ref, got = hf_minilm(**batch), exported.eval()(**batch)
    real = batch["attention_mask"].bool()
    diff = (ref.last_hidden_state - got.last_hidden_state)[real].abs().max().item()
    assert diff <= 1e-5
    assert (ref.pooler_output - got.pooler_output).abs().max().item() <= 1e-5
    # Permissions follow the umask, like any directory a user makes (not mkdtemp's 0700),
    # model.safetensors too (safetensors >= 0.8 creates its files 0600).
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask
    for name in ("config.json", "vocab.txt", "model.safetensors"):
        assert (out / name).stat().st_mode & 0o777 == 0o666 & ~umask, name


def test_export_into_an_out_holding_only_a_killed_writes_temp_file(cli, tiny_dir, tmp_path):
    # Such leftovers are not contents: before, the export was refused (training jobs' --out
    # check already ignored them).
    out = tmp_path / "out"
    out.mkdir()
    (out / f".config.json.{'0' * 32}.tmp").write_text("{")
    code, _, err = cli("export", "--model", tiny_dir, "--out", out)
    assert code == 0, err
    assert {"config.json", "model.safetensors", "vocab.txt"} <= set(os.listdir(out))
    assert not [name for name in os.listdir(out) if name.endswith(".tmp")]


def test_an_out_in_a_loop_of_links_is_one_error_line(cli, tiny_dir, corpus, tmp_path):
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    out = tmp_path / "loop1"
    for args in (["export", "--model", tiny_dir, "--out", out],
                 ["tokenizer", "train", "--vocab-size", 100, "--out", out, corpus]):  # fmt: skip
        assert_one_error(*cli(*args), "cannot be used: Symlink loop")


def test_overwrite_of_a_linked_out_replaces_the_folder_it_names(cli, tiny_dir, tmp_path):
    # The link itself was moved aside and deleted: --out became a new real folder, and the
    # folder the link named (the old output, on the disk the user chose) stayed as it was.
    from attnlab.io import clear_dir

    target, link = tmp_path / "disk" / "model", tmp_path / "link"
    target.mkdir(parents=True)
    (target / "old.txt").write_text("old")
    link.symlink_to(target, target_is_directory=True)
    code, _, err = cli("export", "--model", tiny_dir, "--out", link, "--overwrite")
    assert code == 0, err
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert (target / "config.json").is_file() and not (target / "old.txt").exists()
    assert os.listdir(target.parent) == ["model"]  # no stage or trash left beside it
    clear_dir(link)  # what a training job's --overwrite does first
    assert link.is_symlink() and os.listdir(target) == []


@pytest.mark.parametrize(
    ("command", "redirect", "fragment"),
    [
        ("embed", "<&-", "standard input is closed"),
        ("embed", ">&-", "standard output is closed"),
        ("fill-mask", ">&-", "standard output is closed"),  # exited 0 having printed nothing
    ],
)
def test_a_closed_stdin_or_stdout_is_one_error_line(tiny_dir, command, redirect, fragment):
    args = f"-m attnlab {command} --model {tiny_dir} --threads 1"
    if command == "fill-mask":
        args += " 'a [MASK] b'"
    line = f"{sys.executable} {args} {redirect}"
    done = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=300)
    assert_one_error(done.returncode, "", done.stderr, fragment)


def test_a_device_or_pipe_as_an_input_file_is_named_as_such(cli, tiny_dir, tmp_path):
    # It was called "not found"; stdin is read with --input - (or no --input).
    os.mkfifo(tmp_path / "fifo")
    for path in ("/dev/null", tmp_path / "fifo"):
        message = assert_one_error(*cli("embed", "--model", tiny_dir, "--input", path))
        assert "is not a regular file (a pipe or device)" in message


def test_an_error_quoting_a_line_break_stays_one_line(cli, tmp_path):
    message = assert_one_error(*cli("info", "--model", tmp_path / "two\nlines"))
    assert "two\\nlines" in message


def test_export_refuses_a_non_empty_out_unless_overwrite(cli, tiny_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    before = sorted(os.listdir(tmp_path))
    result = cli("export", "--model", tiny_dir, "--out", out)
    assert_one_error(*result, "already holds files", "--overwrite")
    assert os.listdir(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == before  # no half-written stage left beside it

    code, _, _ = cli("export", "--model", tiny_dir, "--out", out, "--overwrite")
    assert code == 0
    assert not (out / "keep.txt").exists()
    assert {"config.json", "model.safetensors", "vocab.txt"} <= set(os.listdir(out))
    assert sorted(os.listdir(tmp_path)) == before


def test_export_onto_its_own_model_dir_or_one_above_it_is_refused(cli, tiny_dir):
    before = {p.name: p.stat().st_mtime_ns for p in tiny_dir.iterdir()}
    result = cli("export", "--model", tiny_dir, "--out", tiny_dir, "--overwrite")
    assert_one_error(*result, f"--out {tiny_dir} is the input")
    # replacing a folder above the model would delete the model with it
    result = cli("export", "--model", tiny_dir, "--out", tiny_dir.parent, "--overwrite")
    assert_one_error(*result, f"--out {tiny_dir.parent} holds the input")
    assert {p.name: p.stat().st_mtime_ns for p in tiny_dir.iterdir()} == before


@pytest.mark.parametrize("out", ["", ".", ".."])
def test_export_to_a_path_naming_no_directory_of_its_own_is_refused(
    cli, tiny_dir, out, tmp_path, monkeypatch
):
    # Were it not refused, only folders of this test would be near: '..' is tmp_path/a.
    (tmp_path / "a" / "b").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "a" / "b")
    assert_one_error(*cli("export", "--model", tiny_dir, "--out", out, "--overwrite"), "--out")


def test_export_through_a_file_is_one_error_line(cli, tiny_dir, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    result = cli("export", "--model", tiny_dir, "--out", tmp_path / "notes.txt" / "sub")
    assert_one_error(*result, "notes.txt is a file, not a directory")
    assert os.listdir(tmp_path) == ["notes.txt"]


def test_export_of_a_model_hf_cannot_run_is_refused(cli, tmp_path):
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *"abcdefghij"])}
    tokenizer = BertTokenizer.from_vocab(vocab)
    config = BertConfig.preset("bert-tiny", vocab_size=len(vocab), position_encoding="rope")
    save_bert(BertModel(config), tmp_path / "rope", tokenizer)
    result = cli("export", "--model", tmp_path / "rope", "--out", tmp_path / "out")
    assert_one_error(*result, "cannot export to HF format", "rope")
    assert not (tmp_path / "out").exists()


def test_embed_refuses_a_tokenizer_larger_than_the_model_vocabulary(cli, tiny_dir, tmp_path):
    # Ids past vocab_size would otherwise fail as an IndexError inside the embedding.
    config = BertConfig.preset("bert-tiny", vocab_size=64)
    save_bert(BertModel(config), tmp_path / "model", BertTokenizer.from_dir(tiny_dir))
    result = cli("embed", "--model", tmp_path / "model", stdin=b"hello world\n")
    assert_one_error(*result, "30522 tokens", "vocab_size 64")


# ---------------------------------------------------------------------------- tokenizer train


@pytest.fixture
def corpus(tmp_path) -> Path:
    file = tmp_path / "corpus.txt"
    sentences = (Path(__file__).parent / "data" / "tokenizer_lines.txt").read_text("utf-8")
    lines = [*sentences.splitlines(), *VARIED_SENTENCES]
    file.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return file


def test_tokenizer_train_says_why_a_vocabulary_exceeds_the_size_asked(cli, corpus, tmp_path):
    code, _, err = cli("tokenizer", "train", "--type", "bpe", "--corpus", corpus,
                       "--vocab-size", "10", "--out", tmp_path / "bpe")  # fmt: skip
    assert code == 0, err
    size = int(err.split("vocabulary of ")[1].split()[0])
    assert size > 10 and "note: more than --vocab-size 10" in err


def test_tokenizer_train_output_loads_in_attnlab_and_transformers(cli, corpus, tmp_path):
    from transformers import BertTokenizerFast

    out = tmp_path / "tok"
    code, stdout, err = cli(
        "tokenizer", "train", "--corpus", corpus, "--vocab-size", "300", "--out", out
    )
    assert (code, stdout) == (0, "")
    assert len(err.splitlines()) == 1 and "WordPiece" in err
    ours = BertTokenizer.from_dir(out)
    theirs = BertTokenizerFast.from_pretrained(str(out))
    assert 5 < ours.vocab_size <= 300
    assert len(theirs) == ours.vocab_size
    texts = corpus.read_text("utf-8").splitlines()
    assert [e.ids for e in ours.encode_batch(texts)] == theirs(texts)["input_ids"]
    assert theirs.convert_ids_to_tokens([0, 1, 2, 3, 4]) == [
        "[PAD]",
        "[UNK]",
        "[CLS]",
        "[SEP]",
        "[MASK]",
    ]


@pytest.mark.parametrize(
    ("corpus_bytes", "fragments"),
    [
        (b"good line\nanother\n\xff\xfe bad\n", ("line 3", "UTF-8")),
        (None, ("not found",)),
    ],
    ids=["non-utf8", "missing"],
)
def test_tokenizer_train_bad_corpus_writes_nothing(cli, tmp_path, corpus_bytes, fragments):
    file = tmp_path / "corpus.txt"
    if corpus_bytes is not None:
        file.write_bytes(corpus_bytes)
    before = sorted(os.listdir(tmp_path))
    result = cli(
        "tokenizer", "train", "--corpus", file, "--vocab-size", "100", "--out", tmp_path / "tok"
    )
    assert_one_error(*result, *fragments)
    assert sorted(os.listdir(tmp_path)) == before


def test_tokenizer_train_refuses_tiny_vocab_and_non_empty_out(cli, corpus, tmp_path):
    out = tmp_path / "tok"
    args = ("tokenizer", "train", "--corpus", corpus, "--out", out)
    assert_one_error(*cli(*args, "--vocab-size", "5"), "--vocab-size")
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert_one_error(*cli(*args, "--vocab-size", "100"), "--overwrite")
    assert os.listdir(out) == ["keep.txt"]


def test_tokenizer_train_refuses_zero_size_blank_text_and_cased_bpe(cli, corpus, tmp_path):
    out = tmp_path / "tok"
    # --vocab-size 0 was taken as "not given" and trained the default size
    result = cli("tokenizer", "train", "--corpus", corpus, "--vocab-size", "0", "--out", out)
    assert_one_error(*result, "--vocab-size must be at least 10")
    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n  \n")
    result = cli("tokenizer", "train", "--type", "bpe", "--corpus", blank, "--out", out)
    assert_one_error(*result, "holds no text")
    result = cli("tokenizer", "train", "--type", "bpe", "--cased", "--corpus", corpus, "--out", out)
    assert_one_error(*result, "--cased is a WordPiece option")
    assert not out.exists()


def test_json_results_hold_null_where_a_number_is_not_finite(capsys):
    from attnlab.cli import _print_json

    # a constant prediction's correlation is NaN, a diverged loss inf: JSON has neither
    _print_json({"pearson": float("nan"), "rows": [1.0, float("inf")], "name": "x"})
    assert json.loads(capsys.readouterr().out) == {
        "pearson": None,
        "rows": [1.0, None],
        "name": "x",
    }


# ---------------------------------------------------------------------------- fill-mask


@pytest.fixture(scope="module")
def tiny_mlm_dir(tmp_path_factory, minilm_dir: Path) -> Path:
    """save_tiny's sizes with masked-LM and next-sentence heads (random weights)."""
    return save_tiny(tmp_path_factory.mktemp("tiny-mlm"), minilm_dir, heads=True)


def test_fill_mask_refuses_an_encoder_without_its_masked_lm_head(cli, tiny_dir):
    # load_bert would give it a random head: predictions that mean nothing
    assert_one_error(*cli("fill-mask", "--model", tiny_dir, "a [MASK] day"), "no masked-LM head")


def test_fill_mask_refuses_a_tokenizer_larger_than_the_model(cli, tiny_mlm_dir, tmp_path):
    model = tmp_path / "model"
    link_files(tiny_mlm_dir, model, ("model.safetensors", *TOKENIZER_FILES))
    _copy_config(tiny_mlm_dir, model, vocab_size=1000)  # MiniLM's vocabulary has 30,522
    result = cli("fill-mask", "--model", model, "a [MASK] day")
    assert_one_error(*result, "30522 tokens", "vocab_size 1000")


def test_fill_mask_names_text_that_is_not_utf8(cli, tiny_mlm_dir):
    # A non-UTF-8 byte in an argument reaches Python as a lone surrogate: it was a TypeError
    # from the tokenizer.
    text = b"caf\xe9 [MASK]".decode("utf-8", "surrogateescape")
    message = assert_one_error(*cli("fill-mask", "--model", tiny_mlm_dir, "ok [MASK]", text))
    assert "text 2 is not valid UTF-8 (byte 0xe9 at character 4)" in message


def test_fill_mask_on_text_longer_than_the_model(cli, tiny_mlm_dir):
    words = " ".join(["word"] * 2 * TINY_MAX_POSITIONS)
    message = assert_one_error(*cli("fill-mask", "--model", tiny_mlm_dir, f"{words} [MASK]"))
    assert f"beyond the model's {TINY_MAX_POSITIONS} positions" in message
    assert len(message) < 200  # the text is quoted in part, not whole
    code, out, err = cli("fill-mask", "--model", tiny_mlm_dir, "--json", f"[MASK] {words}")
    assert code == 0 and len(json.loads(out)["masks"]) == 1
    assert err.startswith("warning:") and f"model's {TINY_MAX_POSITIONS}" in err


# ---------------------------------------------------------------------------- bad models


def _copy_config(tiny_dir: Path, target: Path, **changes) -> None:
    data = json.loads((tiny_dir / "config.json").read_text())
    for key, value in changes.items():
        data[key] = value
    (target / "config.json").write_text(json.dumps(data))


def _tokenizer_only(tiny_dir: Path, target: Path) -> None:
    link_files(tiny_dir, target, TOKENIZER_FILES)


def make_missing(tiny_dir: Path, target: Path) -> None:
    pass  # target is never created


def make_empty(tiny_dir: Path, target: Path) -> None:
    target.mkdir()


def make_readme_only(tiny_dir: Path, target: Path) -> None:
    target.mkdir()
    (target / "README.md").write_text("# my notes, not a model\n")


def make_invalid_json(tiny_dir: Path, target: Path) -> None:
    link_files(tiny_dir, target, ("model.safetensors", *TOKENIZER_FILES))
    (target / "config.json").write_text('{"hidden_size": 128,\n')


def make_deep_json(tiny_dir: Path, target: Path) -> None:  # was a RecursionError
    link_files(tiny_dir, target, ("model.safetensors", *TOKENIZER_FILES))
    (target / "config.json").write_text("[" * 100_000)


def make_contradictory(tiny_dir: Path, target: Path) -> None:
    link_files(tiny_dir, target, ("model.safetensors", *TOKENIZER_FILES))
    _copy_config(tiny_dir, target, hidden_size=100, num_attention_heads=12)


def make_bogus_position_encoding(tiny_dir: Path, target: Path) -> None:
    link_files(tiny_dir, target, ("model.safetensors", *TOKENIZER_FILES))
    _copy_config(tiny_dir, target, attnlab={"position_encoding": "bogus"})


def make_unknown_attnlab_setting(tiny_dir: Path, target: Path) -> None:
    # A name attnlab does not know (here a preset) must not be silently ignored.
    link_files(tiny_dir, target, ("model.safetensors", *TOKENIZER_FILES))
    _copy_config(tiny_dir, target, attnlab={"preset": "bert-bogus"})


def make_missing_weights(tiny_dir: Path, target: Path) -> None:
    link_files(tiny_dir, target, ("config.json", *TOKENIZER_FILES))


def make_mis_shaped_weights(tiny_dir: Path, target: Path) -> None:
    link_files(tiny_dir, target, ("model.safetensors", *TOKENIZER_FILES))
    _copy_config(tiny_dir, target, hidden_size=256, intermediate_size=1024)


def make_truncated_weights(tiny_dir: Path, target: Path) -> None:
    link_files(tiny_dir, target, ("config.json", *TOKENIZER_FILES))
    with open(tiny_dir / "model.safetensors", "rb") as weights:
        (target / "model.safetensors").write_bytes(weights.read(100_000))


def make_corrupt_weights(tiny_dir: Path, target: Path) -> None:
    link_files(tiny_dir, target, ("config.json", *TOKENIZER_FILES))
    (target / "model.safetensors").write_bytes(b"this is not a safetensors file" * 100)


def make_empty_bin(tiny_dir: Path, target: Path) -> None:  # an interrupted copy
    link_files(tiny_dir, target, ("config.json", *TOKENIZER_FILES))
    (target / "pytorch_model.bin").write_bytes(b"")


def make_edited_weights(edit: Callable[[dict], None]) -> Callable[[Path, Path], None]:
    """A maker of a model dir whose model.safetensors has been changed by edit(state)."""

    def make(tiny_dir: Path, target: Path) -> None:
        link_files(tiny_dir, target, ("config.json", *TOKENIZER_FILES))
        state = load_file(str(tiny_dir / "model.safetensors"))
        edit(state)
        save_file(state, str(target / "model.safetensors"))

    return make


def _nan_query(state: dict) -> None:
    state["encoder.layer.0.attention.self.query.weight"][0, 0] = float("nan")


def _integer_query(state: dict) -> None:
    name = "encoder.layer.0.attention.self.query.weight"
    state[name] = state[name].round().long()


def _extra_layer(state: dict) -> None:  # weights of a layer beyond num_hidden_layers
    for name in [k for k in state if k.startswith("encoder.layer.0.")]:
        state[name.replace("layer.0.", "layer.7.")] = state[name].clone()


def test_all_finite_sees_nan_and_infinity_but_not_an_overflowing_sum() -> None:
    from attnlab.interop.hf import all_finite

    values = torch.full((10,), 3e38)  # finite, but their float32 sum overflows
    assert all_finite(values)
    for bad in (float("nan"), float("inf"), -float("inf")):
        values[3] = bad
        assert not all_finite(values)


def make_non_tensor_bin(tiny_dir: Path, target: Path) -> None:
    link_files(tiny_dir, target, ("config.json", *TOKENIZER_FILES))
    state = dict(load_file(str(tiny_dir / "model.safetensors")))
    state["embeddings.word_embeddings.weight"] = [1, 2, 3]
    torch.save(state, target / "pytorch_model.bin")


def make_typed_wrong(**changes) -> Callable[[Path, Path], None]:
    """A maker of a model dir whose config.json holds values of the wrong JSON type."""

    def make(tiny_dir: Path, target: Path) -> None:
        link_files(tiny_dir, target, ("model.safetensors", *TOKENIZER_FILES))
        _copy_config(tiny_dir, target, **changes)

    return make


CONFIG_PROBLEMS = {
    "missing-dir": (make_missing, ("does not exist",)),
    "empty-dir": (make_empty, ("config.json not found",)),
    "readme-only": (make_readme_only, ("config.json not found",)),
    "invalid-json": (make_invalid_json, ("config.json", "not valid JSON")),
    "deep-json": (make_deep_json, ("config.json", "not valid JSON", "recursion")),
    "contradictory": (make_contradictory, ("d_model (100)", "n_heads (12)")),
    "bogus-position-encoding": (make_bogus_position_encoding, ("position encoding 'bogus'",)),
    "unknown-attnlab-setting": (make_unknown_attnlab_setting, ("'preset'",)),
    "string-number": (
        make_typed_wrong(initializer_range="abc"),
        ("initializer_range must be a finite number", "'abc'"),
    ),
    "bool-size": (make_typed_wrong(type_vocab_size=True), ("type_vocab_size must be an integer",)),
    "list-activation": (make_typed_wrong(hidden_act=["gelu"]), ("hidden_act ['gelu']",)),
    "huge-size": (make_typed_wrong(intermediate_size=10**12), ("d_ff must be", "below 2**31")),
    # were accepted (every output NaN) or a traceback at the model's build
    "negative-eps": (make_typed_wrong(layer_norm_eps=-1.0), ("layer_norm_eps must be >= 0",)),
    "negative-buckets": (
        make_typed_wrong(attnlab={"position_encoding": "relative_bias", "relative_buckets": -3}),
        ("relative_buckets must be a positive integer, got -3",),
    ),
    "negative-rope-base": (
        make_typed_wrong(attnlab={"position_encoding": "rope", "rope_base": -1.0}),
        ("rope_base must be >= 1",),
    ),
}
WEIGHT_PROBLEMS = {  # tokenize does not read weights
    "missing-weights": (make_missing_weights, ("no model.safetensors",)),
    "mis-shaped-weights": (make_mis_shaped_weights, ("(30522, 128)", "(30522, 256)")),
    "truncated-weights": (make_truncated_weights, ("cannot read weights",)),
    "corrupt-weights": (make_corrupt_weights, ("cannot read weights",)),
    # was an IndexError while the error was worded: torch.load says only EOFError()
    "empty-bin": (make_empty_bin, ("pytorch_model.bin: the file is empty",)),
    # before, these loaded in silence: NaN in every output, integers converted, a layer dropped
    "nan-weights": (make_edited_weights(_nan_query), ("query.weight", "NaN or infinite")),
    "integer-weights": (make_edited_weights(_integer_query), ("torch.int64, not floats",)),
    "extra-layer": (make_edited_weights(_extra_layer), ("8 encoder layers", "num_hidden_layers")),
    "non-tensor-bin": (make_non_tensor_bin, ("word_embeddings.weight'", "is not a tensor")),
}
BAD_MODEL_CASES = [
    pytest.param(name, command, id=f"{name}-{command}")
    for problems, commands in (
        (CONFIG_PROBLEMS, ("info", "tokenize", "embed", "export")),
        (WEIGHT_PROBLEMS, ("info", "embed", "export")),
    )
    for name in problems
    for command in commands
]


@pytest.mark.parametrize(("problem", "command"), BAD_MODEL_CASES)
def test_bad_model_dir_is_one_error_line_and_writes_nothing(
    cli, tiny_dir, tmp_path, problem, command
):
    make, fragments = {**CONFIG_PROBLEMS, **WEIGHT_PROBLEMS}[problem]
    model = tmp_path / "model"
    make(tiny_dir, model)
    work = tmp_path / "work"
    work.mkdir()
    extra = ["--out", work / "exported"] if command == "export" else []
    result = cli(command, "--model", model, *extra, stdin=b"hello\nworld\n")
    assert_one_error(*result, *fragments)
    assert os.listdir(work) == []


class _UnreadableStdin(io.BytesIO):
    def read(self, *args) -> bytes:
        raise AssertionError("stdin was read before --model was checked")


def test_embed_checks_the_model_before_waiting_for_stdin(monkeypatch, capsys, tmp_path):
    # At a terminal, reading stdin first would wait for typed input before saying --model is wrong.
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(_UnreadableStdin()))
    code = main(["embed", "--model", str(tmp_path / "typo")])
    assert_one_error(code, *capsys.readouterr(), "does not exist")


# ---------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["embed", "--model", "m", "--pooling", "max"], "invalid choice: 'max'"),
        (["embed", "--model", "m", "--frobnicate"], "unrecognized arguments: --frobnicate"),
        (["tokenize", "--model", "m", "--max-length", "ten"], "invalid int value: 'ten'"),
        (["export", "--model", "m", "--format", "onnx", "--out", "o"], "invalid choice"),
        (["embed"], "required: --model"),
        (["summarize"], "invalid choice: 'summarize'"),
        ([], "required: {info,tokenize,"),  # named as usage shows it, not as "command"
        (["tokenizer"], "tokenizer: the following arguments are required: {train}"),
        # a negative or infinite value is the value's own error, not "expected one argument"
        (["pretrain", "--out", "o", "--lr", "-1e-3"], "--lr must be > 0, got -0.001"),
        (["pretrain", "--out", "o", "--lr", "-inf"], "--lr must be a finite number, got -inf"),
        (["translate", "train", "--out", "o", "--lr", "-.5E+1"], "--lr must be > 0, got -5.0"),
        (["finetune", "--lr", "-1"], "finetune needs --task"),  # -1 was read as a value
    ],
    ids=[
        "bad-pooling",
        "unknown-option",
        "bad-int",
        "bad-format",
        "no-model",
        "no-command",
        "empty",
        "no-subcommand",
        "negative-exponent",
        "minus-infinity",
        "negative-translate",
        "negative-finetune",
    ],
)
def test_argparse_errors_are_one_line(cli, argv, fragment):
    line = assert_one_error(*cli(*argv), fragment)
    assert not line.startswith("attnlab: error: attnlab")  # the prefix once


def _threads_argv(command: str, tiny_dir: Path, tmp_path: Path) -> list:
    if command == "tokenizer train":
        corpus = tmp_path / "corpus.txt"
        corpus.write_text("\n".join(VARIED_SENTENCES) + "\n")
        return [
            "tokenizer",
            "train",
            "--corpus",
            corpus,
            "--vocab-size",
            "100",
            "--out",
            tmp_path / "tok",
        ]
    argv = [command, "--model", tiny_dir]
    return [*argv, "--out", tmp_path / "out"] if command == "export" else argv


@pytest.mark.parametrize("command", ["info", "tokenize", "embed", "export", "tokenizer train"])
def test_threads_option_is_accepted_by_every_command(cli, tiny_dir, tmp_path, command):
    torch.set_num_threads(2)
    code, _, err = cli(*_threads_argv(command, tiny_dir, tmp_path), "--threads", "1", stdin=b"hi\n")
    assert code == 0, err
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("value", ["0", "-3", "1025", "2147483648"])
def test_threads_out_of_range_is_refused(cli, tiny_dir, value):
    assert_one_error(*cli("info", "--model", tiny_dir, "--threads", value), "--threads")


# ---------------------------------------------------------------------------- real processes


@pytest.fixture(scope="module")
def processes(tiny_dir, tmp_path_factory) -> dict[str, tuple[int, str, str, Path]]:
    """Real `python -m attnlab` runs -> (exit code, stdout, stderr, cwd) by name.

    They start together, so the seconds each spends importing torch overlap.
    """
    root = tmp_path_factory.mktemp("processes")
    corpus_dir = root / "corpus"
    corpus_dir.mkdir()
    (corpus_dir / "corpus.txt").write_bytes(b"fine\n\xc3\x28 broken\n")
    make_truncated_weights(tiny_dir, root / "corrupt")
    runs = {
        "embed": (["embed", "--model", tiny_dir, "--threads", "1"], root, b"hello\nworld\n"),
        "usage": (["embed", "--model", tiny_dir, "--pooling", "max"], root, b""),
        "corpus": (
            ["tokenizer", "train", "--corpus", "corpus.txt", "--vocab-size", "50", "--out", "tok"],
            corpus_dir,
            b"",
        ),
        "weights": (["info", "--model", root / "corrupt"], root, b""),
    }
    started = {
        name: subprocess.Popen(
            [sys.executable, "-m", "attnlab", *map(str, argv)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
        )
        for name, (argv, cwd, _) in runs.items()
    }
    results = {}
    try:
        for name, process in started.items():
            _, cwd, stdin = runs[name]
            out, err = process.communicate(stdin, timeout=120)
            results[name] = (process.returncode, out.decode("utf-8"), err.decode("utf-8"), cwd)
    finally:
        for process in started.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    return results


def test_process_embed_succeeds(processes):
    code, out, err, _ = processes["embed"]
    assert (code, err) == (0, "")
    vectors = json_lines(out)
    assert len(vectors) == 2 and all(len(vector) == 128 for vector in vectors)


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("usage", "invalid choice: 'max'"),
        ("corpus", "corpus.txt, line 2: not valid UTF-8"),
        ("weights", "cannot read weights"),
    ],
)
def test_process_error_exits_2_with_one_line(processes, name, fragment):
    code, out, err, cwd = processes[name]
    assert_one_error(code, out, err, fragment)
    if name == "corpus":
        assert os.listdir(cwd) == ["corpus.txt"]  # no --out, no stage left behind


def test_export_refuses_a_fine_tuned_model_whose_head_it_would_drop(cli, tiny_dir, tmp_path):
    model = tmp_path / "clf"
    link_files(tiny_dir, model, ("model.safetensors", *TOKENIZER_FILES))
    _copy_config(tiny_dir, model, architectures=["BertForSequenceClassification"])
    result = cli("export", "--model", model, "--out", tmp_path / "out")
    assert_one_error(*result, "fine-tuned classify model")
    assert not (tmp_path / "out").exists()


def test_tokenizer_train_refuses_a_vocabulary_too_large_to_allocate(cli, corpus, tmp_path):
    for size in ("20000000", "99999999999999999999"):
        result = cli("tokenizer", "train", corpus, "--vocab-size", size, "--out", tmp_path / "t")
        assert_one_error(*result, "--vocab-size must be at most")
    assert_one_error(*cli("tokenizer", "train", tmp_path, "--out", tmp_path / "t"),
                     "is a directory")  # fmt: skip


def test_bleu_tokenizer_that_cannot_run_is_named():
    from attnlab.errors import AttnlabError
    from attnlab.metrics import bleu_metric

    with pytest.raises(AttnlabError, match=r"BLEU tokenizer 'ja-mecab' cannot run here: .*install"):
        bleu_metric("ja-mecab")  # sacreBLEU's extra for Japanese is not a dependency here


def test_ctrl_c_after_the_command_ended_prints_no_traceback(tmp_path):
    # A Ctrl-C that lands while the interpreter shuts down (here sent from an exit handler
    # that runs after main returned) must not add a traceback to the command's one line.
    program = (
        "import atexit, os, signal, sys, time\n"
        "from attnlab.cli import main\n"
        "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(0.5)))\n"
        "sys.exit(main())\n"
    )
    script = tmp_path / "run.py"
    script.write_text(program, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(script), "pretrain", "--steps", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("attnlab: error:")


def test_stdout_that_cannot_show_the_text_is_one_error_line(tiny_mlm_dir):
    # A C locale or PYTHONIOENCODING=ascii: print() raised UnicodeEncodeError, a traceback
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    args = ["-m", "attnlab", "fill-mask", "--model", str(tiny_mlm_dir), "今天[MASK]"]
    done = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=300, env=env
    )
    message = assert_one_error(done.returncode, done.stdout, done.stderr, "set PYTHONIOENCODING")
    assert "cannot write '\\u4eca' in ascii" in message


TRAINING_COMMANDS = {
    ("pretrain",): "attnlab.tasks.pretrain.PretrainOptions",
    ("distill",): "attnlab.tasks.distill.DistillOptions",
    ("finetune",): "attnlab.tasks.finetune.FinetuneOptions",
    ("translate", "train"): "attnlab.tasks.translate.TranslateOptions",
}


@pytest.mark.parametrize("command", list(TRAINING_COMMANDS), ids=" ".join)
def test_training_flags_name_option_fields_and_leave_their_defaults_to_them(command, capsys):
    """Defaults live in the options dataclass only: every flag of a training command names one
    of its fields, the parser gives it no value of its own, and --help shows the field's."""
    import dataclasses
    import importlib

    from attnlab.cli import build_parser

    module, _, name = TRAINING_COMMANDS[command].rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    parser = build_parser().parse_args(list(command)).command_parser
    own = {"help", "threads", "config"}
    flags = {a.dest: a.default for a in parser._actions if a.option_strings and a.dest not in own}
    assert set(flags) <= set(fields), sorted(set(flags) - set(fields))
    assert all(value is None for value in flags.values()), flags
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    lr = fields["lr"].default  # None: finetune's, chosen for the model (tasks/finetune/defaults.py)
    assert f"(default {lr})" in shown if lr is not None else "(default: by the model's" in shown
    assert f"(default {fields['keep_last'].default})" in shown


def test_a_library_error_names_options_as_the_python_api_and_the_cli_as_flags(cli, tiny_dir):
    err = AttnlabError("max_tokens must be at least 1, got 0", options=("max_tokens",))
    assert str(err) == "max_tokens must be at least 1, got 0"
    assert err.worded(lambda name: f"--{name}") == "--max_tokens must be at least 1, got 0"
    spelled = AttnlabError("out /data/out holds a run: pass resume", options=("out", "resume"))
    assert spelled.worded(str.upper) == "OUT /data/out holds a run: pass RESUME"
    # a value right after its option is not a mention, even when it spells one (--out out)
    same = AttnlabError(
        "out out holds a run: pass resume or overwrite", options=("out", "resume", "overwrite")
    )
    assert (
        same.worded(lambda name: f"--{name}")
        == "--out out holds a run: pass --resume or --overwrite"
    )
    # embed names its option max_tokens; the command line says --batch-tokens
    assert_one_error(*cli("embed", "--model", tiny_dir, "--batch-tokens", "0", stdin=b"a\n"),
                     "--batch-tokens")  # fmt: skip


def test_an_option_of_another_command_is_named_as_its_flag(cli, tmp_path):
    # evaluate has no --new-head; a model only finetune can re-head names finetune's flag
    from attnlab.cli import _flag_spelling, build_parser

    args = build_parser().parse_args(["evaluate", "--model", "m", "--data", "d"])
    spell = _flag_spelling(args)
    assert spell("batch_size") == "--batch-size"  # its own flag
    assert spell("new_head") == "--new-head"  # finetune's
    assert spell("model_config") == "model_config"  # no command has it: as the library says
    # library messages in option names, said as flags: DistillOptions, TranslateOptions
    teacher = tmp_path / "teacher"
    result = cli("distill", "--teacher", teacher, "--out", tmp_path / "o", "--student-layers", "2",
                 "--student-preset", "bert-tiny")  # fmt: skip
    assert_one_error(*result, "give exactly one of --student-layers and --student-preset")
    result = cli("translate", "train", "--out", tmp_path / "t", "--clip-norm", "-1")
    assert_one_error(*result, "--clip-norm must be a finite number >= 0, got -1.0")
