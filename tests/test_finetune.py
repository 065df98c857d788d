"""`attnlab finetune / evaluate / predict` end to end on tiny fixtures, checked independently.

A bert-tiny-sized model (2 layers, width 32) with MiniLM's real vocabulary keeps every run
to about a second. Metrics printed by `attnlab evaluate` are recomputed from HF
transformers' own forward pass of the saved checkpoint (and scikit-learn / SciPy / seqeval),
so the recipe, the export and the scoring are all checked against outside references.
Every bad input must give exit 2, one `attnlab: error:` line, no traceback, nothing written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from conftest import assert_resume_after_two_sigkills_is_bit_identical
from safetensors.torch import load_file, save_file

from attnlab.cli import main
from attnlab.config import BertConfig
from attnlab.errors import AttnlabError
from attnlab.interop.hf import save_bert
from attnlab.models.bert import BertModel
from attnlab.tasks.finetune import (
    DataSettings,
    FinetuneOptions,
    LengthGroupedBatches,
    QATask,
    collate,
    finetune,
    load_finetuned,
    task_for,
)
from attnlab.text.tokenizer import BertTokenizer

DATA = Path(__file__).parent / "data" / "finetune"
FAST = ("--threads", "1", "--lr", "2e-3", "--no-progress", "--log-every", "1")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, minilm_dir) -> Path:
    """A random bert-tiny-sized encoder with MiniLM's WordPiece vocabulary, in HF layout."""
    out = tmp_path_factory.mktemp("tiny") / "model"
    tokenizer = BertTokenizer.from_dir(minilm_dir)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size, d_model=32, n_layers=2, n_heads=2, d_ff=64,
        max_positions=128,
    )  # fmt: skip
    save_bert(BertModel(config), out, tokenizer)
    return out


def run(capsys, *argv: object) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of attnlab.cli.main in-process."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_error(result: tuple[int, str, str], *fragments: str) -> None:
    code, out, err = result
    assert code == 2, err
    assert out == "" and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnlab: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if not row.get("eval")]


def eval_rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if row.get("eval")]


# ---------------------------------------------------------------------------- batching


def test_length_grouped_batches_pad_little_and_resume_exactly():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 60, (500,), generator=g).tolist()
    rows = [{"input_ids": [7] * n, "token_type_ids": [0] * n, "labels": i % 2} for i, n in
            enumerate(lengths)]  # fmt: skip
    source = LengthGroupedBatches(rows, batch_size=16, pad_id=0, seed=3, chunk_batches=8)
    assert source.batches_per_epoch == 31
    epoch0 = source.epoch_batches(0)
    seen = torch.cat(epoch0)
    assert len(seen) == 31 * 16 == len(set(seen.tolist()))  # each row at most once per epoch
    assert not torch.equal(torch.cat(source.epoch_batches(1)), seen)  # reshuffled per epoch
    # Padding: grouped batches waste far less than random batches of the same rows.
    lens = torch.tensor(lengths)

    def waste(batches):
        return sum((lens[b].max() * len(b) - lens[b].sum()).item() for b in batches)

    random_batches = torch.randperm(500, generator=g)[: 31 * 16].split(16)
    assert waste(epoch0) < 0.25 * waste(random_batches)
    # Batch order is shuffled: not sorted by length across the epoch.
    longest = [lens[b].max().item() for b in epoch0]
    assert longest != sorted(longest, reverse=True)
    # Resume: a new source put at the saved position yields exactly the same next batches.
    it = iter(source)
    for _ in range(40):  # into the second epoch
        next(it)
    state = source.state_dict()
    expected = [next(it) for _ in range(5)]
    resumed = LengthGroupedBatches(rows, batch_size=16, pad_id=0, seed=3, chunk_batches=8)
    resumed.load_state_dict(state)
    again = iter(resumed)
    for a in expected:
        b = next(again)
        assert all(torch.equal(a[k], b[k]) for k in a)
    # Two ranks read the two halves of each global batch.
    ranks = []
    for rank in (0, 1):
        shard = LengthGroupedBatches(rows, batch_size=16, pad_id=0, seed=3, chunk_batches=8)
        shard.set_rank(rank, 2)
        ranks.append(next(iter(shard)))
    whole = next(iter(LengthGroupedBatches(rows, 16, 0, seed=3, chunk_batches=8)))
    assert sorted(whole["attention_mask"].sum(1).tolist()) == sorted(
        ranks[0]["attention_mask"].sum(1).tolist() + ranks[1]["attention_mask"].sum(1).tolist()
    )


def test_collate_pads_inputs_and_token_labels():
    rows = [
        {"input_ids": [2, 5, 3], "token_type_ids": [0, 0, 0], "labels": [-100, 1, -100]},
        {"input_ids": [2, 3], "token_type_ids": [0, 0], "labels": [-100, -100]},
    ]
    batch = collate(rows, pad_id=0)
    assert batch["input_ids"].tolist() == [[2, 5, 3], [2, 3, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["labels"].tolist() == [[-100, 1, -100], [-100, -100, -100]]
    scores = collate([{"input_ids": [2], "token_type_ids": [0], "labels": 0.5}], pad_id=0)
    assert scores["labels"].dtype == torch.float32


def test_collate_turns_qa_answers_into_target_shares():
    rows = [
        {"input_ids": [2, 5, 6, 7, 3], "token_type_ids": [0] * 5,
         "start_positions": [1, 1, 2], "end_positions": [2, 2, 3]},
        {"input_ids": [2, 5, 3], "token_type_ids": [0] * 3,
         "start_positions": [0], "end_positions": [0]},
    ]  # fmt: skip
    batch = collate(rows, pad_id=0)
    third = 1 / 3
    expected_starts = torch.tensor([[0, 2 * third, third, 0, 0], [1, 0, 0, 0, 0]])
    expected_ends = torch.tensor([[0, 0, 2 * third, third, 0], [1, 0, 0, 0, 0]])
    assert torch.allclose(batch["start_positions"], expected_starts)
    assert torch.allclose(batch["end_positions"], expected_ends)


@pytest.mark.parametrize(("choice", "targets"), [("all", 3), ("first", 1)])
def test_qa_trains_on_every_answer_or_the_first(choice, targets, tiny_dir, tmp_path):
    data = json.loads((DATA / "squad.json").read_text())
    qa = data["data"][0]["paragraphs"][0]["qas"][0]
    context = data["data"][0]["paragraphs"][0]["context"]
    gold = qa["answers"][0]
    shorter = {"text": gold["text"][:-1], "answer_start": gold["answer_start"]}
    qa["answers"] = [gold, gold, shorter]
    assert context[gold["answer_start"] :].startswith(gold["text"])
    path = write(tmp_path / "squad.json", json.dumps(data))
    settings = DataSettings(task="qa", max_length=128, doc_stride=32, max_question_length=64)
    qa_task = QATask(settings, train_answers=choice)
    examples = qa_task.read_training(path)
    rows = qa_task.featurise(BertTokenizer.from_dir(tiny_dir), examples, None, path).rows
    assert len(rows[0]["start_positions"]) == targets
    assert rows[0]["start_positions"][0] > 0  # the answer is in the one window
    assert all(len(row["start_positions"]) == 1 for row in rows[1:])


def test_unknown_train_answers_choice_is_one_error(tiny_dir, tmp_path, capsys):
    result = run(capsys, "finetune", "--task", "qa", "--model", tiny_dir, "--train",
                 DATA / "squad.json", "--out", tmp_path / "x", "--train-answers", "some")  # fmt: skip
    assert_one_error(result, "--train-answers")
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------- every task trains

TASK_FILES = {
    "classify": (DATA / "sentiment.tsv", {"text_column": "sentence"}),
    "regress": (
        DATA / "sts.csv",
        {"text_column": "sentence1", "text_pair_column": "sentence2", "label_column": "score"},
    ),
    "ner": (DATA / "ner.conll", {}),
    "qa": (DATA / "squad.json", {"max_length": 48, "doc_stride": 16}),  # 2-3 windows
}


@pytest.mark.parametrize("task", list(TASK_FILES))
def test_each_task_loss_falls(task, tiny_dir, minilm_dir, tmp_path):
    train, extra = TASK_FILES[task][0], dict(TASK_FILES[task][1])
    # A random tiny encoder barely separates sentences through [CLS] in 24 steps; the real
    # MiniLM (at short length) learns the sentiment fixture at 2e-4 (the last 4 losses 13-37%
    # of the first 4 for seeds 0-3; at 1e-4 64-82%, too close to this test's 80%).
    model, lr = (minilm_dir, 2e-4) if task == "classify" else (tiny_dir, 3e-3)
    opts = FinetuneOptions(
        task=task, model=model, train=train, out=tmp_path / "out", steps=24, batch_size=4,
        lr=lr, log_every=1, progress=False, max_length=extra.pop("max_length", 32), **extra,
    )  # fmt: skip
    summary = finetune(opts)
    curve = losses(tmp_path / "out")
    assert len(curve) == 24
    assert sum(curve[-4:]) / 4 < 0.8 * sum(curve[:4]) / 4, curve
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["kept"] == "last step" and results["final"]["step"] == 24  # no --dev
    assert summary["results"] == results
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert not (tmp_path / "out" / "best").exists()  # published


def test_the_same_seed_trains_the_same_weights(tiny_dir, tmp_path):
    # The fresh classifier head is drawn from --seed too, so a run is repeatable; another seed
    # draws another head (the encoder comes from the checkpoint either way).
    def weights(seed: int, out: str) -> dict[str, torch.Tensor]:
        torch.manual_seed(1000 + seed + len(out))  # whatever the global RNG held before
        opts = FinetuneOptions(
            task="classify", model=tiny_dir, train=DATA / "sentiment.tsv", out=tmp_path / out,
            text_column="sentence", steps=3, batch_size=4, seed=seed, progress=False,
        )  # fmt: skip
        finetune(opts)
        return load_file(tmp_path / out / "model.safetensors")

    first, again, other = weights(0, "a"), weights(0, "bb"), weights(1, "c")
    assert first.keys() == again.keys()
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not all(torch.equal(first[name], other[name]) for name in first)


# ---------------------------------------------------------------------------- CLI end to end


def hf_logits(model_dir: Path, texts, pairs=None):
    """Logits of HF transformers' own model and tokenizer on the saved checkpoint."""
    from transformers import AutoModelForSequenceClassification, BertTokenizerFast

    tok = BertTokenizerFast.from_pretrained(str(model_dir))
    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir)).eval()
    enc = tok(texts, pairs, padding=True, truncation=True, max_length=128, return_tensors="pt")
    with torch.no_grad():
        return model(**enc).logits, model.config


def test_classify_end_to_end_keeps_the_best_dev_model(tiny_dir, tmp_path, capsys):
    from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

    out = tmp_path / "sst"
    code, stdout, err = run(
        capsys, "finetune", "--task", "classify", "--model", tiny_dir, "--train",
        DATA / "sentiment.tsv", "--dev", DATA / "sentiment_dev.tsv", "--text-column",
        "sentence", "--out", out, "--epochs", "4", "--batch-size", "4", "--eval-every", "2",
        *FAST,
    )  # fmt: skip
    assert code == 0, err
    results = json.loads(stdout)
    assert "new randomly initialised classifier" in err
    # The kept model is the first evaluation with the highest dev accuracy.
    rows = eval_rows(out)
    assert len(rows) == 12  # every 2 of 24 steps
    best_row = max(rows, key=lambda r: r["accuracy"])
    assert results["best"]["step"] == best_row["step"]
    assert results["best"]["epoch"] == pytest.approx(best_row["step"] / 6, abs=1e-3)
    saved = json.loads((out / "results.json").read_text())
    assert saved["best"]["accuracy"] == best_row["accuracy"]

    # evaluate: one JSON line, the saved columns are the defaults, values as HF computes them.
    code, stdout, err = run(
        capsys, "evaluate", "--model", out, "--data", DATA / "sentiment_dev.tsv"
    )
    assert code == 0, err
    assert len(stdout.splitlines()) == 1
    metrics = json.loads(stdout)
    assert set(metrics) == {"accuracy", "f1", "mcc"}
    dev = [line.split("\t") for line in (DATA / "sentiment_dev.tsv").read_text().splitlines()[1:]]
    logits, config = hf_logits(out, [t for t, _ in dev])
    assert config.id2label == {0: "neg", 1: "pos"}
    gold = [config.label2id[label] for _, label in dev]
    predicted = logits.argmax(-1).tolist()
    assert metrics["accuracy"] == pytest.approx(accuracy_score(gold, predicted))
    assert metrics["f1"] == pytest.approx(f1_score(gold, predicted, average="macro"))
    assert metrics["mcc"] == pytest.approx(matthews_corrcoef(gold, predicted))
    assert metrics["accuracy"] == pytest.approx(best_row["accuracy"])  # the best-dev model

    # predict: JSONL rows with the label and probabilities HF's logits give.
    code, _, err = run(
        capsys, "predict", "--model", out, "--input", DATA / "sentiment_dev.tsv", "--output",
        tmp_path / "pred.jsonl",
    )  # fmt: skip
    assert code == 0, err
    rows = [json.loads(line) for line in (tmp_path / "pred.jsonl").read_text().splitlines()]
    probs = torch.softmax(logits, -1)
    for row, p, (text, _) in zip(rows, probs, dev, strict=True):
        assert row["text"] == text
        assert row["label"] == config.id2label[int(p.argmax())]
        assert row["probabilities"]["pos"] == pytest.approx(p[1].item(), abs=1e-5)
    # predict refuses to overwrite its output.
    assert_one_error(
        run(capsys, "predict", "--model", out, "--input", DATA / "sentiment_dev.tsv",
            "--output", tmp_path / "pred.jsonl"),
        "exists",
    )  # fmt: skip
    # --overwrite replaces it, keeping its permissions (a private file was made 0644)
    (tmp_path / "pred.jsonl").chmod(0o600)
    code, _, err = run(capsys, "predict", "--model", out, "--input", DATA / "sentiment_dev.tsv",
                       "--output", tmp_path / "pred.jsonl", "--overwrite")  # fmt: skip
    assert code == 0, err
    assert (tmp_path / "pred.jsonl").stat().st_mode & 0o777 == 0o600


def test_a_dev_score_undefined_at_every_evaluation(tiny_dir, tmp_path, capsys):
    # Equal gold scores leave the correlations undefined (NaN) at every evaluation.
    rows = (DATA / "sts.csv").read_text().splitlines()
    flat = [rows[0], *(",".join([*row.rsplit(",", 1)[:1], "3.0"]) for row in rows[1:])]
    dev = write(tmp_path / "flat.csv", "\n".join(flat) + "\n")
    out = tmp_path / "sts"
    code, stdout, err = run(
        capsys, "finetune", "--task", "regress", "--model", tiny_dir, "--train", DATA / "sts.csv",
        "--dev", dev, "--text-column", "sentence1", "--text-pair-column", "sentence2",
        "--label-column", "score", "--out", out, "--steps", "2", "--batch-size", "4", *FAST,
    )  # fmt: skip
    assert code == 0, err

    # results.json held a bare NaN, which strict JSON readers refuse; it is null, as in the
    # printed summary.
    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in results.json")

    results = json.loads((out / "results.json").read_text(), parse_constant=refuse)
    assert results["final"]["eval"]["pearson"] is None

    # No evaluation picks a best model: results.json and the summary said the last step's
    # model was kept, but --out held none. It holds the final checkpoint's weights.
    assert json.loads(stdout)["kept"] == "last step"
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    saved = load_finetuned(out).model.state_dict()
    last = load_file(out / "checkpoints" / "step-2" / "model.safetensors")
    assert set(last) == set(saved)
    for name, tensor in last.items():
        torch.testing.assert_close(saved[name], tensor, rtol=0, atol=0)
    code, stdout, err = run(capsys, "evaluate", "--model", out, "--data", DATA / "sts.csv")
    assert code == 0, err


def test_regress_pairs_end_to_end(tiny_dir, tmp_path, capsys):
    from scipy.stats import pearsonr, spearmanr

    out = tmp_path / "sts"
    code, _, err = run(
        capsys, "finetune", "--task", "regress", "--model", tiny_dir, "--train", DATA / "sts.csv",
        "--dev", DATA / "sts.csv", "--text-column", "sentence1", "--text-pair-column",
        "sentence2", "--label-column", "score", "--out", out, "--epochs", "3",
        "--batch-size", "4", *FAST,
    )  # fmt: skip
    assert code == 0, err
    code, stdout, err = run(capsys, "evaluate", "--model", out, "--data", DATA / "sts.csv")
    assert code == 0, err
    metrics = json.loads(stdout)
    import csv

    rows = list(csv.DictReader((DATA / "sts.csv").open()))
    logits, config = hf_logits(out, [r["sentence1"] for r in rows], [r["sentence2"] for r in rows])
    assert config.problem_type == "regression" and config.num_labels == 1
    gold = [float(r["score"]) for r in rows]
    # The scores equal HF's to 1e-5 (below); this barely trained model's scores spread over
    # little, so float rounding (oneDNN here, MKL in HF) moves its correlations by up to ~1e-4.
    assert metrics["pearson"] == pytest.approx(pearsonr(logits[:, 0], gold)[0], abs=2e-4)
    assert metrics["spearman"] == pytest.approx(spearmanr(logits[:, 0], gold)[0], abs=2e-4)
    code, _, err = run(capsys, "predict", "--model", out, "--input", DATA / "sts.csv",
                       "--output", tmp_path / "p.jsonl")  # fmt: skip
    assert code == 0, err
    scores = [json.loads(line)["score"] for line in (tmp_path / "p.jsonl").open()]
    assert scores == pytest.approx(logits[:, 0].tolist(), abs=1e-5)


def test_a_headerless_pair_table_is_read_with_columns(tiny_dir, tmp_path, capsys):
    """AFQMC / LCQMC style: sentence<TAB>sentence<TAB>label with no header; evaluate reuses it."""
    rows = [line.split("\t") for line in (DATA / "sentiment.tsv").read_text().splitlines()[1:]]
    table = "".join(f"{r[0]}\t{r[0][::-1]}\t{r[1]}\n" for r in rows)
    train = write(tmp_path / "pairs.tsv", table)
    out = tmp_path / "pairs"
    code, _, err = run(
        capsys, "finetune", "--task", "classify", "--model", tiny_dir, "--train", train,
        "--dev", train, "--columns", "a,b,label", "--text-column", "a", "--text-pair-column",
        "b", "--out", out, "--steps", "2", "--batch-size", "4", *FAST,
    )  # fmt: skip
    assert code == 0, err
    code, stdout, err = run(capsys, "evaluate", "--model", out, "--data", train)
    assert code == 0, err
    assert 0 <= json.loads(stdout)["accuracy"] <= 1
    # Without --columns the first row is taken as the header, and its names are not "a"/"b".
    code, _, err = run(
        capsys, *finetune_args(tiny_dir, train, tmp_path / "x", "--text-column", "a")
    )
    assert code == 2 and "column" in err and not (tmp_path / "x").exists()


def test_columns_with_spaces_after_the_commas_name_the_columns(tiny_dir, tmp_path, capsys):
    """--columns "a, b, label" names a, b and label (it named " b" and " label", and the
    error listed columns present that looked like the ones asked for)."""
    table = write(tmp_path / "pairs.tsv", "今天天气好\t天气不错\t1\n我不开心\t今天下雨\t0\n")
    settings = {"text_column": "a", "text_pair_column": "b", "label_column": "label"}
    examples = task_for(DataSettings(task="classify", **settings, columns="a, b, label")).read(
        table, labelled=True
    )
    assert [(e.text, e.pair, e.label) for e in examples] == [
        ("今天天气好", "天气不错", "1"),
        ("我不开心", "今天下雨", "0"),
    ]
    out = tmp_path / "pairs"
    code, _, err = run(
        capsys, "finetune", "--task", "classify", "--model", tiny_dir, "--train", table,
        "--dev", table, "--columns", "a, b, label", "--text-column", "a",
        "--text-pair-column", "b", "--out", out, "--steps", "1", "--batch-size", "2", *FAST,
    )  # fmt: skip
    assert code == 0, err
    code, stdout, err = run(capsys, "evaluate", "--model", out, "--data", table)
    assert code == 0, err
    assert 0 <= json.loads(stdout)["accuracy"] <= 1


@pytest.mark.parametrize("fixture", ["ner.conll", "ner_zh.conll"])
def test_ner_end_to_end(fixture, tiny_dir, tmp_path, capsys):
    from seqeval.metrics import f1_score
    from transformers import AutoModelForTokenClassification, BertTokenizerFast

    from attnlab.text.tasks import read_conll

    out = tmp_path / "ner"
    code, _, err = run(
        capsys, "finetune", "--task", "ner", "--model", tiny_dir, "--train", DATA / fixture,
        "--dev", DATA / fixture, "--out", out, "--epochs", "4", "--batch-size", "2", *FAST,
    )  # fmt: skip
    assert code == 0, err
    code, stdout, err = run(capsys, "evaluate", "--model", out, "--data", DATA / fixture)
    assert code == 0, err
    metrics = json.loads(stdout)
    assert set(metrics) == {"precision", "recall", "f1"}
    # Reference: HF's model and fast tokenizer, each word tagged by its first sub-token.
    sentences = read_conll(DATA / fixture)
    tok = BertTokenizerFast.from_pretrained(str(out))
    model = AutoModelForTokenClassification.from_pretrained(str(out)).eval()
    predicted = []
    for sentence in sentences:
        enc = tok(sentence.words, is_split_into_words=True, return_tensors="pt")
        with torch.no_grad():
            ids = model(**enc).logits[0].argmax(-1).tolist()
        tags, previous = [], None
        for position, word in enumerate(enc.word_ids()):
            if word is not None and word != previous:
                tags.append(model.config.id2label[ids[position]])
            previous = word
        predicted.append(tags)
    gold = [s.tags for s in sentences]
    assert metrics["f1"] == pytest.approx(f1_score(gold, predicted))
    code, _, err = run(capsys, "predict", "--model", out, "--input", DATA / fixture,
                       "--output", tmp_path / "p.conll")  # fmt: skip
    assert code == 0, err
    blocks = (tmp_path / "p.conll").read_text().strip().split("\n\n")
    assert [[line.split()[1] for line in b.splitlines()] for b in blocks] == predicted
    assert [[line.split()[0] for line in b.splitlines()] for b in blocks] == [
        s.words for s in sentences
    ]
    # From Python: the same tags for word lists, as HF's
    rows = load_finetuned(out).predict([s.words for s in sentences])
    assert [row["tags"] for row in rows] == predicted


def test_qa_end_to_end(tiny_dir, tmp_path, capsys):
    from attnlab.metrics import normalize_answer

    out = tmp_path / "qa"
    code, _, err = run(
        capsys, "finetune", "--task", "qa", "--model", tiny_dir, "--train", DATA / "squad.json",
        "--dev", DATA / "squad.json", "--out", out, "--epochs", "3", "--batch-size", "4",
        "--max-length", "48", "--doc-stride", "16", *FAST,
    )  # fmt: skip
    assert code == 0, err
    code, stdout, err = run(capsys, "evaluate", "--model", out, "--data", DATA / "squad.json")
    assert code == 0, err
    metrics = json.loads(stdout)
    code, _, err = run(capsys, "predict", "--model", out, "--input", DATA / "squad.json",
                       "--output", tmp_path / "answers.json")  # fmt: skip
    assert code == 0, err
    answers = json.loads((tmp_path / "answers.json").read_text())
    gold = {
        qa["id"]: qa["answers"][0]["text"]
        for article in json.loads((DATA / "squad.json").read_text())["data"]
        for paragraph in article["paragraphs"]
        for qa in paragraph["qas"]
    }
    assert set(answers) == set(gold)
    questions = [
        (qa["id"], qa["question"], paragraph["context"])
        for article in json.loads((DATA / "squad.json").read_text())["data"]
        for paragraph in article["paragraphs"]
        for qa in paragraph["qas"]
    ]
    rows = load_finetuned(out).predict([(q, context) for _, q, context in questions])
    assert [row["answer"] for row in rows] == [answers[qid] for qid, _, _ in questions]
    exact = sum(normalize_answer(answers[q]) == normalize_answer(g) for q, g in gold.items())
    assert metrics["exact_match"] == pytest.approx(100 * exact / len(gold))
    assert 0 <= metrics["exact_match"] <= metrics["f1"] <= 100


# ---------------------------------------------------------------------------- bad input


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def finetune_args(tiny_dir: Path, train: Path, out: Path, *extra: object) -> list[object]:
    return ["finetune", "--task", "classify", "--model", tiny_dir, "--train", train,
            "--out", out, "--steps", "1", "--batch-size", "2", *FAST, *extra]  # fmt: skip


def qa_args(tiny_dir: Path, train: Path, out: Path, *extra: object) -> list[object]:
    """finetune_args for a SQuAD file, in windows small enough for the tiny model."""
    args = finetune_args(tiny_dir, train, out, "--max-length", "64", "--doc-stride", "16", *extra)
    args[2] = "qa"
    return args


@pytest.mark.parametrize(
    ("name", "text", "task", "fragment"),
    [
        ("nolabel.tsv", "text\tlabel\nok\tpos\nbad\tneg\n", "classify", "no column 'rating'"),
        ("mixed.tsv", "text\trating\nok\t1\nbad\tneg\n", "classify", "mixed label types"),
        ("empty.tsv", "", "classify", "empty"),
        ("header.tsv", "text\trating\n", "classify", "no rows"),
        ("bad.conll", "John B-PER\nSmith\n", "ner", "line 2"),
        ("badtag.conll", "John PER\n", "ner", "line 1"),
    ],
)
def test_bad_training_files(name, text, task, fragment, tiny_dir, tmp_path, capsys):
    train = write(tmp_path / name, text)
    out = tmp_path / "out"
    args = finetune_args(tiny_dir, train, out, "--label-column", "rating")
    args[2] = task
    assert_one_error(run(capsys, *args), fragment)
    assert not out.exists()


def test_squad_offsets_that_miss_the_context(tiny_dir, tmp_path, capsys):
    data = json.loads((DATA / "squad.json").read_text())
    data["data"][0]["paragraphs"][0]["qas"][0]["answers"][0]["answer_start"] += 3
    train = write(tmp_path / "bad.json", json.dumps(data))
    out = tmp_path / "out"
    args = qa_args(tiny_dir, train, out)
    assert_one_error(run(capsys, *args), "q1", "not at offset", "--fix-answer-offsets")
    assert not out.exists()


def test_squad_training_question_without_answers_is_refused(tiny_dir, tmp_path, capsys):
    # Before, a question lacking its "answers" key (an unlabelled file given as --train)
    # trained as unanswerable; a prediction file may lack them, a training file may not.
    data = json.loads((DATA / "squad.json").read_text())
    del data["data"][0]["paragraphs"][0]["qas"][1]["answers"]
    train = write(tmp_path / "unlabelled.json", json.dumps(data))
    out = tmp_path / "out"
    args = qa_args(tiny_dir, train, out)
    assert_one_error(run(capsys, *args), "'q2'", 'no "answers" list', '"answers": []')
    assert not out.exists()
    assert len(QATask(DataSettings(task="qa")).read(train, labelled=False)) == 8


def test_pairs_on_a_one_segment_model_and_one_class_are_refused(tiny_dir, tmp_path, capsys):
    # Before: an IndexError after the fresh-head notice (and an empty --out left), and a
    # one-output "classifier" that scored 1.0.
    one_type = tmp_path / "one_type"
    shutil.copytree(tiny_dir, one_type)
    config = json.loads((one_type / "config.json").read_text())
    (one_type / "config.json").write_text(json.dumps({**config, "type_vocab_size": 1}))
    weights = load_file(str(one_type / "model.safetensors"))
    name = "embeddings.token_type_embeddings.weight"
    save_file({**weights, name: weights[name][:1].clone()}, str(one_type / "model.safetensors"))
    out = tmp_path / "out"
    args = ["finetune", "--task", "regress", "--model", one_type, "--train", DATA / "sts.csv",
            "--text-column", "sentence1", "--text-pair-column", "sentence2",
            "--label-column", "score", "--out", out, "--steps", "1"]  # fmt: skip
    assert_one_error(run(capsys, *args), "one token type (type_vocab_size 1)")
    args[2] = "qa"
    assert_one_error(run(capsys, *args[:3], "--model", one_type, "--train", DATA / "squad.json",
                         "--out", out), "one token type")  # fmt: skip
    assert not out.exists()
    single = write(tmp_path / "one.tsv", "sentence\tlabel\ngood film\tpos\nnice one\tpos\n")
    args = finetune_args(tiny_dir, single, out, "--text-column", "sentence")
    assert_one_error(run(capsys, *args), "every example has the label 'pos'", "two classes")
    assert not out.exists()


def test_fix_answer_offsets_leaving_no_question_is_named(tiny_dir, tmp_path, capsys):
    data = json.loads((DATA / "squad.json").read_text())
    for article in data["data"]:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                qa["answers"] = [{"text": "Zagreb", "answer_start": 0}]  # in no context
    train = write(tmp_path / "none.json", json.dumps(data))
    args = qa_args(tiny_dir, train, tmp_path / "out")
    code, out, err = run(capsys, *args, "--fix-answer-offsets")
    assert code == 2 and out == ""
    assert err.splitlines()[-1].endswith("no question has its answer in its context: nothing "
                                         "to train on")  # fmt: skip


def test_fix_answer_offsets_moves_wrong_offsets_and_drops_absent_answers(
    tiny_dir, tmp_path, capsys
):
    data = json.loads((DATA / "squad.json").read_text())
    qas = data["data"][0]["paragraphs"][0]["qas"]
    qas[0]["answers"][0]["answer_start"] += 3  # q1: 'the Black Sea' really starts at 140
    qas[1]["answers"][0]["text"] = "Zagreb"  # q2: not in the context at all
    train = write(tmp_path / "cmrc_like.json", json.dumps(data))
    examples = QATask(DataSettings(task="qa"), fix_answer_offsets=True).read_training(train)
    by_id = {example.id: example for example in examples}
    assert "q2" not in by_id and len(examples) == 7
    assert by_id["q1"].answers == [{"text": "the Black Sea", "answer_start": 140}]
    scoring = QATask(DataSettings(task="qa")).read(train, labelled=True)
    assert [e.other_answers for e in scoring if e.id == "q2"] == [["Zagreb"]]

    out = tmp_path / "out"
    args = qa_args(tiny_dir, train, out)
    code, _, err = run(capsys, *args, "--fix-answer-offsets")
    assert code == 0, err
    assert "moved 1 answer offset(s)" in err
    assert "1 question(s) whose answer is not in the context are left out of training" in err
    assert (out / "model.safetensors").is_file()


def test_out_holding_files_is_refused(tiny_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    train = DATA / "sentiment.tsv"
    args = finetune_args(tiny_dir, train, out, "--text-column", "sentence")
    assert_one_error(run(capsys, *args), "--overwrite")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert run(capsys, *args, "--overwrite")[0] == 0
    assert (out / "model.safetensors").is_file()


def test_heads_that_do_not_fit(tiny_dir, tmp_path, capsys):
    classifier = tmp_path / "clf"
    args = finetune_args(tiny_dir, DATA / "sentiment.tsv", classifier, "--text-column", "sentence")
    assert run(capsys, *args)[0] == 0
    # A fine-tuned pos/neg classifier, fine-tuned again on 3-way NLI labels: refused ...
    nli = ["--text-column", "premise", "--text-pair-column", "hypothesis"]
    out = tmp_path / "nli"
    assert_one_error(
        run(capsys, *finetune_args(classifier, DATA / "nli.jsonl", out, *nli)), "--new-head"
    )
    assert not out.exists()
    # ... unless asked to replace the head.
    code, _, err = run(capsys, *finetune_args(classifier, DATA / "nli.jsonl", out, *nli,
                                              "--new-head"))  # fmt: skip
    assert code == 0, err
    assert json.loads((out / "config.json").read_text())["id2label"] == {
        "0": "contradiction", "1": "entailment", "2": "neutral",
    }  # fmt: skip
    # Evaluating a classifier as another task; evaluating a plain encoder.
    data = DATA / "squad.json"
    assert_one_error(run(capsys, "evaluate", "--model", classifier, "--data", data, "--task",
                         "qa"), "'classify' model")  # fmt: skip
    assert_one_error(run(capsys, "evaluate", "--model", tiny_dir, "--data", data), "no fine-tuned")
    # A label the model never saw is an error naming the file and line.
    dev = write(tmp_path / "dev.tsv", "sentence\tlabel\ngood\tpos\nmeh\tmaybe\n")
    assert_one_error(
        run(capsys, "evaluate", "--model", classifier, "--data", dev), "line 3", "'maybe'"
    )


def test_settings_refused_before_training_or_writing(tiny_dir, tmp_path, capsys):
    out = tmp_path / "out"
    args = finetune_args(tiny_dir, DATA / "sentiment.tsv", out, "--text-column", "sentence")
    dev = ["--dev", DATA / "sentiment_dev.tsv"]
    # a misspelt --best-metric was found only at the first dev score, after training
    assert_one_error(run(capsys, *args, *dev, "--best-metric", "acc"), "not a classify score")
    assert_one_error(run(capsys, *args, "--best-metric", "f1"), "--best-metric needs --dev")
    assert_one_error(run(capsys, *args, "--weight-decay", "-1"), "--weight-decay must be >= 0")
    assert_one_error(run(capsys, *args, "--weight-decay", "nan"), "--weight-decay must be a finite")
    three = write(tmp_path / "three.tsv", "sentence\tlabel\na\tx\nb\ty\nc\tz\nd\tx\n")
    args3 = finetune_args(tiny_dir, three, out, "--text-column", "sentence", "--dev", three)
    assert_one_error(run(capsys, *args3, "--best-metric", "mcc"), "mcc needs two classes")
    assert not out.exists()


def test_evaluate_and_predict_refuse_bad_settings_and_outputs(tiny_dir, tmp_path, capsys):
    model = tmp_path / "clf"
    args = finetune_args(tiny_dir, DATA / "sentiment.tsv", model, "--text-column", "sentence")
    assert run(capsys, *args)[0] == 0
    data = DATA / "sentiment_dev.tsv"
    for command, extra in (("evaluate", ["--data", data]),
                           ("predict", ["--input", data, "--output", tmp_path / "p.jsonl"])):  # fmt: skip
        for size in ("0", "-1"):
            result = run(capsys, command, "--model", model, *extra, "--batch-size", size)
            assert_one_error(result, "--batch-size must be at least 1")
    (tmp_path / "notes.txt").write_text("mine")
    for output, fragment in ((tmp_path, "is a directory"),
                             (f"{tmp_path}/new.jsonl/", "names a directory"),  # wrote new.jsonl
                             (tmp_path / "notes.txt" / "p.jsonl", "notes.txt is a file")):  # fmt: skip
        result = run(capsys, "predict", "--model", model, "--input", data, "--output", output,
                     "--overwrite")  # fmt: skip
        assert_one_error(result, fragment)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    # Before, --overwrite replaced a FIFO or a symbolic link with a file (the link's target
    # kept its old text), and a loop of links gave a traceback.
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    for output, fragment in ((tmp_path / "fifo", "not a regular file"),
                             (tmp_path / "loop1", "cannot be used: Symlink loop")):  # fmt: skip
        result = run(capsys, "predict", "--model", model, "--input", data, "--output", output,
                     "--overwrite")  # fmt: skip
        assert_one_error(result, fragment)
    assert stat.S_ISFIFO((tmp_path / "fifo").stat().st_mode)
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "notes.txt")
    result = run(capsys, "predict", "--model", model, "--input", data,
                 "--output", tmp_path / "link.jsonl", "--overwrite")  # fmt: skip
    assert result[0] == 0, result
    assert (tmp_path / "link.jsonl").is_symlink()  # written through: the link stays
    assert (tmp_path / "notes.txt").read_text().startswith("{")
    # id2label that does not fit the head: a traceback (zip) or labels such as "None" before
    config = json.loads((model / "config.json").read_text())
    for id2label, fragment in (({"0": "a", "1": "b", "2": "c"}, "names 3 labels"),
                               ({"0": None, "1": "b"}, "printable strings, got None"),
                               ({"0": "a\n", "1": "b"}, "printable strings, got 'a\\n'"),
                               (["a", "b"], "id2label must be a table")):  # fmt: skip
        (model / "config.json").write_text(json.dumps({**config, "id2label": id2label}))
        result = run(capsys, "predict", "--model", model, "--input", data,
                     "--output", tmp_path / "p.jsonl", "--overwrite")  # fmt: skip
        assert_one_error(result, fragment)
    (model / "config.json").write_text(json.dumps(config))
    # an infinite head weight (the head's own check, apart from the encoder's)
    weights = load_file(str(model / "model.safetensors"))
    save_file({**weights, "classifier.bias": torch.full_like(weights["classifier.bias"], float("inf"))},
              str(model / "model.safetensors"))  # fmt: skip
    result = run(capsys, "predict", "--model", model, "--input", data,
                 "--output", tmp_path / "p.jsonl", "--overwrite")  # fmt: skip
    assert_one_error(result, "weight classifier.bias holds NaN or infinite values")
    save_file(weights, str(model / "model.safetensors"))
    # a damaged finetune.json is named, and its task cannot contradict the model's head
    settings = model / "finetune.json"
    for text, fragment in (("[1]", "expected a JSON object"),
                           ('{"max_length": "abc"}', "max_length must be an integer"),
                           ('{"task": "regress"}', "says task 'regress'"),
                           # in range too: 0 made every QA answer empty, with exit 0
                           ('{"max_answer_length": 0}', "--max-answer-length must be at least 1"),
                           ('{"language": "klingon"}', "--language must be auto, en or zh")):  # fmt: skip
        settings.write_text(text)
        assert_one_error(run(capsys, "evaluate", "--model", model, "--data", data), fragment)


def test_resume_before_the_first_log_row_or_into_a_new_out(tiny_dir, tmp_path, capsys):
    out = tmp_path / "run"
    args = finetune_args(tiny_dir, DATA / "sentiment.tsv", out, "--text-column", "sentence")
    args[args.index("--steps") + 1] = "2"
    # --resume into an --out that does not exist yet starts the run (a retry loop's first try)
    assert run(capsys, *args, "--resume", "--save-every", "1")[0] == 0
    final = (out / "model.safetensors").read_bytes()
    # A run killed after its first checkpoint but before its first log row: only checkpoints.
    for name in os.listdir(out):
        if name != "checkpoints":
            path = out / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    shutil.rmtree(out / "checkpoints" / "step-2")
    code, _, err = run(capsys, *args, "--resume", "--save-every", "1")
    assert code == 0, err
    assert (out / "model.safetensors").read_bytes() == final  # resumed from step 1 exactly


def test_resume_after_two_sigkills_is_bit_identical(tiny_dir, tmp_path):
    # 10 steps of 8 batches an epoch cross an epoch of the length-grouped batches; the dev F1
    # rises at steps 4 and 6, so the first resume (from step 3) replaces best/ twice.
    def command(out: Path) -> list[object]:
        args = qa_args(tiny_dir, DATA / "squad.json", out, "--dev", DATA / "squad.json")
        for flag, value in (("--max-length", 48), ("--steps", 10)):
            args[args.index(flag) + 1] = value
        return [*args, "--eval-every", 2, "--save-every", 3, "--keep-last", 2]

    assert_resume_after_two_sigkills_is_bit_identical(command, tmp_path, 6, 4)  # kill 2: step 7
    results = json.loads((tmp_path / "killed" / "results.json").read_text())
    assert results["kept"] == "best dev" and results["best"]["step"] == 6


def test_unscorable_dev_and_predictions_onto_inputs_are_refused_first(tiny_dir, tmp_path, capsys):
    # A QA dev question without a gold answer was found at the first dev score, after training.
    squad = json.loads((DATA / "squad.json").read_text())
    squad["data"][0]["paragraphs"][0]["qas"][0]["answers"] = []
    dev = write(tmp_path / "dev.json", json.dumps(squad))
    args = finetune_args(tiny_dir, DATA / "squad.json", tmp_path / "qa", "--dev", dev)
    args[2] = "qa"
    result = run(capsys, *args, "--max-length", "128", "--doc-stride", "32")
    assert_one_error(result, "has no gold answer to score against")
    assert not (tmp_path / "qa").exists()
    assert_one_error(run(capsys, "finetune", "--task", "classify", "--model", tiny_dir,
                         "--train", tmp_path, "--out", tmp_path / "o"), "is a directory")  # fmt: skip
    model = tmp_path / "clf"
    args = finetune_args(tiny_dir, DATA / "sentiment.tsv", model, "--text-column", "sentence")
    assert run(capsys, *args)[0] == 0
    data = write(tmp_path / "in.tsv", (DATA / "sentiment_dev.tsv").read_text())
    for output in (data, model / "config.json"):
        result = run(capsys, "predict", "--model", model, "--input", data, "--output", output,
                     "--overwrite")  # fmt: skip
        assert_one_error(result, "would replace the input")
    assert data.read_text() == (DATA / "sentiment_dev.tsv").read_text()


def test_the_task_may_come_from_the_config_file(tiny_dir, tmp_path, capsys):
    config = write(tmp_path / "ft.toml", 'task = "classify"\ntext_column = "sentence"\n')
    args = finetune_args(tiny_dir, DATA / "sentiment.tsv", tmp_path / "out", "--config", config)
    del args[1:3]  # no --task flag
    code, _, err = run(capsys, *args)
    assert code == 0, err
    assert_one_error(run(capsys, *args[:-2], "--out", tmp_path / "o2"), "needs --task")


def test_python_api_checks_options_and_leaves_them_as_given(tiny_dir, tmp_path, capsys):
    # From Python (no CLI to type the options): a string for a number is a clear error, the
    # options object comes back unchanged (it once came back with max_length filled in), and
    # overrides name data settings only, typed (the task stays the model's).
    from attnlab.tasks.finetune import FinetuneOptions, evaluate_file, finetune

    common = dict(task="classify", model=tiny_dir, train=DATA / "sentiment.tsv", steps=1)
    common.update(batch_size=2, text_column="sentence", progress=False)
    with pytest.raises(AttnlabError, match="--epochs must be an integer or null, got '3'"):
        finetune(FinetuneOptions(**common, out=tmp_path / "x", epochs="3"))
    opts = FinetuneOptions(**common, out=str(tmp_path / "clf"), save_every=0, eval_every=0)
    given = dataclasses.replace(opts)
    finetune(opts)
    capsys.readouterr()
    assert opts == given and opts.max_length is None and isinstance(opts.out, str)
    data = DATA / "sentiment_dev.tsv"
    for overrides, fragment in (({"task": "regress"}, "no data setting task"),
                                ({"text_colum": "x"}, "no data setting text_colum"),
                                ({"max_length": "64"}, "max_length must be an integer")):  # fmt: skip
        with pytest.raises(AttnlabError, match=fragment):
            evaluate_file(tmp_path / "clf", data, overrides=overrides)
    assert "accuracy" in evaluate_file(tmp_path / "clf", data, overrides={"max_length": 64})
    # Predictions from Python inputs equal predict_file's rows for the same texts
    from attnlab.tasks.finetune import predict_file

    texts = ["a gripping, funny film", "dull and lifeless", "ok"]
    (tmp_path / "new.tsv").write_text("sentence\n" + "\n".join(texts) + "\n")
    predict_file(tmp_path / "clf", tmp_path / "new.tsv", tmp_path / "p.jsonl")
    expected = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    loaded = load_finetuned(tmp_path / "clf")
    loaded.model.train()  # left in training mode: predict() still drops nothing
    assert loaded.predict(texts) == expected and loaded.model.training
    with pytest.raises(AttnlabError, match=r"input 2: expected a text or a \(text, pair\) tuple"):
        loaded.predict(["fine", ["not", "a", "text"]])


def test_two_processes_under_torchrun_finish_with_exit_0(tiny_dir, tmp_path):
    # Before: rank 1 died with KeyError: 'results' (its summary has none) after rank 0 had
    # written the model, so torchrun stopped rank 0 with SIGTERM and exited with code 1.
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "ddp"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "attnlab"]
    command += ["finetune", "--task", "classify", "--model", str(tiny_dir), "--train",
                str(DATA / "sentiment.tsv"), "--text-column", "sentence", "--out", str(out),
                "--steps", "2", "--batch-size", "4", "--save-every", "0", *FAST]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    (line,) = done.stdout.splitlines()  # the results once, from rank 0
    assert json.loads(line)["final"]["step"] == 2
    assert json.loads((out / "results.json").read_text())["final"]["step"] == 2


def test_a_batch_ranks_cannot_split_is_refused_before_overwrite_clears_out(
    tiny_dir, tmp_path, capsys, monkeypatch
):
    # Before: under torchrun, --overwrite deleted the old run and only then did the trainer
    # refuse a --batch-size the processes cannot split.
    import attnlab.tasks.job
    import attnlab.train.trainer

    for module in (attnlab.tasks.job, attnlab.train.trainer):  # rank 0 of 2
        monkeypatch.setattr(module, "init_distributed", lambda: (0, 2, 0))
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    args = finetune_args(tiny_dir, DATA / "sentiment.tsv", out, "--text-column", "sentence")
    code, _, err = run(capsys, *args, "--batch-size", "3", "--overwrite")
    assert code == 2 and "not divisible by the 2 processes" in err, err
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]  # the old run, untouched


def test_evaluate_and_predict_progress_goes_to_stderr_only(tiny_dir, tmp_path, capsys):
    from attnlab.progress import LONG_INPUT

    out = tmp_path / "model"
    code, _, err = run(
        capsys, "finetune", "--task", "classify", "--model", tiny_dir, "--train",
        DATA / "sentiment.tsv", "--text-column", "sentence", "--out", out, "--epochs", "1",
        "--batch-size", "4", *FAST,
    )  # fmt: skip
    assert code == 0, err
    header, *rows = (DATA / "sentiment_dev.tsv").read_text().splitlines()
    long = write(tmp_path / "long.tsv", "\n".join([header, *(rows * LONG_INPUT)][: LONG_INPUT + 2]))
    n = LONG_INPUT + 1
    code, with_bar, err = run(capsys, "evaluate", "--model", out, "--data", long)
    assert code == 0 and f"{n}/{n}" in err  # tqdm's count, finished
    code, without_bar, err = run(
        capsys, "evaluate", "--model", out, "--data", long, "--no-progress"
    )
    assert (code, err) == (0, "")
    assert with_bar == without_bar and len(with_bar.splitlines()) == 1
    for flags, shown in (((), True), (("--no-progress",), False)):
        output = tmp_path / f"pred{len(flags)}.jsonl"
        code, stdout, err = run(
            capsys, "predict", "--model", out, "--input", long, "--output", output, *flags
        )
        assert (code, stdout) == (0, "")
        assert (f"{n}/{n}" in err) == shown and err.endswith(f"wrote predictions for {n} "
                                                            f"example(s) to {output}\n")  # fmt: skip
    assert (tmp_path / "pred0.jsonl").read_text() == (tmp_path / "pred1.jsonl").read_text()


def test_defaults_fit_the_model_and_data_are_printed_and_used(tiny_dir, tmp_path, capsys):
    from attnlab.tasks.finetune import defaults

    # tiny_dir: hidden size 32; sentiment.tsv: 24 training sentences
    base = ["finetune", "--task", "classify", "--model", tiny_dir, "--train",
            DATA / "sentiment.tsv", "--text-column", "sentence", "--threads", "1",
            "--no-progress", "--log-every", "1"]  # fmt: skip
    code, stdout, err = run(capsys, *base, "--out", tmp_path / "defaults")
    assert code == 0, err
    # The table: 1e-4 up to width 512; batch 8 (no size gives 500 steps an epoch); 3 steps an
    # epoch make 10 epochs (the most, short of 1,000 steps); a 10% warm-up.
    assert err.splitlines()[:4] == [
        "lr 1e-4 (default for hidden size 32)",
        "batch_size 8 (default for 24 training examples: 3 steps an epoch)",
        "epochs 10 (default: 3 steps an epoch)",
        "warmup_ratio 0.1 (default: BERT's share of the steps)",
    ]
    results = json.loads(stdout)
    assert (results["batches_per_epoch"], results["final"]["step"]) == (3, 30)
    rows = [json.loads(line) for line in (tmp_path / "defaults" / "metrics.jsonl").open()]
    lrs = [row["lr"] for row in rows if "lr" in row]
    assert max(lrs) == pytest.approx(1e-4) and lrs.index(max(lrs)) == 3  # ceil(10% of 30)
    # the table's functions, at the rows' edges
    assert [defaults.default_lr(w) for w in (128, 512, 513, 768, 1024)] == [
        1e-4, 1e-4, 3e-5, 3e-5, 2e-5,
    ]  # fmt: skip
    assert [defaults.default_batch_size(n) for n in (6000, 8000, 16000, 67349, 5)] == [
        8, 16, 32, 32, 5,
    ]  # fmt: skip
    assert [defaults.default_epochs(n) for n in (750, 250, 3, 2104)] == [3, 4, 10, 3]
    docs = (Path(__file__).parents[1] / "docs" / "finetuning.md").read_text()
    assert "up to 512: 1e-4; up to 768: 3e-5; larger: 2e-5" in docs  # the one table

    # every flag given wins, and says so
    code, stdout, err = run(
        capsys, *base, "--out", tmp_path / "given", "--lr", "2e-3", "--batch-size", "4",
        "--epochs", "2", "--warmup-ratio", "0",
    )  # fmt: skip
    assert code == 0, err
    assert err.splitlines()[:4] == [
        "lr 2e-3 (given)", "batch_size 4 (given)", "epochs 2 (given)", "warmup_ratio 0 (given)",
    ]  # fmt: skip
    results = json.loads(stdout)
    assert (results["batches_per_epoch"], results["final"]["step"]) == (6, 12)
    rows = [json.loads(line) for line in (tmp_path / "given" / "metrics.jsonl").open()]
    assert rows[0]["lr"] == pytest.approx(2e-3)  # no warm-up: the first step at the peak


# ---------------------------------------------------------------------------- pooling


def pooling_choice(capsys, model: Path, out: Path, **given) -> tuple[str, bool, list[str]]:
    """(the run's pooling, whether its encoder has no pooler, the printed pooling lines)."""
    from attnlab.tasks.finetune import prepare

    opts = FinetuneOptions(
        task="classify", model=model, train=DATA / "sentiment.tsv", out=out,
        text_column="sentence", max_length=32, progress=False, **given,
    )  # fmt: skip
    built = prepare(opts)  # builds the run, writes nothing
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("pooling")]
    return built.model.pooling, built.model.bert.pooler is None, lines


def test_pooling_follows_the_checkpoint_and_a_flag_wins(tiny_dir, minilm_dir, tmp_path, capsys):
    out = tmp_path / "unused"
    assert pooling_choice(capsys, minilm_dir, out) == (
        "mean", True, ["pooling mean (the checkpoint's sentence-transformers pooling)"],
    )  # fmt: skip
    assert pooling_choice(capsys, tiny_dir, out) == (
        "cls", False, ["pooling cls (default: BERT's [CLS] pooler)"],
    )  # fmt: skip
    assert pooling_choice(capsys, minilm_dir, out, pooling="cls") == (
        "cls", False, ["pooling cls (given)"],
    )  # fmt: skip
    # What decides: modules.json's Pooling module, pooling by the mean alone.
    folder = tmp_path / "st"
    shutil.copytree(tiny_dir, folder)
    shutil.copy(minilm_dir / "modules.json", folder)
    shutil.copytree(minilm_dir / "1_Pooling", folder / "1_Pooling")
    assert pooling_choice(capsys, folder, out)[0] == "mean"
    modes = folder / "1_Pooling" / "config.json"
    data = json.loads(modes.read_text())
    data.update(pooling_mode_mean_tokens=False, pooling_mode_cls_token=True)
    modes.write_text(json.dumps(data))
    assert pooling_choice(capsys, folder, out)[0] == "cls"
    assert not out.exists()


def mean_pooled_hf_probabilities(model_dir: Path, texts: list[str]) -> torch.Tensor:
    """Softmax of the saved classifier on HF BertModel's masked mean of the saved encoder."""
    from transformers import BertConfig as HFBertConfig
    from transformers import BertModel as HFBertModel
    from transformers import BertTokenizerFast

    weights = load_file(model_dir / "model.safetensors")
    encoder = HFBertModel(HFBertConfig.from_pretrained(str(model_dir)), add_pooling_layer=False)
    encoder.load_state_dict({k[5:]: v for k, v in weights.items() if k.startswith("bert.")})
    enc = BertTokenizerFast.from_pretrained(str(model_dir))(
        texts, padding=True, return_tensors="pt"
    )
    with torch.no_grad():
        hidden = encoder.eval()(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    return torch.softmax(pooled @ weights["classifier.weight"].T + weights["classifier.bias"], -1)


def test_a_mean_pooled_model_is_saved_and_rebuilt_by_predict(tiny_dir, tmp_path, capsys):
    out = tmp_path / "mean"
    train = DATA / "sentiment.tsv"
    code, _, err = run(capsys, *finetune_args(tiny_dir, train, out, "--text-column", "sentence",
                                              "--pooling", "mean"))  # fmt: skip
    assert code == 0, err
    assert "pooling mean (given)" in err.splitlines()
    assert json.loads((out / "config.json").read_text())["attnlab"]["pooling"] == "mean"
    dev = [line.split("\t") for line in (DATA / "sentiment_dev.tsv").read_text().splitlines()[1:]]
    code, _, err = run(capsys, "predict", "--model", out, "--input", DATA / "sentiment_dev.tsv",
                       "--output", tmp_path / "pred.jsonl")  # fmt: skip
    assert code == 0, err
    rows = [json.loads(line) for line in (tmp_path / "pred.jsonl").read_text().splitlines()]
    probs = mean_pooled_hf_probabilities(out, [text for text, _ in dev])
    for row, p in zip(rows, probs, strict=True):
        assert row["probabilities"]["pos"] == pytest.approx(p[1].item(), abs=1e-5)
    code, stdout, err = run(
        capsys, "evaluate", "--model", out, "--data", DATA / "sentiment_dev.tsv"
    )
    assert code == 0 and set(json.loads(stdout)) == {"accuracy", "f1", "mcc"}, err
    # Fine-tuning it again keeps the pooling its head was trained with.
    code, _, err = run(capsys, *finetune_args(out, train, tmp_path / "again", "--text-column",
                                              "sentence"))  # fmt: skip
    assert code == 0, err
    assert "pooling mean (the fine-tuned checkpoint's)" in err.splitlines()
    args = finetune_args(tiny_dir, DATA / "ner.conll", tmp_path / "ner", "--pooling", "mean")
    args[2] = "ner"
    assert_one_error(run(capsys, *args), "--pooling applies to classify and regress")
