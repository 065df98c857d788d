"""DistilBERT distillation: student initialisation, the loss terms, training, resume, CLI errors."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_resume_after_two_sigkills_is_bit_identical, assert_same_run
from safetensors.torch import load_file

from attnlab.cli import main
from attnlab.config import BertConfig
from attnlab.errors import AttnlabError
from attnlab.interop.hf import load_bert, save_bert
from attnlab.models.bert import BertForPreTraining
from attnlab.tasks.distill import (
    DistillationModel,
    cosine_loss,
    distillation_evaluation,
    soft_target_loss,
    student_from_teacher,
)
from attnlab.tasks.pretrain import bundled_corpus
from attnlab.text.tokenizer import train_wordpiece
from attnlab.train.optim import build_optimizer

SMALL = ["--batch-size", "8", "--seq-len", "32", "--log-every", "5"]


def _teacher(vocab_size: int = 500, d_model: int = 64, init: float = 0.02) -> BertForPreTraining:
    config = BertConfig(
        vocab_size=vocab_size,
        d_model=d_model,
        n_layers=4,
        n_heads=2,
        d_ff=4 * d_model,
        max_positions=64,
        initializer_range=init,
    )
    torch.manual_seed(0)
    return BertForPreTraining(config, sentence_head=False).eval()


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> Path:
    """A random 4-layer, 64-wide teacher with a 500-token vocabulary of the bundled corpus.

    initializer_range 0.3 (not 0.02) makes its MLM distributions peaked and input-dependent,
    so there is something to imitate: a 0.02 random BERT predicts near-uniform noise.
    """
    folder = tmp_path_factory.mktemp("teacher") / "teacher"
    tokenizer = train_wordpiece([bundled_corpus()], 500)
    save_bert(_teacher(tokenizer.vocab_size, init=0.3), folder, tokenizer)
    return folder


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One tokenized-corpus cache for every run of this file."""
    return tmp_path_factory.mktemp("cache")


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------- the student


def test_student_takes_every_other_teacher_layer_as_a_copy():
    teacher = _teacher()
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    student = student_from_teacher(teacher, n_layers=2)
    assert student.config.n_layers == 2 and student.nsp is None and student.bert.pooler is None
    assert student.config.replace(n_layers=4) == teacher.config
    for i, layer in enumerate(student.bert.encoder.layers):
        source = teacher.bert.encoder.layers[2 * i].state_dict()
        for name, tensor in layer.state_dict().items():
            assert torch.equal(tensor, source[name]), (i, name)
    for name, tensor in student.bert.embeddings.state_dict().items():
        assert torch.equal(tensor, teacher.bert.embeddings.state_dict()[name]), name
    for name, tensor in student.mlm.state_dict().items():
        assert torch.equal(tensor, teacher.mlm.state_dict()[name]), name
    # copies, not shared tensors: changing the student leaves the teacher as it was
    with torch.no_grad():
        for param in student.parameters():
            param.add_(1.0)
    for name, tensor in teacher.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    # the MLM head stays tied to the student's own word embeddings
    assert student.mlm.word_embeddings is student.bert.embeddings.word_embeddings


def test_student_from_a_preset():
    narrow = _teacher(d_model=64)
    student = student_from_teacher(narrow, preset="bert-tiny")  # 128 wide: only the vocab bias
    assert torch.equal(student.mlm.bias, narrow.mlm.bias)
    assert (student.config.n_layers, student.config.d_model) == (2, 128)
    assert student.config.vocab_size == narrow.config.vocab_size
    assert student.config.max_positions == narrow.config.max_positions
    wide = _teacher(d_model=128)
    student = student_from_teacher(wide, preset="bert-tiny")  # same width: embeddings + head
    for name, tensor in student.bert.embeddings.state_dict().items():
        assert torch.equal(tensor, wide.bert.embeddings.state_dict()[name]), name
    assert torch.equal(student.mlm.dense.weight, wide.mlm.dense.weight)
    assert student.mlm.dense.weight.data_ptr() != wide.mlm.dense.weight.data_ptr()


def test_student_from_a_preset_keeps_the_teachers_position_settings():
    # A preset gives sizes; how positions are encoded is the teacher's (bucket count, distance,
    # RoPE base), and a table whose head count differs is left fresh without blocking the rest.
    def teacher(**positions) -> BertForPreTraining:
        config = BertConfig(
            vocab_size=300,
            d_model=128,
            n_layers=2,
            n_heads=4,
            d_ff=256,
            max_positions=64,
            **positions,
        )
        return BertForPreTraining(config, sentence_head=False)

    relative = dict(
        position_encoding="relative_bias", relative_buckets=16, relative_max_distance=40
    )
    source = teacher(**relative)
    student = student_from_teacher(source, preset="bert-tiny")  # 128 wide, 2 heads
    config = student.config
    assert (config.relative_buckets, config.relative_max_distance, config.n_heads) == (16, 40, 2)
    table = "positions.bias.weight"  # (buckets, heads): 4 heads in the teacher, 2 here
    assert student.bert.embeddings.state_dict()[table].shape == (16, 2)
    for name, tensor in student.bert.embeddings.state_dict().items():
        if name != table:
            assert torch.equal(tensor, source.bert.embeddings.state_dict()[name]), name
    assert torch.equal(student.mlm.dense.weight, source.mlm.dense.weight)
    rope = student_from_teacher(
        teacher(position_encoding="rope", rope_base=500.0), preset="bert-tiny"
    )
    assert rope.config.rope_base == 500.0


@pytest.mark.parametrize(
    ("n_layers", "preset"), [(4, None), (0, None), (None, None), (2, "bert-tiny")]
)
def test_student_errors(n_layers, preset):
    with pytest.raises(AttnlabError):
        student_from_teacher(_teacher(), n_layers=n_layers, preset=preset)


# ---------------------------------------------------------------------------- the loss


def test_soft_target_loss_is_a_temperature_scaled_kl():
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(6, 50, generator=g), 3 * torch.randn(6, 50, generator=g)
    assert float(soft_target_loss(teacher, teacher, 2.0)) == pytest.approx(0.0, abs=1e-6)
    for temperature in (1.0, 2.0, 4.0):
        p = torch.softmax(teacher / temperature, -1)
        q = torch.softmax(student / temperature, -1)
        kl = (p * (p.log() - q.log())).sum(-1).mean()
        got = soft_target_loss(student, teacher, temperature)
        assert float(got) == pytest.approx(temperature**2 * float(kl), rel=1e-5)
    # a normalizer replaces the row count: the sum over rows divided by it
    mean = soft_target_loss(student, teacher, 2.0)
    assert float(soft_target_loss(student, teacher, 2.0, torch.tensor(12.0))) == pytest.approx(
        float(mean) / 2, rel=1e-6
    )
    # a temperature whose square overflows diverges, as one past float32's range does; it was
    # an OverflowError traceback (distill --temperature 1e308)
    assert not torch.isfinite(soft_target_loss(student, teacher, 1e308))


def test_cosine_loss():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 16, generator=g)
    assert float(cosine_loss(hidden, hidden)) == pytest.approx(0.0, abs=1e-6)
    assert float(cosine_loss(3 * hidden, hidden)) == pytest.approx(0.0, abs=1e-6)
    assert float(cosine_loss(-hidden, hidden)) == pytest.approx(2.0, abs=1e-6)
    assert float(cosine_loss(hidden[:0], hidden[:0])) == 0.0


def _batch(vocab_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, vocab_size, (3, 12), generator=g)
    labels = torch.full_like(ids, -100)
    labels[:, 2:5] = ids[:, 2:5]
    ids[:, 2:5] = 4
    mask = torch.ones_like(ids)
    mask[0, 9:] = 0
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "token_type_ids": torch.zeros_like(ids),
        "mlm_labels": labels,
    }


def test_identical_student_has_only_the_mlm_term():
    teacher = _teacher()
    model = DistillationModel(teacher, copy.deepcopy(teacher)).eval()  # eval: no dropout
    with torch.no_grad():
        out = model(**_batch(teacher.config.vocab_size))
    assert float(out["distill_loss"]) == pytest.approx(0.0, abs=1e-5)
    assert float(out["cosine_loss"]) == pytest.approx(0.0, abs=1e-5)
    assert float(out["loss"]) == pytest.approx(2.0 * float(out["mlm_loss"]), rel=1e-5)
    assert out["mlm_logits"].shape == (9, teacher.config.vocab_size)


def test_loss_is_distilberts_weighted_sum_at_temperature_two():
    # L = 5 T^2 KL(teacher || student at T) + 2 L_mlm + 1 (1 - cos), T = 2: DistilBERT's weights,
    # the defaults of the model and of the CLI; each term checked against its own formula.
    from attnlab.tasks.distill import DistillOptions

    opts = DistillOptions(teacher=Path("t"), out=Path("o"))
    assert (opts.temperature, opts.alpha_ce, opts.alpha_mlm, opts.alpha_cos) == (
        2.0,
        5.0,
        2.0,
        None,
    )
    teacher = _teacher(init=0.3)  # peaked distributions (teacher_dir's docstring)
    model = DistillationModel(teacher, student_from_teacher(teacher, n_layers=2)).eval()
    batch = _batch(teacher.config.vocab_size)
    with torch.no_grad():
        out = model(**batch)
        student_hidden = model.student.bert(batch["input_ids"], batch["attention_mask"])
        teacher_hidden = teacher.bert(batch["input_ids"], batch["attention_mask"])
    p = torch.softmax(out["teacher_mlm_logits"] / 2, -1)
    q = torch.softmax(out["mlm_logits"] / 2, -1)
    kl = 4 * (p * (p.log() - q.log())).sum(-1).mean()
    masked = batch["mlm_labels"] != -100
    mlm = F.cross_entropy(out["mlm_logits"], batch["mlm_labels"][masked])
    real = batch["attention_mask"].bool()
    cos = 1 - F.cosine_similarity(
        student_hidden.last_hidden_state[real], teacher_hidden.last_hidden_state[real], dim=-1
    )
    terms = {"distill_loss": kl, "mlm_loss": mlm, "cosine_loss": cos.mean()}
    for name, expected in terms.items():
        assert float(expected) > 1e-3, name  # every term is in play
        assert float(out[name]) == pytest.approx(float(expected), rel=1e-4), name
    assert float(out["loss"]) == pytest.approx(float(5 * kl + 2 * mlm + cos.mean()), rel=1e-4)


def test_only_the_student_is_trained():
    teacher = _teacher()
    snapshot = {k: v.clone() for k, v in teacher.state_dict().items()}
    model = DistillationModel(teacher, student_from_teacher(teacher, n_layers=2))
    assert all(k.startswith("student.") for k in model.state_dict())  # checkpoints: student only
    assert {id(p) for p in model.parameters()} == {id(p) for p in model.student.parameters()}
    optimizer = build_optimizer(model, lr=1e-2)
    model.train()
    assert not teacher.training and model.student.training
    before = model.student.mlm.dense.weight.clone()
    for _ in range(2):
        model(**_batch(teacher.config.vocab_size))["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    assert not torch.equal(model.student.mlm.dense.weight, before)
    for name, tensor in teacher.state_dict().items():
        assert torch.equal(tensor, snapshot[name]), name
    assert all(p.grad is None for p in teacher.parameters())
    model.to(torch.float64)  # to() moves the teacher although it is not a submodule
    assert teacher.mlm.dense.weight.dtype == torch.float64


def test_held_out_agreement_and_kl_with_the_teacher():
    teacher = _teacher(init=0.3)
    batch = _batch(teacher.config.vocab_size)

    def evaluate(model):  # pretraining's evaluation, reduced to one fixed batch
        with torch.no_grad():
            model(**batch)
        return {"eval_mlm_accuracy": 0.0}

    twin = DistillationModel(teacher, copy.deepcopy(teacher)).eval()
    same = distillation_evaluation(evaluate)(twin)
    assert same["eval_fill_mask_agreement"] == 1.0
    assert same["eval_teacher_kl"] == pytest.approx(0.0, abs=1e-6)
    assert same["eval_mlm_accuracy"] == 0.0  # pretraining's scores are kept

    model = DistillationModel(teacher, student_from_teacher(teacher, n_layers=2)).eval()
    metrics = distillation_evaluation(evaluate)(model)
    with torch.no_grad():
        out = model(**batch)
    p = torch.softmax(out["teacher_mlm_logits"].double(), -1)
    q = torch.softmax(out["mlm_logits"].double(), -1)
    kl = (p * (p.log() - q.log())).sum(-1)  # one per masked position
    assert metrics["eval_teacher_kl"] == pytest.approx(float(kl.mean()), rel=1e-4)
    assert metrics["eval_teacher_kl"] > 0.01
    agree = out["mlm_logits"].argmax(-1) == out["teacher_mlm_logits"].argmax(-1)
    assert metrics["eval_fill_mask_agreement"] == pytest.approx(float(agree.double().mean()))


def test_cosine_needs_equal_widths():
    teacher = _teacher()
    student = student_from_teacher(teacher, preset="bert-tiny")
    with pytest.raises(AttnlabError, match="alpha_cos needs equal widths"):
        DistillationModel(teacher, student)
    out = DistillationModel(teacher, student, alpha_cos=0.0)(**_batch(teacher.config.vocab_size))
    assert "cosine_loss" not in out and out["loss"].ndim == 0


# ---------------------------------------------------------------------------- training


def test_distill_learns_and_writes_an_hf_checkpoint(teacher_dir, cache, tmp_path, capsys):
    from transformers import BertForMaskedLM

    teacher_files = {p.name: p.read_bytes() for p in teacher_dir.iterdir()}
    out = tmp_path / "student"
    args = ["distill", "--teacher", str(teacher_dir), "--student-layers", "2", "--out", str(out)]
    # 60 steps at lr 1e-3: agreement 0.19-0.35 over 12 seeds and both vocabularies the trainer
    # still draws (30 steps at 5e-4 gave 0.12-0.49, and 0.12 failed CI's old "> 0.2")
    args += [*SMALL, "--steps", "60", "--lr", "1e-3", "--eval-every", "20", "--save-every", "30"]
    assert main([*args, "--cache-dir", str(cache)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["step"] == 60 and summary["student_layers"] == 2
    assert summary["student_parameters"] < summary["teacher_parameters"]
    rows = [r for r in _rows(out) if not r.get("eval")]
    assert {"distill_loss", "mlm_loss", "cosine_loss"} <= set(rows[0])
    assert rows[-1]["distill_loss"] < 0.8 * rows[0]["distill_loss"]  # it imitates the teacher
    evals = [r for r in _rows(out) if r.get("eval")]
    assert [r["step"] for r in evals] == [0, 20, 40, 60]  # 0: the student as initialised
    assert summary["agreement_before"] == evals[0]["eval_fill_mask_agreement"]
    agreement = evals[-1]["eval_fill_mask_agreement"]
    assert summary["agreement"] == agreement
    assert agreement > summary["agreement_before"] + 0.1  # the fresh student agrees ~0%
    assert summary["teacher_kl"] == evals[-1]["eval_teacher_kl"]
    assert summary["teacher_kl"] < summary["teacher_kl_before"]  # closer to the teacher
    assert {"eval_mlm_accuracy", "eval_mlm_loss"} <= set(evals[-1])
    # the checkpoints hold the student alone; the teacher's directory is untouched
    assert all(
        k.startswith("student.") for k in load_file(out / "checkpoints/step-60/model.safetensors")
    )
    assert {p.name: p.read_bytes() for p in teacher_dir.iterdir()} == teacher_files
    # the result loads in attnlab and in HF transformers, with the same predictions
    ours = load_bert(out, heads=True)
    assert ours.config.n_layers == 2 and ours.nsp is None
    hf, info = BertForMaskedLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = torch.tensor([[2, 10, 4, 11, 3]])
    with torch.no_grad():
        expected = hf.eval()(input_ids=ids).logits
        assert torch.allclose(ours(ids)["mlm_logits"], expected, atol=1e-4)


def test_resume(teacher_dir, cache, tmp_path, capsys):
    """Resuming from a checkpoint ends bit-identical to a run never stopped; more steps resume too."""
    base = ["distill", "--teacher", str(teacher_dir), "--student-preset", "bert-tiny", *SMALL]
    base += ["--alpha-cos", "0", "--save-every", "3", "--keep-last", "0"]

    def run(out: Path, steps: int, *extra: str) -> int:
        return main(
            [*base, "--steps", str(steps), "--out", str(out), "--cache-dir", str(cache), *extra]
        )

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    capsys.readouterr()
    assert run(straight, 8) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0 <= first["agreement_before"] <= 1
    # A run stopped after its step-3 checkpoint: step-3 is the newest, no final model yet.
    shutil.copytree(straight, resumed)
    for name in ("checkpoints/step-6", "checkpoints/step-8"):
        shutil.rmtree(resumed / name)
    (resumed / "model.safetensors").unlink()
    assert run(resumed, 8) == 2  # it holds a run: refused without --resume
    assert run(resumed, 8, "--resume") == 0
    assert_same_run(straight, resumed)
    # a finished run continues to more steps
    capsys.readouterr()
    assert run(resumed, 10, "--resume") == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # the student as initialised was scored at step 0; that row outlives the resumes
    assert summary["step"] == 10 and summary["agreement_before"] == first["agreement_before"]
    assert summary["teacher_kl_before"] == first["teacher_kl_before"] is not None
    assert [r["step"] for r in _rows(resumed) if not r.get("eval")] == [5, 8, 10]


def test_resume_after_two_sigkills_is_bit_identical(teacher_dir, cache, tmp_path):
    # Two micro-batches a step, held-out scores against the teacher before training and after.
    def command(out: Path) -> list[object]:
        return ["distill", "--teacher", teacher_dir, "--student-layers", 2, *SMALL,
                "--grad-accum", 2, "--steps", 10, "--save-every", 3, "--eval-every", 4,
                "--keep-last", 2, "--threads", 1, "--no-progress", "--cache-dir", cache,
                "--out", out]  # fmt: skip

    assert_resume_after_two_sigkills_is_bit_identical(command, tmp_path, 6, 8)  # 2: step 7
    assert [r["step"] for r in _rows(tmp_path / "killed") if r.get("eval")] == [0, 4, 8, 10]


# ---------------------------------------------------------------------------- CLI errors


@pytest.mark.parametrize(
    ("student", "message"),
    [
        (["--student-layers", "2", "--student-preset", "bert-tiny"], "exactly one"),
        ([], "exactly one"),
        (["--student-layers", "4"], "between 1 and 3"),
        (["--student-layers", "2", "--teacher", "MISSING"], "does not exist"),
        (["--student-layers", "2", "--max-predictions", "0"], "--max-predictions must be at"),
    ],
)
def test_cli_errors_write_nothing(teacher_dir, tmp_path, capsys, student, message):
    out = tmp_path / "out"
    args = ["distill", "--teacher", str(teacher_dir), "--out", str(out), *SMALL, *student]
    args = [str(tmp_path / "missing") if a == "MISSING" else a for a in args]
    assert main([*args, "--cache-dir", str(tmp_path / "cache")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("attnlab: error:") and message in err[0]
    assert not out.exists() and not (tmp_path / "cache").exists()


def test_max_predictions_reaches_the_masking(teacher_dir, tmp_path):
    # the cap of pretraining's --max-predictions, on the distillation data too
    from attnlab.tasks.distill import DistillOptions
    from attnlab.tasks.pretrain import prepare_data
    from attnlab.text.tokenizer import BertTokenizer

    opts = DistillOptions(teacher=teacher_dir, out=tmp_path / "out", student_layers=2,
                          batch_size=8, seq_len=64, max_predictions=2,
                          cache_dir=tmp_path / "cache", progress=False)  # fmt: skip
    opts.validate()
    corpus = [bundled_corpus()]
    batch = next(
        iter(prepare_data(opts.pretraining(), corpus, BertTokenizer.from_dir(teacher_dir)).batches)
    )
    assert (batch["mlm_labels"] != -100).sum(dim=1).max() == 2


def test_teacher_without_an_mlm_head_is_refused(minilm_dir, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["distill", "--teacher", str(minilm_dir), "--student-layers", "3", "--out", str(out)]
    assert main([*args, *SMALL]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no masked-LM head" in err[0] and not out.exists()


def test_cli_config_file(teacher_dir, tmp_path, capsys):
    config = tmp_path / "distill.toml"
    config.write_text(f'teacher = "{teacher_dir}"\nstudent_layers = 2\ntemprature = 3.0\n')
    out = tmp_path / "out"
    assert main(["distill", "--config", str(config), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown option(s) temprature" in err[0] and not out.exists()


def test_grad_accum_of_half_batches_equals_one_full_batch(teacher_dir, cache, tmp_path, capsys):
    # A dropout-free teacher (so the student has none either): two half batches per step give
    # the weights of one full batch, as in pretraining (the cosine term, a mean per
    # micro-batch, is left out); --static-masking is taken too.
    config = json.loads((teacher_dir / "config.json").read_text())
    teacher = tmp_path / "teacher"
    shutil.copytree(teacher_dir, teacher)
    config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (teacher / "config.json").write_text(json.dumps(config))
    common = ["distill", "--teacher", str(teacher), "--student-layers", "2", "--alpha-cos", "0"]
    common += [*SMALL, "--steps", "3", "--save-every", "0", "--cache-dir", str(cache)]
    common += ["--static-masking", "--eval-every", "0"]
    assert main([*common, "--out", str(tmp_path / "whole")]) == 0
    assert main([*common, "--out", str(tmp_path / "halves"), "--grad-accum", "2"]) == 0
    capsys.readouterr()
    whole = load_file(tmp_path / "whole" / "model.safetensors")
    halves = load_file(tmp_path / "halves" / "model.safetensors")
    assert whole.keys() == halves.keys()
    for name, weight in whole.items():
        torch.testing.assert_close(halves[name], weight, rtol=1e-4, atol=1e-5, msg=name)
    # and the option reaches the data and the trainer (ignored, the two runs would agree too)
    from attnlab.tasks.distill import DistillOptions
    from attnlab.tasks.pretrain import trainer_config

    opts = DistillOptions(teacher=teacher, out=tmp_path / "x", grad_accum=2, static_masking=True)
    assert opts.pretraining().grad_accum == 2 and opts.pretraining().static_masking
    assert trainer_config(opts, warmup_divisor=20).grad_accum == 2
    name = "bert.embeddings.word_embeddings.weight"  # copied from the teacher, then trained
    assert not torch.allclose(whole[name], load_file(teacher / "model.safetensors")[name])
