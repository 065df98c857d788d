"""attnlab.fast: swapping twins in and out leaves a model's state and outputs as they were, and
ATTNLAB_SPEEDUPS picks the speed-ups by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnlab import fast
from attnlab.config import BertConfig
from attnlab.errors import AttnlabError
from attnlab.fast.dropout import FastDropout
from attnlab.models.bert import BertForPreTraining


def tiny_bert(dropout: float = 0.1) -> BertForPreTraining:
    """A seeded 2-layer BERT over a 90-token vocabulary."""
    torch.manual_seed(0)
    config = BertConfig(vocab_size=90, d_model=32, n_layers=2, n_heads=4, d_ff=64)
    config.dropout = config.attention_dropout = dropout
    return BertForPreTraining(config)


def pretraining_batch() -> dict[str, torch.Tensor]:
    """Two sequences with padding, a few masked labels and sentence labels."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 90, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    labels = torch.full_like(ids, -100)
    labels[0, [2, 5]] = ids[0, [2, 5]]
    labels[1, 3] = ids[1, 3]
    return {"input_ids": ids, "attention_mask": mask, "mlm_labels": labels,
            "nsp_labels": torch.tensor([0, 1])}  # fmt: skip


def classes(model: nn.Module) -> list[type]:
    """The class of every module, in order."""
    return [type(m) for m in model.modules()]


@pytest.mark.parametrize("use", ["training", "inference"])
def test_twins_then_to_plain_leave_state_and_outputs_unchanged(use: str) -> None:
    model = tiny_bert().eval()
    batch = pretraining_batch()
    plain_classes = classes(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        want = model(**batch)
    (fast.for_training if use == "training" else fast.for_inference)(model, "all")
    assert classes(model) != plain_classes  # some twins applied
    assert model.state_dict().keys() == state.keys()
    with torch.no_grad():
        got = model(**batch)
    for name in ("loss", "mlm_logits", "nsp_logits"):
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)
    fast.to_plain(model)
    assert classes(model) == plain_classes
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), name
    with torch.no_grad():
        again = model(**batch)
    torch.testing.assert_close(again["loss"], want["loss"], rtol=0, atol=0)


def test_training_twins_give_the_plain_models_gradients() -> None:
    batch = pretraining_batch()
    grads = []
    for twins in (False, True):
        model = tiny_bert(dropout=0.0)  # the twins draw other dropout masks, by design
        if twins:
            fast.for_training(model, "all")
        model(**batch)["loss"].backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_the_environment_picks_speedups_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    names = lambda use: [s.name for s in fast.chosen(use)]  # noqa: E731
    monkeypatch.setenv("ATTNLAB_SPEEDUPS", "none")
    assert names("training") == []
    monkeypatch.setenv("ATTNLAB_SPEEDUPS", "attention,linear")
    assert names("training") == ["linear", "attention"]  # in the registry's order
    monkeypatch.setenv("ATTNLAB_SPEEDUPS", "-dropout")
    assert "dropout" not in names("training") and "linear" in names("training")
    model = fast.for_training(nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.1)))
    assert type(model[0]) is not nn.Linear and type(model[1]) is nn.Dropout
    monkeypatch.setenv("ATTNLAB_SPEEDUPS", "dropout")
    assert type(fast.for_training(model)[1]) is FastDropout
    monkeypatch.setenv("ATTNLAB_SPEEDUPS", "linear,-attention")
    with pytest.raises(AttnlabError, match="not both"):
        fast.chosen("training")
    monkeypatch.setenv("ATTNLAB_SPEEDUPS", "lineer")
    with pytest.raises(AttnlabError, match="unknown speed-up lineer"):
        fast.for_training(model)


def test_report_names_the_route_and_every_speedup() -> None:
    text = fast.report("-attention")
    assert text.startswith("route: cpu ")
    for s in fast.registry():
        assert s.name in text
    assert any(
        line.split()[:1] == ["attention"] and line.split()[3] == "no" for line in text.split("\n")
    )


@pytest.mark.parametrize("tie_output", [True, False])
def test_transformer_twins_give_the_plain_loss_and_gradients(tie_output: bool) -> None:
    from attnlab.config import TransformerConfig
    from attnlab.models.seq2seq import Transformer

    config = TransformerConfig(
        src_vocab_size=50, tgt_vocab_size=50, d_model=16, n_heads=2, d_ff=32,
        n_encoder_layers=1, n_decoder_layers=1, max_positions=16, dropout=0.0,
        tie_output=tie_output,
    )  # fmt: skip
    g = torch.Generator().manual_seed(3)
    src, tgt = torch.randint(3, 50, (2, 9), generator=g), torch.randint(3, 50, (2, 7), generator=g)
    results = []
    for twins in (False, True):
        torch.manual_seed(0)
        model = Transformer(config)
        if twins:
            fast.for_training(model, "all")
            assert any(type(m).__name__.startswith("Fast") for m in model.modules())
        loss = model(src, tgt[:, :-1], tgt[:, 1:])["loss"]
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (plain_loss, plain), (twin_loss, twin) = results
    torch.testing.assert_close(twin_loss, plain_loss, rtol=1e-5, atol=1e-6)
    for name, grad in plain.items():
        torch.testing.assert_close(twin[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
@pytest.mark.parametrize("use", ["training", "inference"])
def test_sequence_classifier_twins_give_the_plain_logits_and_loss(pooling: str, use: str) -> None:
    """[CLS] pooling computes only [CLS] in the last layer (kept_rows); mean pooling every row."""
    from attnlab.models.heads import BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=90, d_model=32, n_layers=2, n_heads=4, d_ff=64)
    model = BertForSequenceClassification(config, 3, pooling=pooling).eval()
    batch = pretraining_batch()
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    labels = torch.tensor([2, 0])
    with torch.no_grad():
        want = model(**inputs, labels=labels)
    plain_classes = classes(model)
    (fast.for_training if use == "training" else fast.for_inference)(model, "all")
    assert classes(model) != plain_classes
    with torch.no_grad():
        got = model(**inputs, labels=labels)
    for name in ("logits", "loss"):
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)
