"""GPT (models/gpt.py): the causal LM's equations as properties, its cache, its config.

The references are independent of the model's own code paths: the cross-entropy by hand,
causality (a later token changes no earlier logit), the full forward pass against
incremental decoding, a left-padded row against the same row unpadded.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attnlab.config import GPTConfig
from attnlab.errors import AttnlabError
from attnlab.models.gpt import GPT, GPTOutput

SCHEMES = ["learned", "sinusoidal", "rope", "alibi", "relative_bias", "shaw", "none"]


@pytest.fixture(autouse=True)
def _threads(one_thread):
    pass


def tiny(**fields) -> GPTConfig:
    """A tiny GPT config (fields override it)."""
    base = dict(vocab_size=37, d_model=24, n_layers=2, n_heads=4, d_ff=40, max_positions=32)
    return GPTConfig(**{**base, **fields})


def model_of(seed: int = 0, **fields) -> GPT:
    torch.manual_seed(seed)
    return GPT(tiny(**fields)).eval()


def test_config_round_trips(tmp_path):
    config = GPTConfig.preset("gpt-char", vocab_size=65, position_encoding="rope")
    assert GPTConfig.from_dict(config.to_dict()) == config
    config.save(tmp_path / "c.json")
    assert GPTConfig.load(tmp_path / "c.json") == config


def test_presets_have_the_published_sizes():
    gpt2 = GPTConfig.preset("gpt2")
    assert (gpt2.n_layers, gpt2.d_model, gpt2.n_heads, gpt2.max_positions) == (12, 768, 12, 1024)
    assert gpt2.vocab_size == 50257 and gpt2.activation == "gelu_tanh" and gpt2.tie_embeddings
    medium = GPTConfig.preset("gpt2-medium")
    assert (medium.n_layers, medium.d_model, medium.n_heads) == (24, 1024, 16)
    char = GPTConfig.preset("gpt-char", vocab_size=65)
    assert char.max_positions == 256 and char.vocab_size == 65


def test_gpt2_preset_has_124m_parameters():
    with torch.device("meta"):
        model = GPT(GPTConfig.preset("gpt2"))
    assert sum(p.numel() for p in model.parameters()) == 124_439_808  # GPT-2 small, tied


@pytest.mark.parametrize(
    "fields",
    [
        {"d_model": 30, "n_heads": 4},
        {"dropout": 1.0},
        {"activation": "swish"},
        {"position_encoding": "absolute"},
        {"n_layers": 0},
        {"vocab_size": True},
        {"position_encoding": "rope", "d_model": 12, "n_heads": 4},
    ],
)
def test_bad_config_is_refused(fields):
    with pytest.raises(AttnlabError):
        tiny(**fields)


def test_loss_is_the_mean_cross_entropy_over_scored_targets():
    model = model_of()
    ids = torch.randint(0, 37, (3, 9))
    targets = torch.randint(0, 37, (3, 9))
    targets[0, :4] = -100
    targets[2, -1] = -100
    out = model(ids, targets=targets)
    assert isinstance(out, dict) and isinstance(out, GPTOutput) and out["loss"] is out.loss
    keep = targets != -100
    log_probs = torch.log_softmax(out.logits.double(), dim=-1)
    by_hand = -log_probs[keep].gather(-1, targets[keep].unsqueeze(-1)).mean()
    torch.testing.assert_close(out.loss.double(), by_hand, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(
        out.loss, F.cross_entropy(out.logits.flatten(0, 1), targets.flatten()), atol=1e-6, rtol=0
    )


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_later_token_changes_no_earlier_logit(scheme):
    model = model_of(position_encoding=scheme)
    ids = torch.randint(0, 37, (2, 12))
    changed = ids.clone()
    changed[:, 7] = (ids[:, 7] + 1) % 37
    before, after = model(ids).logits, model(changed).logits
    torch.testing.assert_close(before[:, :7], after[:, :7], atol=1e-6, rtol=0)
    assert (before[:, 7:] - after[:, 7:]).abs().max() > 1e-4


@pytest.mark.parametrize("scheme", SCHEMES)
def test_cached_decoding_equals_the_full_pass(scheme):
    model = model_of(position_encoding=scheme)
    ids = torch.randint(0, 37, (2, 11))
    full = model(ids).logits
    cache = model.new_cache()
    parts = [model(ids[:, :5], cache=cache).logits]
    parts += [model(ids[:, t : t + 1], cache=cache).logits for t in range(5, 9)]
    parts.append(model(ids[:, 9:], cache=cache).logits)
    assert cache.length == 11
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("scheme", ["learned", "rope", "alibi", "shaw"])
def test_left_padding_leaves_a_row_as_it_is_alone(scheme):
    model = model_of(position_encoding=scheme)
    short = torch.randint(0, 37, (1, 6))
    long = torch.randint(0, 37, (1, 9))
    ids = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    batch = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(batch[0, 3:], model(short).logits[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(batch[1], model(long).logits[0], atol=1e-5, rtol=0)
    # and one more token through the cache, the mask of the new token only
    cache = model.new_cache()
    model(ids, attention_mask=mask, cache=cache)
    step = torch.randint(0, 37, (2, 1))
    cached = model(step, attention_mask=torch.ones_like(step), cache=cache).logits[:, -1]
    alone = model(torch.cat([short, step[:1]], 1)).logits[0, -1]
    torch.testing.assert_close(cached[0], alone, atol=1e-5, rtol=0)


def test_attention_weights_are_causal_distributions():
    model = model_of()
    out = model(torch.randint(0, 37, (2, 7)), need_weights=True)
    assert len(out.attentions) == 2
    for weights in out.attentions:
        assert weights.shape == (2, 4, 7, 7)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 7))
        assert weights.triu(diagonal=1).abs().max() == 0


def test_head_is_tied_to_the_embedding_unless_untied():
    tied = model_of()
    assert tied.output_weight() is tied.embed.weight
    assert not any(name.startswith("lm_head") for name, _ in tied.named_parameters())
    untied = model_of(tie_embeddings=False)
    assert untied.output_weight() is untied.lm_head.weight
    ids = torch.randint(0, 37, (1, 5))
    hidden = tied.final_norm(
        tied.layers[1](tied.layers[0](tied.embed(ids) + tied.positions.embed(torch.arange(5)))[0])[
            0
        ]
    )
    torch.testing.assert_close(tied(ids).logits, hidden @ tied.embed.weight.T, atol=1e-6, rtol=0)


def test_gpt2_initialisation_scales_the_residual_projections():
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=500, d_model=192, n_layers=8, n_heads=4, d_ff=768)
    model = GPT(config)
    residual = 0.02 / math.sqrt(2 * 8)
    for layer in model.layers:
        assert layer.self_attn.out_proj.weight.std().item() == pytest.approx(residual, rel=0.05)
        assert layer.ffn.fc2.weight.std().item() == pytest.approx(residual, rel=0.05)
        assert layer.self_attn.qkv_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
        assert layer.self_attn.qkv_proj.bias.abs().max() == 0
    assert model.embed.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.positions.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_training_steps_lower_the_loss():
    model = model_of(seed=1, dropout=0.0, attention_dropout=0.0).train()
    ids = torch.randint(0, 37, (4, 17))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(40):
        loss = model(ids[:, :-1], targets=ids[:, 1:])["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m(torch.randint(0, 37, (1, 33))),  # past the context
        lambda m: m(torch.tensor([[1, 37]])),  # id outside the vocabulary
        lambda m: m(torch.zeros(1, 0, dtype=torch.long)),
        lambda m: m(torch.ones(2, 3)),  # floats
        lambda m: m(torch.ones(2, 3, dtype=torch.long), targets=torch.ones(2, 4, dtype=torch.long)),
        lambda m: m(torch.ones(2, 3, dtype=torch.long), targets=torch.full((2, 3), 40)),
        lambda m: m(torch.ones(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 5)),
    ],
)
def test_bad_input_is_refused(call):
    with pytest.raises(AttnlabError):
        call(model_of())


def test_cache_refuses_going_past_the_context():
    model = model_of()
    cache = model.new_cache()
    model(torch.randint(0, 37, (1, 30)), cache=cache)
    with pytest.raises(AttnlabError, match="context"):
        model(torch.randint(0, 37, (1, 3)), cache=cache)


def test_last_only_is_the_last_position_of_the_full_logits():
    model = model_of(position_encoding="rope")
    ids = torch.randint(0, 37, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    full = model(ids, attention_mask=mask).logits
    last = model(ids, attention_mask=mask, last_only=True).logits
    assert last.shape == (2, 1, 37)
    torch.testing.assert_close(last, full[:, -1:], atol=1e-6, rtol=0)
    with pytest.raises(AttnlabError):
        model(ids, targets=ids, last_only=True)


def test_training_twins_keep_the_model_causal_and_equal():
    from attnlab import fast

    plain = model_of(dropout=0.0, attention_dropout=0.0).train()
    ids = torch.randint(0, 37, (2, 12))
    expected = plain(ids[:, :-1], targets=ids[:, 1:]).loss
    twin = fast.for_training(model_of(dropout=0.1, attention_dropout=0.1).train())
    changed = ids.clone()
    changed[:, 7] = (ids[:, 7] + 1) % 37
    torch.manual_seed(5)  # the same dropout masks for both inputs
    before = twin(ids).logits
    torch.manual_seed(5)
    after = twin(changed).logits
    torch.testing.assert_close(before[:, :7], after[:, :7], atol=1e-6, rtol=0)
    fast.to_plain(twin)
    for module in twin.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    for layer in twin.layers:
        layer.self_attn.dropout = 0.0
    torch.testing.assert_close(
        fast.for_training(twin)(ids[:, :-1], targets=ids[:, 1:]).loss, expected, atol=1e-6, rtol=0
    )


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_decoding_twin_steps_as_the_full_pass(scheme, monkeypatch):
    from attnlab import fast
    from attnlab.fast.decoding import DecodingGPTBlock

    model = model_of(position_encoding=scheme)
    ids = torch.randint(1, 37, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # row 0 is left-padded
    new = torch.randint(0, 37, (2, 6))
    everything = torch.cat([ids, new], 1)
    full = model(everything, attention_mask=torch.cat([mask, torch.ones_like(new)], 1)).logits
    steps = []
    monkeypatch.setattr(DecodingGPTBlock, "step", _counted(DecodingGPTBlock.step, steps))
    with fast.inference_twins(model, "decode_step"):
        assert all(type(layer) is DecodingGPTBlock for layer in model.layers)
        cache = model.new_cache()
        parts = [model(ids, attention_mask=mask, cache=cache).logits]
        parts += [model(new[:, t : t + 1], cache=cache).logits for t in range(6)]
    cached = torch.cat(parts, 1)
    torch.testing.assert_close(cached[0, 3:], full[0, 3:], atol=1e-5, rtol=0)
    torch.testing.assert_close(cached[1], full[1], atol=1e-5, rtol=0)
    # every one-token step took the direct route, but under Shaw's relative attention
    assert len(steps) == (0 if scheme == "shaw" else 6 * model.config.n_layers)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_decoding_model_twin_steps_as_the_full_pass(scheme, monkeypatch):
    # No padding: after the prompt, each one-token step is the model twin's direct route (the
    # blocks' steps called directly), with the logits of the uncached full pass.
    from attnlab import fast
    from attnlab.fast.decoding import DecodingGPT

    model = model_of(position_encoding=scheme)
    ids = torch.randint(0, 37, (2, 10))
    full = model(ids).logits
    steps = []
    monkeypatch.setattr(DecodingGPT, "step", _counted(DecodingGPT.step, steps))
    with fast.inference_twins(model, "decode_step,decode_model"):
        assert type(model) is DecodingGPT
        cache = model.new_cache()
        parts = [model(ids[:, :4], cache=cache).logits]
        for t in range(4, 10):
            parts.append(model(ids[:, t : t + 1], cache=cache, last_only=True).logits)
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=0)
    assert len(steps) == (0 if scheme == "shaw" else 6)  # Shaw's attention keeps the plain block


def test_the_decoding_model_twin_leaves_the_rest_to_the_plain_model():
    # Only a one-token step after cached tokens, with no padding anywhere, in evaluation,
    # takes the direct route; there, bad input meets the plain model's errors.
    from attnlab import fast

    model = fast.for_inference(model_of())
    step = torch.randint(0, 37, (2, 1))
    padded_cache, cache = model.new_cache(), model.new_cache()
    model(torch.randint(0, 37, (2, 3)), cache=cache)
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    model(torch.randint(0, 37, (2, 3)), attention_mask=mask, cache=padded_cache)
    assert model.takes_direct_route(step, cache, need_weights=False)
    assert not model.takes_direct_route(step, cache, need_weights=True)
    assert not model.takes_direct_route(step, model.new_cache(), need_weights=False)
    assert not model.takes_direct_route(step, padded_cache, need_weights=False)
    assert not model.takes_direct_route(torch.randint(0, 37, (2, 2)), cache, need_weights=False)
    with pytest.raises(AttnlabError, match="vocab_size"):
        model(torch.full((2, 1), 37), cache=cache)
    with pytest.raises(AttnlabError, match="input_ids"):
        model(torch.tensor([3, 4]), cache=cache)  # not (batch, seq)
    context = model.config.max_positions
    model(torch.randint(0, 37, (2, context - 3)), cache=cache)  # the context is now full
    with pytest.raises(AttnlabError, match="context"):
        model(step, cache=cache)
    model.train()
    assert not model.takes_direct_route(step, cache, need_weights=False)


def _counted(method, calls: list):
    def counting(*args, **kwargs):
        calls.append(1)
        return method(*args, **kwargs)

    return counting


def test_the_decoding_twin_leaves_training_and_weights_to_the_plain_block():
    from attnlab import fast

    model = fast.for_inference(model_of())
    layer, x, cache = model.layers[0], torch.randn(2, 1, 24), model.new_cache()
    assert layer.takes_direct_route(x, cache, need_weights=False)
    assert not layer.takes_direct_route(x, cache, need_weights=True)
    assert not layer.takes_direct_route(x, None, need_weights=False)
    assert not layer.takes_direct_route(torch.randn(2, 2, 24), cache, need_weights=False)
    model.train()
    assert not layer.takes_direct_route(x, cache, need_weights=False)
