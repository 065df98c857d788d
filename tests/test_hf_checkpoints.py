"""HF checkpoint variants found on the hub: each loads with HF transformers' outputs, or is refused.

Every checkpoint here is written by transformers' own save_pretrained (then edited where a
variant needs it), and the reference is transformers run on the same folder.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from attnlab.errors import AttnlabError
from attnlab.interop.hf import (
    bert_state_to_hf,
    checkpoint_task,
    load_bert,
    load_task_model,
    save_bert,
    save_task_model,
)

TOL = 1e-5


@pytest.fixture(autouse=True)
def _quiet(one_thread):
    transformers.logging.set_verbosity_error()


def hf_config(**fields) -> transformers.BertConfig:
    """A tiny BERT config (fields override it)."""
    base = dict(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=40,
    )
    return transformers.BertConfig(**{**base, **fields})


def randomized(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """model in eval mode with every parameter random (a default LayerNorm hides mistakes)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + name.endswith("LayerNorm.weight"))
    return model.eval()


def saved(model: torch.nn.Module, folder: Path, **kwargs) -> Path:
    model.save_pretrained(str(folder), **kwargs)
    return folder


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def edit_weights(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    state = load_file(str(path))
    edit(state)
    save_file(state, str(path), metadata={"format": "pt"})


def batch() -> dict[str, torch.Tensor]:
    """Three sequences of ids with padding and a second segment."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 99, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 8:], mask[2, 5:] = 0, 0
    types = torch.zeros_like(ids)
    types[:, 6:] = 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


def max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    diff = (a - b).abs()
    return float((diff[mask.bool()] if mask is not None else diff).max())


def mlm_logits(model, inputs):
    with torch.no_grad():
        return model(*inputs.values())["mlm_logits"]


def hf_mlm_logits(folder: Path, inputs):
    hf = transformers.BertForPreTraining.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        return hf(**inputs).prediction_logits


# ---- config.json --------------------------------------------------------------------------


def test_gelu_tanh_is_exported_as_gelu_pytorch_tanh(tmp_path):
    source = saved(
        randomized(transformers.BertModel(hf_config(hidden_act="gelu_pytorch_tanh"))),
        tmp_path / "src",
    )
    save_bert(load_bert(source), tmp_path / "out")
    # HF's gelu_new is the tanh formula written out: equal to torch's only within rounding.
    assert json.loads((tmp_path / "out" / "config.json").read_text())["hidden_act"] == (
        "gelu_pytorch_tanh"
    )
    inputs = batch()
    with torch.no_grad():
        ours = load_bert(tmp_path / "out")(*inputs.values()).last_hidden_state
        hf = transformers.BertModel.from_pretrained(str(tmp_path / "out")).eval()
        theirs = hf(**inputs).last_hidden_state
    assert max_diff(ours, theirs, inputs["attention_mask"]) < TOL


def test_unsupported_activation_lists_the_supported_ones(tmp_path):
    source = saved(transformers.BertModel(hf_config(hidden_act="silu")), tmp_path / "silu")
    with pytest.raises(AttnlabError, match=r"hidden_act 'silu' \(supported: gelu, gelu_new, "):
        load_bert(source)


@pytest.mark.parametrize(
    "flags", [{"is_decoder": True}, {"is_decoder": True, "add_cross_attention": True}]
)
def test_bert_decoders_are_refused(flags, tmp_path):
    # HF runs these with a causal mask (and cross-attention layers): not an encoder.
    folder = saved(transformers.BertModel(hf_config(**flags)), tmp_path / "decoder")
    with pytest.raises(AttnlabError, match=r"is_decoder is true .*BERT encoders only"):
        load_bert(folder)
    edit_config(folder, is_decoder=False)
    if "add_cross_attention" in flags:
        with pytest.raises(AttnlabError, match="add_cross_attention is true"):
            load_bert(folder)


# ---- the masked-LM head ---------------------------------------------------------------------


def test_untied_mlm_decoder_is_refused_but_its_encoder_loads(tmp_path):
    hf = randomized(transformers.BertForMaskedLM(hf_config(tie_word_embeddings=False)))
    assert hf.cls.predictions.decoder.weight is not hf.bert.embeddings.word_embeddings.weight
    folder = saved(hf, tmp_path / "untied")
    with pytest.raises(AttnlabError, match="decoder not tied to the word embeddings"):
        load_bert(folder, heads=True, trained_heads=True)
    with pytest.raises(AttnlabError, match="decoder not tied"):
        load_bert(folder, heads=True)
    inputs = batch()
    with torch.no_grad():
        ours = load_bert(folder)(*inputs.values()).last_hidden_state
        theirs = transformers.BertModel.from_pretrained(str(folder)).eval()(**inputs)
    assert max_diff(ours, theirs.last_hidden_state, inputs["attention_mask"]) < TOL


@pytest.mark.parametrize("variant", ["own decoder weight", "two biases"])
def test_mlm_decoder_tensors_other_than_the_tied_ones_are_refused(variant, tmp_path):
    # config.json says tied, but the weights hold a decoder of their own, which HF then uses.
    folder = saved(randomized(transformers.BertForPreTraining(hf_config())), tmp_path / "ck")
    g = torch.Generator().manual_seed(7)

    def edit(state):
        if variant == "own decoder weight":
            shape = state["bert.embeddings.word_embeddings.weight"].shape
            state["cls.predictions.decoder.weight"] = torch.randn(shape, generator=g)
        else:
            state["cls.predictions.decoder.bias"] = torch.randn(99, generator=g)

    edit_weights(folder, edit)
    inputs = batch()
    with torch.no_grad():  # the encoder alone still loads
        ours = load_bert(folder)(*inputs.values()).last_hidden_state
        theirs = transformers.BertModel.from_pretrained(str(folder)).eval()(**inputs)
    assert max_diff(ours, theirs.last_hidden_state, inputs["attention_mask"]) < TOL
    with pytest.raises(AttnlabError, match=r"decoder not tied|two different masked-LM"):
        load_bert(folder, heads=True, trained_heads=True)


def test_mlm_decoder_tensors_equal_to_the_tied_ones_load(tmp_path):
    def bias_only(state):  # some conversions name the one bias after the decoder
        state["cls.predictions.decoder.bias"] = state.pop("cls.predictions.bias")

    def equal_copies(state):  # older HF .bin files store the tied tensors twice
        embeddings = state["bert.embeddings.word_embeddings.weight"]
        state["cls.predictions.decoder.weight"] = embeddings.clone()
        state["cls.predictions.decoder.bias"] = state["cls.predictions.bias"].clone()

    inputs = batch()
    for i, edit in enumerate((bias_only, equal_copies)):
        hf = randomized(transformers.BertForPreTraining(hf_config()), seed=i)
        folder = saved(hf, tmp_path / edit.__name__)
        edit_weights(folder, edit)
        ours = mlm_logits(load_bert(folder, heads=True, trained_heads=True), inputs)
        assert max_diff(ours, hf_mlm_logits(folder, inputs), inputs["attention_mask"]) < TOL


# ---- weight files ---------------------------------------------------------------------------


@pytest.mark.parametrize("weights", ["safetensors", "bin"])
def test_sharded_checkpoints_load(weights, tmp_path):
    hf = randomized(transformers.BertForPreTraining(hf_config()))
    if weights == "safetensors":
        folder = saved(hf, tmp_path / "sharded", max_shard_size="20KB")
    else:  # transformers 5 writes safetensors only: shard a .bin checkpoint as version 4 did
        folder = tmp_path / "sharded"
        hf.config.save_pretrained(str(folder))
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        names = sorted(state)
        weight_map = {}
        for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
            shard = f"pytorch_model-0000{i + 1}-of-00002.bin"
            torch.save({k: state[k] for k in part}, folder / shard)
            weight_map.update(dict.fromkeys(part, shard))
        index = {"metadata": {}, "weight_map": weight_map}
        (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    index = json.loads(next(folder.glob("*.index.json")).read_text())
    assert len(set(index["weight_map"].values())) > 1
    inputs = batch()
    ours = mlm_logits(load_bert(folder, heads=True, trained_heads=True), inputs)
    assert max_diff(ours, hf_mlm_logits(folder, inputs), inputs["attention_mask"]) < TOL


def test_sharded_index_naming_a_file_elsewhere_is_refused(tmp_path):
    folder = saved(transformers.BertModel(hf_config()), tmp_path / "sharded", max_shard_size="20KB")
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../elsewhere.safetensors"
    path.write_text(json.dumps(index))
    with pytest.raises(AttnlabError, match="is not a file name in its directory"):
        load_bert(folder)


# ---- task heads -----------------------------------------------------------------------------


def test_multi_label_classifier_is_refused(tmp_path):
    hf = transformers.BertForSequenceClassification(
        hf_config(num_labels=3, problem_type="multi_label_classification")
    )
    folder = saved(randomized(hf), tmp_path / "multi")
    # Its loss is a binary cross-entropy per label, not attnlab's softmax cross-entropy.
    with pytest.raises(AttnlabError, match="problem_type 'multi_label_classification'"):
        checkpoint_task(folder)
    with pytest.raises(AttnlabError, match="problem_type 'multi_label_classification'"):
        load_task_model(folder, "classify")
    # Its encoder with a new head is what attnlab can train, and saves as single-label.
    model, fresh = load_task_model(folder, "classify", num_labels=3, new_head=True)
    assert fresh == ["classifier"]
    save_task_model(model, tmp_path / "new")
    again = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "new"))
    assert again.config.problem_type == "single_label_classification"
    inputs, labels = batch(), torch.tensor([0, 2, 1])
    with torch.no_grad():
        assert (
            abs(model(**inputs, labels=labels)["loss"] - again(**inputs, labels=labels).loss) < TOL
        )


@pytest.mark.parametrize(
    "hf_class, task",
    [
        ("BertForSequenceClassification", "classify"),
        ("BertForTokenClassification", "ner"),
        ("BertForQuestionAnswering", "qa"),
    ],
)
def test_a_trained_head_that_config_does_not_name_is_never_replaced(hf_class, task, tmp_path):
    hf = getattr(transformers, hf_class)(hf_config(num_labels=2))
    folder = saved(randomized(hf), tmp_path / "noarch")
    edit_config(folder, architectures=None)  # as some older exports
    head = "qa_outputs" if task == "qa" else "classifier"
    with pytest.raises(AttnlabError, match=f'no "architectures" but .* trained {head} head'):
        checkpoint_task(folder)
    with pytest.raises(AttnlabError, match=f'add "architectures": .*"{hf_class}"'):
        load_task_model(folder, task, num_labels=None if task == "qa" else 2)
    edit_config(folder, architectures=[hf_class])
    model, fresh = load_task_model(folder, task)
    assert fresh == []
    assert torch.equal(getattr(model, head).weight, getattr(hf, head).weight)


@pytest.mark.parametrize("task", ["classify", "ner"])
def test_classifier_dropout_is_read_and_written(task, tmp_path):
    hf_class = (
        "BertForSequenceClassification" if task == "classify" else "BertForTokenClassification"
    )
    hf = getattr(transformers, hf_class)(hf_config(num_labels=2, classifier_dropout=0.5))
    folder = saved(hf, tmp_path / "src")
    model, _ = load_task_model(folder, task)
    assert model.dropout.p == hf.dropout.p == 0.5
    save_task_model(model, tmp_path / "out")
    again = getattr(transformers, hf_class).from_pretrained(str(tmp_path / "out"))
    assert again.dropout.p == 0.5
    assert load_task_model(tmp_path / "out", task)[0].dropout.p == 0.5
    # Unset, it is the encoder's hidden dropout, in both libraries.
    edit_config(tmp_path / "out", classifier_dropout=None, hidden_dropout_prob=0.2)
    model, _ = load_task_model(tmp_path / "out", task)
    hf = getattr(transformers, hf_class).from_pretrained(str(tmp_path / "out"))
    assert model.dropout.p == hf.dropout.p == 0.2


def test_malformed_classifier_checkpoints_are_named_not_tracebacks(tmp_path):
    hf = transformers.BertForSequenceClassification(hf_config(num_labels=2))
    folder = saved(randomized(hf), tmp_path / "cls")
    edit_config(folder, id2label=5, label2id=None, problem_type=None)  # was a TypeError
    with pytest.raises(AttnlabError, match=r"id2label must be an object"):
        checkpoint_task(folder)
    folder = saved(randomized(hf), tmp_path / "no-weight")
    edit_weights(folder, lambda state: state.pop("classifier.weight"))  # was a KeyError
    with pytest.raises(AttnlabError, match=r"classifier head holds bias, not weight and bias"):
        load_task_model(folder, "classify")


# ---- fill-mask --------------------------------------------------------------------------------


def test_fill_mask_matches_hf_pipeline_when_the_model_has_more_rows_than_the_tokenizer(tmp_path):
    # Checkpoints often pad vocab_size past their vocab.txt (to a multiple of 8, say); HF's
    # pipeline ranks every row and shows one with no token as "": fill_mask raised instead.
    from attnlab.tasks.pretrain import fill_mask
    from attnlab.text.tokenizer import BertTokenizer

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat", "."]
    tokenizer = BertTokenizer.from_vocab({w: i for i, w in enumerate([*words, "##s", "a"])})
    hf = randomized(transformers.BertForMaskedLM(hf_config(vocab_size=tokenizer.vocab_size + 3)))
    with torch.no_grad():
        hf.cls.predictions.bias[tokenizer.vocab_size :] += 3.0  # the rows past the tokenizer lead
    folder = saved(hf, tmp_path / "mlm")
    tokenizer.save(folder)
    text = "the [MASK] sat on the [MASK] ."
    pipe = transformers.pipeline("fill-mask", model=str(folder), top_k=hf.config.vocab_size)
    expected = [[(p["token_str"], p["score"]) for p in mask] for mask in pipe(text)]
    assert any(token == "" for token, _ in expected[0][:3])
    model = load_bert(folder, heads=True, trained_heads=True)
    ours = fill_mask(model, BertTokenizer.from_dir(folder), text, top_k=hf.config.vocab_size)
    assert [[token for token, _ in mask] for mask in ours] == [
        [token for token, _ in mask] for mask in expected
    ]
    for mask, reference in zip(ours, expected, strict=True):
        assert max(abs(p - q) for (_, p), (_, q) in zip(mask, reference, strict=True)) < TOL


def test_a_trained_pooler_beside_a_masked_lm_head_is_kept(tmp_path):
    # transformers before 3.1 saved BertForMaskedLM with its pooler (no NSP head); loading it
    # with heads dropped the pooler, so an export held none and HF's BertModel (or a
    # sequence classifier) built from the export started from a random pooler.
    hf = randomized(transformers.BertForPreTraining(hf_config()))
    folder = saved(hf, tmp_path / "old-mlm")
    edit_weights(folder, lambda state: [state.pop(k) for k in list(state) if ".seq_rel" in k])
    edit_config(folder, architectures=["BertForMaskedLM"])
    model = load_bert(folder, heads=True, trained_heads=True)
    assert model.nsp is None
    save_bert(model, tmp_path / "export")
    inputs = batch()
    pooled = {}
    for name in ("old-mlm", "export"):
        encoder, info = transformers.BertModel.from_pretrained(
            str(tmp_path / name), output_loading_info=True
        )
        assert not info["missing_keys"], name
        with torch.no_grad():
            pooled[name] = encoder.eval()(**inputs).pooler_output
    assert max_diff(pooled["export"], pooled["old-mlm"]) < TOL
    assert (
        max_diff(mlm_logits(model, inputs), hf_mlm_logits(folder, inputs), inputs["attention_mask"])
        < TOL
    )


# ---- the pretraining objective --------------------------------------------------------------


def test_pretraining_loss_and_every_gradient_match_hf(tmp_path):
    # attnlab's pretraining loss takes shortcuts HF's does not: the vocabulary projection and
    # the last layer only at the rows a loss reads, a summed cross-entropy of its own. MLM
    # (mean over masked tokens) + NSP must still be HF BertForPreTraining's loss, and every
    # gradient HF's (dropout off).
    config = hf_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    hf = randomized(transformers.BertForPreTraining(config))
    folder = saved(hf, tmp_path / "ck")
    ours = load_bert(folder, heads=True, trained_heads=True).train()
    hf.train()
    inputs = batch()
    g = torch.Generator().manual_seed(2)
    labels = torch.full_like(inputs["input_ids"], -100)
    chosen = (torch.rand(labels.shape, generator=g) < 0.3) & inputs["attention_mask"].bool()
    chosen[0, 0] = True  # a label at [CLS], whose row the sentence head reads too
    labels[chosen] = torch.randint(0, 99, (int(chosen.sum()),), generator=g)
    nsp = torch.tensor([0, 1, 1])

    theirs = hf(**inputs, labels=labels, next_sentence_label=nsp)
    theirs.loss.backward()
    ids, mask, types = inputs.values()
    loss = ours(ids, mask, types, mlm_labels=labels, nsp_labels=nsp)["loss"]
    loss.backward()
    assert float(loss.detach()) == pytest.approx(float(theirs.loss.detach()), rel=1e-6)

    holders = copy.deepcopy(ours)  # the same module tree holding gradients, named as HF names it
    for holder, param in zip(holders.parameters(), ours.parameters(), strict=True):
        holder.data = param.grad
    named = bert_state_to_hf(holders)
    for name, param in hf.named_parameters():
        scale = param.grad.abs().max().item()
        diff = (named[name] - param.grad).abs().max().item()
        assert diff <= 1e-5 * scale + 1e-6, (name, diff, scale)
