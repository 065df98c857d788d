"""BERT: parity with HF transformers on a real checkpoint, presets, defaults, export both ways."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import VARIED_SENTENCES

from attnlab.config import POSITION_ENCODINGS, BertConfig
from attnlab.errors import AttnlabError
from attnlab.interop.hf import bert_state_to_hf, load_bert, save_bert
from attnlab.models.bert import BertForPreTraining, BertModel, count_parameters


def _batch(hf_tokenizer, pairs: bool = False):
    if pairs:
        a, b = VARIED_SENTENCES[:4], VARIED_SENTENCES[4:]
        return hf_tokenizer(a, b, padding=True, return_tensors="pt")
    return hf_tokenizer(VARIED_SENTENCES, padding=True, return_tensors="pt")


@pytest.mark.parametrize("pairs", [False, True])
def test_minilm_hidden_states_match_hf(minilm_dir, hf_minilm, hf_tokenizer, pairs):
    batch = _batch(hf_tokenizer, pairs)
    assert (batch["attention_mask"] == 0).any(), "the batch must contain padding"
    ours = load_bert(minilm_dir)
    with torch.no_grad():
        ref = hf_minilm(**batch)
        out = ours(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    real = batch["attention_mask"].bool()
    diff = (ref.last_hidden_state - out.last_hidden_state)[real].abs().max().item()
    assert diff <= 1e-5
    assert (ref.pooler_output - out.pooler_output).abs().max().item() <= 1e-5


def test_minilm_attention_weights_match_hf(minilm_dir, hf_tokenizer):
    from transformers import BertModel as HFBertModel

    hf = HFBertModel.from_pretrained(str(minilm_dir), attn_implementation="eager").eval()
    batch = _batch(hf_tokenizer)
    ours = load_bert(minilm_dir)
    with torch.no_grad():
        ref = hf(**batch, output_attentions=True, output_hidden_states=True)
        out = ours(
            batch["input_ids"],
            batch["attention_mask"],
            need_weights=True,
            output_hidden_states=True,
        )
    assert len(out.attentions) == len(ref.attentions) == 6
    # Probabilities after six layers: fp32 rounding differs by host (1.02e-5 measured on an
    # Intel Xeon, under 1e-5 on AMD EPYC); a wrong scale or mask moves them by 1e-2 or more.
    for a, b in zip(out.attentions, ref.attentions, strict=True):
        assert (a - b).abs().max().item() <= 5e-5
    assert len(out.hidden_states) == len(ref.hidden_states) == 7
    real = batch["attention_mask"].bool()
    for a, b in zip(out.hidden_states, ref.hidden_states, strict=True):
        assert (a - b)[real].abs().max().item() <= 1e-5


@pytest.mark.parametrize("need_weights", [False, True])  # SDPA, and the explicit path
def test_minilm_gradients_match_hf(minilm_dir, hf_tokenizer, need_weights):
    """One backward pass gives HF's gradient for every weight (the fused QKV split back)."""
    from transformers import BertModel as HFBertModel

    batch = _batch(hf_tokenizer, pairs=True)
    hf = HFBertModel.from_pretrained(str(minilm_dir)).eval()  # a fresh copy; no dropout
    ours = load_bert(minilm_dir).eval()
    torch.manual_seed(0)
    # A loss that weighs every real position's every feature differently, and the pooler.
    weights = torch.randn(*batch["input_ids"].shape, ours.config.d_model)
    weights *= batch["attention_mask"].unsqueeze(-1)

    def loss(hidden: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return (hidden * weights).sum() + pooled.sum()

    ids, mask, types = batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]
    out = ours(ids, mask, types, need_weights=need_weights)
    loss(out.last_hidden_state, out.pooler_output).backward()
    ref = hf(**batch)
    loss(ref.last_hidden_state, ref.pooler_output).backward()

    grads = copy.deepcopy(ours)  # the same module tree holding gradients, named as HF names it
    for holder, param in zip(grads.parameters(), ours.parameters(), strict=True):
        holder.data = param.grad
    named = bert_state_to_hf(grads)
    for name, param in hf.named_parameters():
        expected = param.grad
        scale = expected.abs().max().item()
        diff = (named[name] - expected).abs().max().item()
        # 1e-5 absolute: the key bias's true gradient is 0 (softmax ignores a constant per
        # query), so both sides hold rounding noise of ~2e-6 there, against gradients up to ~200.
        assert diff <= 1e-4 * scale + 1e-5, (name, diff, scale)


def test_defaults_token_types_zero_and_mask_ones(minilm_dir, hf_minilm, hf_tokenizer):
    ids = hf_tokenizer(["a sentence with no padding at all"], return_tensors="pt")["input_ids"]
    ours = load_bert(minilm_dir)
    with torch.no_grad():
        implicit = ours(ids).last_hidden_state
        explicit = ours(ids, torch.ones_like(ids), torch.zeros_like(ids)).last_hidden_state
        ref = hf_minilm(input_ids=ids).last_hidden_state
    assert torch.equal(implicit, explicit)
    assert (implicit - ref).abs().max().item() <= 1e-5


def test_too_long_input_is_a_clear_error():
    model = BertModel(BertConfig.preset("bert-tiny", max_positions=16)).eval()
    with pytest.raises(AttnlabError, match="at most 16"):
        model(torch.ones(1, 17, dtype=torch.long))


def test_ids_outside_the_tables_are_a_clear_error():
    # A tokenizer of another model (more tokens than vocab_size) or a third segment id failed
    # as a bare IndexError "index out of range in self" inside the embedding lookup.
    model = BertModel(BertConfig.preset("bert-tiny", vocab_size=50)).eval()
    ids = torch.randint(1, 50, (2, 6))
    with pytest.raises(AttnlabError, match=r"input_ids holds id 50, outside .* vocab_size 50"):
        model(torch.cat((ids, torch.full((2, 1), 50)), 1))
    with pytest.raises(AttnlabError, match="input_ids holds id -1"):
        model(ids.masked_fill(ids == ids[0, 0], -1))
    with pytest.raises(AttnlabError, match=r"token_type_ids holds id 2, .* type_vocab_size 2"):
        model(ids, token_type_ids=torch.full_like(ids, 2))


def _hf_count(config: BertConfig) -> int:
    from transformers import BertConfig as HFConfig
    from transformers import BertForPreTraining as HFPreTraining

    from attnlab.interop.hf import config_to_hf

    with torch.device("meta"):
        return HFPreTraining(HFConfig(**config_to_hf(config))).num_parameters()


@pytest.mark.parametrize(
    ("preset", "expected", "tolerance"),
    [("bert-base", 110_000_000, 1_000_000), ("bert-large", 335_000_000, 2_000_000)],
)
def test_preset_parameter_counts(preset, expected, tolerance):
    config = BertConfig.preset(preset)
    with torch.device("meta"):
        model = BertForPreTraining(config)
    ours = count_parameters(model)
    assert abs(ours - expected) <= tolerance
    assert ours == _hf_count(config)  # counted as HF counts them (tied decoder once)


def test_compact_presets_have_published_sizes():
    sizes = {
        "bert-tiny": (2, 128),
        "bert-mini": (4, 256),
        "bert-small": (4, 512),
        "bert-medium": (8, 512),
    }
    for name, (layers, hidden) in sizes.items():
        config = BertConfig.preset(name)
        assert (config.n_layers, config.d_model, config.d_ff) == (layers, hidden, 4 * hidden)
        assert config.d_model // config.n_heads == 64
    with pytest.raises(AttnlabError, match="unknown preset"):
        BertConfig.preset("bert-enormous")


def test_mlm_head_is_tied_to_word_embeddings():
    model = BertForPreTraining(BertConfig.preset("bert-tiny"))
    assert model.mlm.word_embeddings.weight is model.bert.embeddings.word_embeddings.weight


def test_sparse_mlm_logits_equal_dense_at_masked_positions():
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.preset("bert-tiny", vocab_size=100)).eval()
    ids = torch.randint(5, 100, (3, 12))
    labels = torch.full_like(ids, -100)
    labels[0, 3], labels[1, 7], labels[2, 0] = 11, 12, 13
    with torch.no_grad():
        dense = model(ids)["mlm_logits"]
        sparse = model(ids, mlm_labels=labels, nsp_labels=torch.tensor([0, 1, 0]))
    masked = labels != -100
    assert torch.allclose(sparse["mlm_logits"], dense[masked], atol=1e-6)
    expected = torch.nn.functional.cross_entropy(dense[masked], labels[masked])
    assert torch.allclose(sparse["mlm_loss"], expected, atol=1e-6)


@pytest.mark.parametrize("encoding", POSITION_ENCODINGS)
def test_every_position_encoding_builds_a_bert(encoding, tmp_path):
    torch.manual_seed(0)
    config = BertConfig.preset("bert-tiny", vocab_size=64, position_encoding=encoding)
    model = BertModel(config).eval()
    ids = torch.randint(1, 64, (2, 10))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    with torch.no_grad():
        out = model(ids, mask).last_hidden_state
    assert out.shape == (2, 10, 128) and torch.isfinite(out).all()
    # attnlab's own checkpoint layout keeps every scheme (HF has no field for most of them)
    save_bert(model, tmp_path / "ckpt")
    again = load_bert(tmp_path / "ckpt")
    assert again.config.position_encoding == encoding
    with torch.no_grad():
        assert torch.equal(again(ids, mask).last_hidden_state, out)


def test_export_round_trip_through_hf(minilm_dir, hf_minilm, hf_tokenizer, tmp_path):
    from transformers import BertForPreTraining as HFPreTraining
    from transformers import BertModel as HFBertModel

    torch.manual_seed(0)
    pretrain = BertForPreTraining(load_bert(minilm_dir).config)
    pretrain.bert.load_state_dict(load_bert(minilm_dir).state_dict())
    save_bert(pretrain.eval(), tmp_path / "out", require_hf=True)
    hf, info = HFPreTraining.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    hf_base, info = HFBertModel.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert not info["missing_keys"]
    batch = _batch(hf_tokenizer)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        ours = pretrain(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
        theirs = hf.eval()(**batch)
        base = hf_base.eval()(**batch).last_hidden_state
        original = hf_minilm(**batch).last_hidden_state
    assert (ours["mlm_logits"] - theirs.prediction_logits)[real].abs().max().item() <= 1e-4
    assert (ours["nsp_logits"] - theirs.seq_relationship_logits).abs().max().item() <= 1e-5
    assert (base - original)[real].abs().max().item() <= 1e-6


def test_export_refuses_configs_hf_cannot_run(tmp_path):
    model = BertModel(BertConfig.preset("bert-tiny", position_encoding="rope"))
    with pytest.raises(AttnlabError, match="HF format"):
        save_bert(model, tmp_path / "x", require_hf=True)
    assert not (tmp_path / "x").exists()


def test_save_refuses_non_empty_out(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("precious")
    model = BertModel(BertConfig.preset("bert-tiny"))
    # Called from Python, the message names the Python argument, not a command-line flag.
    with pytest.raises(AttnlabError, match=r"^out .* already holds files \(pass overwrite=True"):
        save_bert(model, tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "precious"
    save_bert(model, tmp_path / "out", overwrite=True)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["hidden_size"] == 128
    assert not (tmp_path / "out" / "keep.txt").exists()


def test_legacy_bin_checkpoint_loads_with_weights_only(minilm_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file

    folder = tmp_path / "legacy"
    folder.mkdir()
    shutil.copy(minilm_dir / "config.json", folder / "config.json")
    state = load_file(str(minilm_dir / "model.safetensors"))
    state = {k.replace("LayerNorm.weight", "LayerNorm.gamma"): v for k, v in state.items()}
    torch.save(state, folder / "pytorch_model.bin")
    a, b = load_bert(folder), load_bert(minilm_dir)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def test_albert_factorised_embeddings_and_shared_layers(tmp_path):
    base = BertConfig.preset("bert-small", vocab_size=1000)
    albert = base.replace(embedding_size=64, share_layers=True)
    full, small = BertModel(base), BertModel(albert)
    v, e, h, n = 1000, 64, base.d_model, base.n_layers
    layer = sum(p.numel() for p in full.encoder.layers[0].parameters())
    # V*H embeddings become V*E + E*H (+ the projection bias); N layers become one
    embed_saving = (v + base.max_positions + 2) * (h - e) + 2 * (h - e) - (e * h + h)
    expected = count_parameters(full) - embed_saving - (n - 1) * layer
    assert count_parameters(small) == expected
    torch.manual_seed(0)
    ids = torch.randint(5, 1000, (2, 9))
    model = BertForPreTraining(albert).eval()
    with torch.no_grad():
        logits = model(ids)["mlm_logits"]
    assert logits.shape == (2, 9, 1000)
    save_bert(model, tmp_path / "albert")
    again = load_bert(tmp_path / "albert", heads=True)
    assert again.config.share_layers and again.config.embedding_size == 64
    with torch.no_grad():
        assert torch.equal(again(ids)["mlm_logits"], logits)
    with pytest.raises(AttnlabError, match="HF format"):
        save_bert(model, tmp_path / "hf", require_hf=True)


@pytest.mark.parametrize("position_encoding", POSITION_ENCODINGS)
def test_factorised_embeddings_with_every_position_encoding(position_encoding):
    # The additive schemes are E wide (added before the projection to d_model); RoPE rotates
    # the attention's heads, d_model / n_heads wide, whatever E is.
    config = BertConfig.preset("bert-tiny", vocab_size=100, position_encoding=position_encoding)
    config = config.replace(embedding_size=32)
    torch.manual_seed(0)
    model = BertForPreTraining(config)
    ids = torch.randint(5, 100, (2, 9))
    labels = torch.full_like(ids, -100)
    labels[:, [3, 5]] = 7
    out = model(ids, mlm_labels=labels, nsp_labels=torch.tensor([0, 1]))
    out["loss"].backward()
    assert out["mlm_logits"].shape == (4, 100) and torch.isfinite(out["loss"])
    if position_encoding == "rope":
        d_head = config.d_model // config.n_heads
        cos, _ = model.bert.embeddings.positions.rotary(torch.arange(9))
        assert cos.shape == (9, d_head)


@pytest.mark.parametrize("position_encoding", POSITION_ENCODINGS)
def test_pretraining_trains_every_parameter(position_encoding):
    # BERT trains with attention dropout 0.1, which on CPU runs attention's own backward pass
    # (nn/attention.py: _DropoutAttention): every parameter, a relative-bias table included,
    # must get a gradient.
    config = BertConfig.preset("bert-tiny", vocab_size=100, position_encoding=position_encoding)
    torch.manual_seed(0)
    model = BertForPreTraining(config).train()
    ids = torch.randint(5, 100, (2, 9))
    labels = torch.full_like(ids, -100)
    labels[:, [2, 6]] = 7
    model(ids, mlm_labels=labels, nsp_labels=torch.tensor([0, 1]))["loss"].backward()
    missing = {name for name, p in model.named_parameters() if p.grad is None}
    assert not missing, f"parameters without gradient: {missing}"


def test_models_hf_cannot_run_are_saved_so_that_hf_refuses_them(tmp_path):
    # HF's BertModel would load a RoPE model with fresh, random position embeddings and a
    # warning; the config's model_type makes transformers refuse it, and attnlab loads it back.
    from transformers import AutoModel

    config = BertConfig.preset("bert-tiny", vocab_size=100, position_encoding="rope")
    torch.manual_seed(0)
    model = BertModel(config).eval()
    save_bert(model, tmp_path / "rope")
    assert (
        json.loads((tmp_path / "rope" / "config.json").read_text())["model_type"] == "attnlab-bert"
    )
    with pytest.raises(ValueError, match="attnlab-bert"):
        AutoModel.from_pretrained(tmp_path / "rope")
    ids = torch.randint(5, 100, (2, 6))
    with torch.no_grad():
        assert torch.equal(
            load_bert(tmp_path / "rope")(ids).last_hidden_state, model(ids).last_hidden_state
        )
    save_bert(BertModel(config.replace(position_encoding="learned")), tmp_path / "plain")
    assert json.loads((tmp_path / "plain" / "config.json").read_text())["model_type"] == "bert"


@pytest.mark.parametrize(
    "inputs, fragment",
    [
        ({"input_ids": torch.tensor([101, 7, 102])}, r"\(batch, seq\) tensor of integer token ids"),
        ({"input_ids": torch.ones(1, 4)}, "integer token ids, got torch.float32"),
        ({"input_ids": [[101, 7, 102]]}, "a tensor of token ids, got list"),
        # an all-ones mask of the wrong shape was ignored in silence
        ({"attention_mask": torch.ones(1, 2, dtype=torch.long)}, "attention_mask must be a tensor"),
        (
            {"token_type_ids": torch.zeros(1, 3, dtype=torch.long)},
            "token_type_ids must be a tensor",
        ),
        ({"input_ids": torch.zeros(1, 0, dtype=torch.long)}, "holds no tokens"),
    ],
)
def test_malformed_inputs_are_clear_errors(inputs, fragment):
    model = BertModel(BertConfig.preset("bert-tiny", vocab_size=100)).eval()
    args = {"input_ids": torch.tensor([[1, 5, 6, 2]]), **inputs}
    with pytest.raises(AttnlabError, match=fragment):
        model(**args)


def test_mlm_only_model_has_no_unused_parameters(tmp_path):
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.preset("bert-tiny", vocab_size=50), sentence_head=False)
    ids = torch.randint(5, 50, (2, 8))
    labels = torch.full_like(ids, -100)
    labels[:, 2] = 7
    model(ids, mlm_labels=labels)["loss"].backward()
    assert all(p.grad is not None for p in model.parameters())
    save_bert(model.eval(), tmp_path / "mlm")
    config = json.loads((tmp_path / "mlm" / "config.json").read_text())
    assert config["architectures"] == ["BertForMaskedLM"]
    again = load_bert(tmp_path / "mlm", heads=True)
    assert again.nsp is None


# ------------------------------------------------ last layer at the kept positions only


def _keep_mask(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """Random kept positions, [CLS] always kept, counts differing between rows."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(shape, generator=g) < 0.3
    keep[:, 0] = True
    keep[-1] = True  # one row keeps every position, the others fewer: padded queries
    return keep


def test_minilm_kept_positions_match_hf(minilm_dir, hf_minilm, hf_tokenizer):
    batch = _batch(hf_tokenizer)
    keep = _keep_mask(tuple(batch["input_ids"].shape), seed=1)
    ours = load_bert(minilm_dir)
    with torch.no_grad():
        ref = hf_minilm(**batch)
        out = ours(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], keep=keep)
    assert out.last_hidden_state.shape == (int(keep.sum()), ours.config.d_model)
    diff = (out.last_hidden_state - ref.last_hidden_state[keep]).abs().max().item()
    assert diff <= 1e-5
    assert (out.pooler_output - ref.pooler_output).abs().max().item() <= 1e-5


@pytest.mark.parametrize("encoding", POSITION_ENCODINGS)
@pytest.mark.parametrize("norm_position, share", [("post", False), ("pre", True)])
def test_kept_positions_equal_the_full_output(encoding, norm_position, share):
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=60, d_model=32, n_layers=3, n_heads=4, d_ff=64, max_positions=32,
        position_encoding=encoding, norm_position=norm_position, share_layers=share,
    )  # fmt: skip
    model = BertModel(config).eval()
    ids = torch.randint(1, 60, (4, 11))
    mask = torch.ones_like(ids)
    mask[0, 7:], mask[2, 4:] = 0, 0
    keep = _keep_mask((4, 11), seed=2)
    with torch.no_grad():
        full = model(ids, mask)
        part = model(ids, mask, keep=keep)
    assert torch.allclose(part.last_hidden_state, full.last_hidden_state[keep], atol=1e-5)
    assert torch.allclose(part.pooler_output, full.pooler_output, atol=1e-5)


def test_pretraining_loss_and_gradients_unchanged_by_computing_only_kept_positions():
    """With dropout off, the pruned last layer gives the loss and every gradient of the full one."""
    torch.manual_seed(0)
    config = BertConfig.preset("bert-tiny", vocab_size=80, dropout=0.0, attention_dropout=0.0)
    model = BertForPreTraining(config).train()
    ids = torch.randint(5, 80, (3, 16))
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    labels = torch.full_like(ids, -100)
    labels[0, [2, 5, 9]] = torch.tensor([7, 8, 9])
    labels[1, 4] = 10
    labels[2, [1, 15]] = torch.tensor([11, 12])
    nsp = torch.tensor([0, 1, 1])

    out = model(ids, mask, mlm_labels=labels, nsp_labels=nsp)
    out["loss"].backward()
    pruned = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    # Reference written out here: every position through every layer, then the heads.
    masked = labels != -100
    full = model.bert(ids, mask)
    logits = model.mlm(full.last_hidden_state[masked])
    mlm = torch.nn.functional.cross_entropy(logits, labels[masked])
    reference = mlm + torch.nn.functional.cross_entropy(model.nsp(full.pooler_output), nsp)
    reference.backward()

    assert torch.allclose(out["loss"], reference, atol=1e-6)
    for name, p in model.named_parameters():
        scale = p.grad.abs().max().item() + 1e-6
        assert (pruned[name] - p.grad).abs().max().item() <= 1e-5 * scale, name


def test_mlm_labels_of_another_shape_are_named():
    # They were refused as "keep must be a bool tensor shaped like input_ids", naming an
    # argument the caller never passed; flattened (batch * seq,) labels, as HF's loss reads
    # them, failed as a bare IndexError.
    model = BertForPreTraining(BertConfig.preset("bert-tiny", vocab_size=50)).eval()
    ids = torch.randint(1, 50, (2, 6))
    for labels in (torch.full((2, 5), 3), torch.full((12,), 3)):
        with pytest.raises(AttnlabError, match="mlm_labels must be a tensor shaped like input_ids"):
            model(ids, mlm_labels=labels)


def test_keep_is_checked():
    model = BertModel(BertConfig.preset("bert-tiny", vocab_size=50)).eval()
    ids = torch.randint(1, 50, (2, 6))
    keep = torch.zeros_like(ids, dtype=torch.bool)
    keep[:, 0] = True
    with pytest.raises(AttnlabError, match="bool tensor shaped like input_ids"):
        model(ids, keep=keep[:, :3])
    with pytest.raises(AttnlabError, match="need_weights or output_hidden_states"):
        model(ids, keep=keep, need_weights=True)
    with pytest.raises(AttnlabError, match="position 0"):
        model(ids, keep=torch.roll(keep, 1, dims=1))
    with pytest.raises(AttnlabError, match="selects no position"):
        BertModel(BertConfig.preset("bert-tiny", vocab_size=50), add_pooler=False)(
            ids, keep=torch.zeros_like(keep)
        )
