"""HF GPT-2 folders (interop/gpt2.py): logits and greedy generation equal transformers'.

Every checkpoint is a random GPT2LMHeadModel written by transformers' save_pretrained, and
the reference is transformers run on the same weights (no real GPT-2 weights are reachable).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from attnlab.decode.sampling import generate
from attnlab.errors import AttnlabError
from attnlab.interop.gpt2 import is_gpt_folder, load_gpt, read_gpt_config, save_gpt
from attnlab.models.gpt import GPT

TOL = 1e-5
CONFIGS = {
    "tied": dict(n_embd=32, n_layer=2, n_head=4, vocab_size=97, n_positions=40),
    "untied-odd": dict(
        n_embd=30,
        n_layer=3,
        n_head=5,
        vocab_size=51,
        n_positions=33,
        n_inner=44,
        tie_word_embeddings=False,
        activation_function="gelu",
        layer_norm_epsilon=1e-6,
    ),
    "relu-one-layer": dict(
        n_embd=16,
        n_layer=1,
        n_head=2,
        vocab_size=23,
        n_positions=24,
        activation_function="relu",
        layer_norm_epsilon=1e-3,
    ),
}


@pytest.fixture(autouse=True)
def _quiet(one_thread):
    transformers.logging.set_verbosity_error()


def hf_model(name: str, seed: int = 0) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(**CONFIGS[name], bos_token_id=None, eos_token_id=None)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # random LayerNorms and biases, so their mapping is tested too
        for name_, p in model.named_parameters():
            if name_.endswith(".bias") or "ln_" in name_:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def saved(model: transformers.GPT2LMHeadModel, path, safe: bool = True):
    """save_pretrained's folder; safe=False turns its safetensors into a legacy pytorch_model.bin
    (transformers 5 writes safetensors only)."""
    model.save_pretrained(path)
    if not safe:
        weights = load_file(path / "model.safetensors")
        torch.save(weights, path / "pytorch_model.bin")
        (path / "model.safetensors").unlink()
    return path


def prompts(vocab: int, rows: int = 2, length: int = 9, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_equal_transformers(name, tmp_path):
    hf = hf_model(name)
    model = load_gpt(saved(hf, tmp_path / "m"))
    ids = prompts(hf.config.vocab_size, 3, 13)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=TOL, rtol=0)
    assert model.config.tie_embeddings == hf.config.tie_word_embeddings


def test_pytorch_bin_folders_load_too(tmp_path):
    hf = hf_model("untied-odd")
    path = saved(hf, tmp_path / "m", safe=False)
    assert (path / "pytorch_model.bin").is_file()
    ids = prompts(hf.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(load_gpt(path)(ids).logits, hf(ids).logits, atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ["tied", "untied-odd"])
def test_greedy_generation_equals_transformers(name, tmp_path):
    hf = hf_model(name)
    model = load_gpt(saved(hf, tmp_path / "m"))
    ids = prompts(hf.config.vocab_size, 1, 7)
    mask = torch.ones_like(ids)
    expected = hf.generate(
        ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0
    )
    assert torch.equal(generate(model, ids, 12, do_sample=False), expected)


@pytest.mark.parametrize("name", ["tied", "untied-odd"])
def test_greedy_left_padded_batch_equals_transformers(name, tmp_path):
    hf = hf_model(name)
    model = load_gpt(saved(hf, tmp_path / "m"))
    ids = prompts(hf.config.vocab_size, 3, 8)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :5] = 0
    ids = ids.masked_fill(mask == 0, 0)
    expected = hf.generate(
        ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0
    )
    got = generate(model, ids, 10, attention_mask=mask, do_sample=False)
    assert torch.equal(got, expected)
    # each row as it would go alone
    alone = generate(model, ids[2:, 5:], 10, do_sample=False)
    assert torch.equal(got[2, 5:], alone[0])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_export_loads_in_transformers_with_the_same_logits(name, tmp_path):
    hf = hf_model(name)
    model = load_gpt(saved(hf, tmp_path / "m"))
    save_gpt(model, tmp_path / "out", require_hf=True)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "gpt2"
    again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    ids = prompts(hf.config.vocab_size, 2, 11)
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits, atol=TOL, rtol=0)
        torch.testing.assert_close(again(ids).logits, hf(ids).logits, atol=TOL, rtol=0)


def test_an_attnlab_gpt_hf_cannot_run_is_saved_in_attnlab_layout(tmp_path):
    config = read_gpt_config(saved(hf_model("tied"), tmp_path / "m"))
    torch.manual_seed(0)
    model = GPT(config.replace(position_encoding="rope")).eval()
    with pytest.raises(AttnlabError, match="rope"):
        save_gpt(model, tmp_path / "hf", require_hf=True)
    assert not (tmp_path / "hf").exists()
    save_gpt(model, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] != "gpt2"
    assert is_gpt_folder(tmp_path / "out")
    loaded = load_gpt(tmp_path / "out")
    assert loaded.config == model.config
    ids = prompts(config.vocab_size)
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=0, rtol=0)


def test_save_refuses_a_full_folder_unless_overwrite(tmp_path):
    model = load_gpt(saved(hf_model("tied"), tmp_path / "m"))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(AttnlabError):
        save_gpt(model, tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "x"
    save_gpt(model, tmp_path / "out", overwrite=True)
    assert is_gpt_folder(tmp_path / "out")


def test_a_bert_folder_is_not_a_gpt_folder(tmp_path):
    bert = transformers.BertModel(
        transformers.BertConfig(
            vocab_size=30,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=20,
        )
    )
    bert.save_pretrained(tmp_path / "bert")
    assert not is_gpt_folder(tmp_path / "bert")
    assert not is_gpt_folder(tmp_path / "nothing")
    with pytest.raises(AttnlabError, match="not a GPT language model"):
        load_gpt(tmp_path / "bert")
    with pytest.raises(AttnlabError, match="not found"):
        load_gpt(tmp_path / "nothing")


@pytest.mark.parametrize(
    "edit",
    [
        {"scale_attn_by_inverse_layer_idx": True},
        {"add_cross_attention": True},
        {"activation_function": "swish"},
        {"n_head": 5},  # 32 wide: not divisible
        {"n_layer": 3},  # weights of 2 layers only
        {"n_inner": 64},  # weights of 128
    ],
)
def test_config_weights_mismatch_is_refused(edit, tmp_path):
    path = saved(hf_model("tied"), tmp_path / "m")
    data = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**data, **edit}))
    with pytest.raises(AttnlabError):
        load_gpt(path)


def test_cli_export_writes_a_gpt_folder_transformers_loads(tmp_path, capsys):
    from attnlab.cli import main

    hf = hf_model("untied-odd")
    path = saved(hf, tmp_path / "m")
    assert main(["export", "--model", str(path), "--out", str(tmp_path / "out")]) == 0
    again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    ids = prompts(hf.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, hf(ids).logits, atol=TOL, rtol=0)
    # an attnlab-only model (RoPE) cannot be exported: one line, nothing written
    save_gpt(GPT(read_gpt_config(path).replace(position_encoding="rope")), tmp_path / "rope")
    assert main(["export", "--model", str(tmp_path / "rope"), "--out", str(tmp_path / "x")]) == 2
    assert "rope" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_bare_gpt2model_folder_loads_with_the_tied_head(tmp_path):
    torch.manual_seed(0)
    config = transformers.GPT2Config(**CONFIGS["tied"], bos_token_id=None, eos_token_id=None)
    base = transformers.GPT2Model(config).eval()
    base.save_pretrained(tmp_path / "m")  # names without "transformer.", no lm_head
    model = load_gpt(tmp_path / "m")
    ids = prompts(config.vocab_size)
    with torch.no_grad():
        expected = base(ids).last_hidden_state @ base.wte.weight.T
    torch.testing.assert_close(model(ids).logits, expected, atol=TOL, rtol=0)
