"""Task heads against HF transformers' BertFor* classes on the real MiniLM checkpoint.

Same checkpoint, same (random) head weights -> same logits and loss within 1e-5, in all three
directions: attnlab with HF's head copied in, an HF-saved fine-tuned checkpoint loaded by
attnlab, and an attnlab-saved one loaded by HF's from_pretrained.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import VARIED_SENTENCES
from safetensors.torch import load_file

from attnlab.errors import AttnlabError
from attnlab.interop.hf import (
    checkpoint_labels,
    checkpoint_task,
    load_bert,
    load_task_model,
    save_bert,
    save_task_model,
)
from attnlab.models.heads import (
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
)

TOL = 1e-5
# task -> (HF class name, from_pretrained kwargs, head attribute)
HF_HEADS = {
    "classify": ("BertForSequenceClassification", {"num_labels": 3}, "classifier"),
    "regress": (
        "BertForSequenceClassification",
        {"num_labels": 1, "problem_type": "regression"},
        "classifier",
    ),
    "ner": ("BertForTokenClassification", {"num_labels": 5}, "classifier"),
    "qa": ("BertForQuestionAnswering", {}, "qa_outputs"),
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def batch(hf_tokenizer) -> dict[str, torch.Tensor]:
    """Mixed-length sentence pairs, padded: padding and segment ids both matter."""
    firsts = VARIED_SENTENCES[:4]
    seconds = VARIED_SENTENCES[4:8]
    enc = hf_tokenizer(firsts, seconds, padding=True, return_tensors="pt")
    return {k: enc[k] for k in ("input_ids", "attention_mask", "token_type_ids")}


def hf_model(minilm_dir: Path, task: str, seed: int = 0):
    """HF's task model on MiniLM with a random head (seeded), in eval mode."""
    import transformers

    name, kwargs, _ = HF_HEADS[task]
    torch.manual_seed(seed)
    return getattr(transformers, name).from_pretrained(str(minilm_dir), **kwargs).eval()


def labels_for(task: str, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Label tensors for the batch; token labels include -100 and QA positions past the end."""
    g = torch.Generator().manual_seed(1)
    n, seq = batch["input_ids"].shape
    if task == "classify":
        return {"labels": torch.randint(0, 3, (n,), generator=g)}
    if task == "regress":
        return {"labels": torch.rand(n, generator=g) * 5}
    if task == "ner":
        labels = torch.randint(0, 5, (n, seq), generator=g)
        labels[batch["attention_mask"] == 0] = -100
        labels[:, 0] = -100
        return {"labels": labels}
    return {
        "start_positions": torch.tensor([1, 3, seq + 4, 2]),  # seq + 4: clamped and ignored
        "end_positions": torch.tensor([2, 5, seq + 4, 2]),
    }


def outputs(out, task: str) -> list[torch.Tensor]:
    keys = ("start_logits", "end_logits") if task == "qa" else ("logits",)
    get = out.__getitem__ if isinstance(out, dict) else lambda k: getattr(out, k)
    return [get(k) for k in keys]


def assert_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < TOL


@pytest.mark.parametrize("task", list(HF_HEADS))
def test_same_logits_and_loss_as_hf_with_the_same_head(task, minilm_dir, batch):
    reference = hf_model(minilm_dir, task)
    n_labels = HF_HEADS[task][1].get("num_labels")
    ours, fresh = load_task_model(minilm_dir, task, num_labels=n_labels)
    # MiniLM is a plain encoder with a pooler: only the head is new.
    assert fresh == [HF_HEADS[task][2]]
    getattr(ours, HF_HEADS[task][2]).load_state_dict(
        getattr(reference, HF_HEADS[task][2]).state_dict()
    )
    labels = labels_for(task, batch)
    with torch.no_grad():
        mine = ours(**batch, **labels)
        theirs = reference(**batch, **labels)
    for a, b in zip(outputs(mine, task), outputs(theirs, task), strict=True):
        assert_close(a, b)
    assert abs(mine["loss"].item() - theirs.loss.item()) < TOL
    # Without labels there is no loss, only logits.
    assert "loss" not in ours(**batch)


def test_a_bin_checkpoint_is_read_once(minilm_dir, tmp_path):
    # An encoder's weights are looked over for a trained head config.json does not name;
    # that look read a .bin a second time (a safetensors file gives its names from its header).
    from attnlab.interop import hf

    folder = tmp_path / "encoder"
    shutil.copytree(minilm_dir, folder)
    weights = folder / "model.safetensors"
    torch.save(load_file(str(weights)), folder / "pytorch_model.bin")
    weights.unlink()
    reads = []
    reading = hf.read_weights
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hf, "read_weights", lambda path: reads.append(path) or reading(path))
        _, fresh = load_task_model(folder, "classify", num_labels=2)
    assert fresh == ["classifier"] and len(reads) == 1


@pytest.mark.parametrize("task", list(HF_HEADS))
def test_hf_saved_checkpoint_loads_whole(task, minilm_dir, batch, tmp_path):
    reference = hf_model(minilm_dir, task, seed=3)
    reference.save_pretrained(str(tmp_path))
    assert checkpoint_task(tmp_path) == task
    ours, fresh = load_task_model(tmp_path, task)
    assert fresh == []  # head and encoder all come from the checkpoint
    with torch.no_grad():
        for a, b in zip(
            outputs(ours(**batch), task), outputs(reference(**batch), task), strict=True
        ):
            assert_close(a, b)


@pytest.mark.parametrize("task", list(HF_HEADS))
def test_export_loads_in_hf(task, minilm_dir, batch, tmp_path, hf_tokenizer):
    import transformers

    from attnlab.text.tokenizer import BertTokenizer

    n_labels = {"classify": 3, "ner": 5}.get(task)
    torch.manual_seed(5)
    ours, _ = load_task_model(minilm_dir, task, num_labels=n_labels)
    names = {"classify": ["neg", "neu", "pos"], "ner": ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]}
    save_task_model(ours, tmp_path / "out", BertTokenizer.from_dir(minilm_dir), names.get(task))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == [HF_HEADS[task][0]]
    auto = {
        "classify": transformers.AutoModelForSequenceClassification,
        "regress": transformers.AutoModelForSequenceClassification,
        "ner": transformers.AutoModelForTokenClassification,
        "qa": transformers.AutoModelForQuestionAnswering,
    }[task]
    theirs = auto.from_pretrained(str(tmp_path / "out")).eval()
    assert type(theirs).__name__ == HF_HEADS[task][0]
    if task in names:
        assert [theirs.config.id2label[i] for i in range(len(names[task]))] == names[task]
        assert checkpoint_labels(tmp_path / "out") == names[task]
    if task == "regress":
        assert theirs.config.problem_type == "regression" and theirs.config.num_labels == 1
    with torch.no_grad():
        for a, b in zip(outputs(ours(**batch), task), outputs(theirs(**batch), task), strict=True):
            assert_close(a, b)


@pytest.mark.parametrize("task", list(HF_HEADS))
def test_gradients_match_hf(task, minilm_dir, batch):
    """One backward pass: the same gradient on the head and deep in the encoder."""
    reference = hf_model(minilm_dir, task)
    head = HF_HEADS[task][2]
    ours, _ = load_task_model(minilm_dir, task, num_labels=HF_HEADS[task][1].get("num_labels"))
    getattr(ours, head).load_state_dict(getattr(reference, head).state_dict())
    labels = labels_for(task, batch)
    ours(**batch, **labels)["loss"].backward()
    reference(**batch, **labels).loss.backward()
    assert_close(getattr(ours, head).weight.grad, getattr(reference, head).weight.grad)
    mine = ours.bert.embeddings.word_embeddings.weight.grad
    theirs = reference.bert.embeddings.word_embeddings.weight.grad
    assert (mine - theirs).abs().max().item() < 1e-4


def test_head_shapes_and_regression_loss():
    from attnlab.config import BertConfig

    config = BertConfig(vocab_size=50, d_model=16, n_layers=1, n_heads=2, d_ff=32)
    ids = torch.randint(5, 50, (3, 7))
    reg = BertForSequenceClassification(config, 4, problem_type="regression").eval()
    out = reg(ids, labels=torch.tensor([0.5, 1.0, 2.0]))
    assert out["logits"].shape == (3, 1)  # regression: one output whatever num_labels said
    expected = ((out["logits"].squeeze(-1) - torch.tensor([0.5, 1.0, 2.0])) ** 2).mean()
    assert torch.allclose(out["loss"], expected)
    tok = BertForTokenClassification(config, 4).eval()
    labels = torch.full((3, 7), -100)
    labels[0, 1] = 2
    out = tok(ids, labels=labels)
    assert out["logits"].shape == (3, 7, 4)
    expected = torch.nn.functional.cross_entropy(out["logits"][0, 1:2], torch.tensor([2]))
    assert torch.allclose(out["loss"], expected)  # only the one labelled token counts
    assert tok.bert.pooler is None
    qa = BertForQuestionAnswering(config).eval()
    out = qa(ids)
    assert out["start_logits"].shape == out["end_logits"].shape == (3, 7)


def test_qa_loss_on_answer_shares_is_the_mean_of_one_answer_losses():
    # Training on every annotator's answer at once must equal training on each in turn:
    # the loss with target shares is the mean of the HF-style position losses.
    from attnlab.config import BertConfig

    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, d_model=16, n_layers=1, n_heads=2, d_ff=32)
    qa = BertForQuestionAnswering(config).eval()
    ids = torch.randint(5, 50, (2, 9))
    answers = [[(1, 2), (1, 2), (3, 6)], [(0, 0), (4, 4), (5, 7)]]  # per row, 3 annotators
    starts, ends = torch.zeros(2, 9), torch.zeros(2, 9)
    for row, spans in enumerate(answers):
        for start, end in spans:
            starts[row, start] += 1 / 3
            ends[row, end] += 1 / 3
    with torch.no_grad():
        shared = qa(ids, start_positions=starts, end_positions=ends)["loss"]
        each = [
            qa(
                ids,
                start_positions=torch.tensor([answers[0][k][0], answers[1][k][0]]),
                end_positions=torch.tensor([answers[0][k][1], answers[1][k][1]]),
            )["loss"]
            for k in range(3)
        ]
    assert torch.allclose(shared, torch.stack(each).mean(), atol=1e-6)
    assert not torch.allclose(each[0], each[2])  # the annotators really differ


def test_wrong_head_and_label_count_are_errors(minilm_dir, tmp_path):
    torch.manual_seed(0)
    ner, _ = load_task_model(minilm_dir, "ner", num_labels=3)
    save_task_model(ner, tmp_path / "ner", id2label=["O", "B-X", "I-X"])
    with pytest.raises(AttnlabError, match=r"BertForTokenClassification.*does not fit task 'qa'"):
        load_task_model(tmp_path / "ner", "qa")
    with pytest.raises(AttnlabError, match="3 outputs, this task needs 5"):
        load_task_model(tmp_path / "ner", "ner", num_labels=5)
    # --new-head semantics: keep the encoder, replace the head.
    model, fresh = load_task_model(tmp_path / "ner", "qa", new_head=True)
    assert fresh == ["qa_outputs"]
    assert torch.equal(
        model.bert.encoder.layers[0].ffn.fc1.weight, ner.bert.encoder.layers[0].ffn.fc1.weight
    )
    # A token-classification checkpoint has no pooler: a new classifier gets a fresh one.
    model, fresh = load_task_model(tmp_path / "ner", "classify", num_labels=2, new_head=True)
    assert fresh == ["pooler", "classifier"]
    with pytest.raises(AttnlabError, match="no classify head"):
        load_task_model(minilm_dir, "classify")
    assert checkpoint_task(minilm_dir) is None


def test_pretraining_checkpoint_gives_encoder_weights(tmp_path):
    """A BertForPreTraining checkpoint (MLM + NSP heads) loads as an encoder + new head."""
    from attnlab.config import BertConfig
    from attnlab.models.bert import BertForPreTraining

    torch.manual_seed(0)
    config = BertConfig(vocab_size=40, d_model=16, n_layers=2, n_heads=2, d_ff=32)
    save_bert(BertForPreTraining(config), tmp_path / "pre")
    model, fresh = load_task_model(tmp_path / "pre", "classify", num_labels=2)
    assert fresh == ["classifier"]
    encoder = load_bert(tmp_path / "pre")
    assert torch.equal(model.bert.pooler.dense.weight, encoder.pooler.dense.weight)


# ---------------------------------------------------------------------------- mean pooling


@pytest.mark.parametrize("task", ["classify", "regress"])
def test_mean_pooling_is_hfs_masked_mean_then_the_classifier(task, minilm_dir, batch, hf_minilm):
    """pooling="mean": HF BertModel's last_hidden_state averaged over real tokens, by hand."""
    n_labels = HF_HEADS[task][1]["num_labels"]
    torch.manual_seed(0)
    ours, fresh = load_task_model(minilm_dir, task, num_labels=n_labels, pooling="mean")
    assert fresh == ["classifier"] and ours.pooling == "mean" and ours.bert.pooler is None
    ours.eval()
    with torch.no_grad():
        hidden = hf_minilm(**batch).last_hidden_state  # (batch, seq, 384)
        mask = batch["attention_mask"].unsqueeze(-1).float()
        pooled = (hidden * mask).sum(1) / mask.sum(1)
        weight, bias = ours.classifier.weight, ours.classifier.bias
        expected = pooled @ weight.T + bias  # (batch, num_labels)
        labels = labels_for(task, batch)
        got = ours(**batch, **labels)
    assert got["logits"].shape == (batch["input_ids"].shape[0], n_labels)
    assert_close(got["logits"], expected)
    if task == "regress":
        loss = torch.nn.functional.mse_loss(expected.squeeze(-1), labels["labels"])
    else:
        loss = torch.nn.functional.cross_entropy(expected, labels["labels"])
    assert abs(got["loss"].item() - loss.item()) < TOL


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_padding_does_not_change_a_rows_logits(pooling, minilm_dir, batch):
    torch.manual_seed(0)
    model, _ = load_task_model(minilm_dir, "classify", num_labels=3, pooling=pooling)
    mask = batch["attention_mask"]
    row = int(mask.sum(1).argmin())  # the shortest pair: the most padding in the batch
    n = int(mask[row].sum())
    assert n < mask.shape[1]
    with torch.no_grad():
        padded = model(**batch)["logits"][row]
        alone = model(**{k: v[row : row + 1, :n] for k, v in batch.items()})["logits"][0]
    assert_close(padded, alone)


def test_mean_pooling_is_saved_loaded_and_refused_by_export(minilm_dir, batch, tmp_path, capsys):
    import transformers

    from attnlab.cli import main
    from attnlab.text.tokenizer import BertTokenizer

    torch.manual_seed(0)
    ours, _ = load_task_model(minilm_dir, "classify", num_labels=3, pooling="mean")
    out = tmp_path / "mean"
    save_task_model(ours, out, BertTokenizer.from_dir(minilm_dir), ["a", "b", "c"])
    config = json.loads((out / "config.json").read_text())
    assert config["attnlab"]["pooling"] == "mean"
    assert not any(k.startswith("bert.pooler") for k in load_file(out / "model.safetensors"))
    again, fresh = load_task_model(out, "classify")
    assert (again.pooling, fresh) == ("mean", [])
    with torch.no_grad():
        assert torch.equal(again(**batch)["logits"], ours.eval()(**batch)["logits"])
    # HF would run it with a [CLS] pooler: its Auto classes refuse the folder instead.
    with pytest.raises((ValueError, KeyError)):
        transformers.AutoModelForSequenceClassification.from_pretrained(str(out))
    code = main(["export", "--model", str(out), "--out", str(tmp_path / "hf")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and not (tmp_path / "hf").exists()
    assert err[0].startswith("attnlab: error: cannot export to HF format") and "mean" in err[0]
    # A folder saved before pooling was (no "pooling" key): the [CLS] pooler, as HF's.
    cls_model, _ = load_task_model(minilm_dir, "classify", num_labels=3, new_head=True)
    save_task_model(cls_model, tmp_path / "old")
    config = json.loads((tmp_path / "old" / "config.json").read_text())
    assert config["attnlab"].pop("pooling") == "cls" and config["model_type"] == "bert"
    (tmp_path / "old" / "config.json").write_text(json.dumps(config))
    old, fresh = load_task_model(tmp_path / "old", "classify")
    assert (old.pooling, fresh) == ("cls", [])
