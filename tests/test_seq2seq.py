"""The encoder-decoder Transformer (attnlab.models.seq2seq): causality, cached decoding, the
label-smoothed loss against an explicit formula, parameter counts against the paper, presets,
and save/load with shared and tied weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, load_model, save_file, save_model

from attnlab import fast
from attnlab.config import TransformerConfig
from attnlab.decode import KVCache
from attnlab.errors import AttnlabError
from attnlab.models.bert import count_parameters
from attnlab.models.seq2seq import Transformer, label_smoothed_cross_entropy

PAD, BOS, EOS = 0, 1, 2


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(seed: int = 0, **overrides) -> Transformer:
    """A small random model in eval mode (dropout off)."""
    args = dict(
        src_vocab_size=23,
        tgt_vocab_size=23,
        d_model=32,
        n_heads=4,
        d_ff=64,
        n_encoder_layers=2,
        n_decoder_layers=2,
        max_positions=64,
    )
    torch.manual_seed(seed)
    return Transformer(TransformerConfig(**{**args, **overrides})).eval()


def source_batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Three sources of lengths 7, 4 and 2 (right-padded) and their mask."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, 23, (3, 7), generator=g)
    mask = torch.arange(7)[None] < torch.tensor([7, 4, 2])[:, None]
    return src.masked_fill(~mask, PAD), mask


ENCODINGS = ["sinusoidal", "learned", "rope", "relative_bias", "alibi"]


@pytest.mark.parametrize("position_encoding", ENCODINGS)
@pytest.mark.parametrize("norm_position", ["post", "pre"])
def test_logits_at_t_ignore_later_targets(norm_position: str, position_encoding: str) -> None:
    model = tiny(norm_position=norm_position, position_encoding=position_encoding)
    src, mask = source_batch()
    tgt = torch.randint(3, 23, (3, 6), generator=torch.Generator().manual_seed(2))
    t = 2
    later, earlier = tgt.clone(), tgt.clone()
    later[:, t + 1 :] = (later[:, t + 1 :] + 5) % 20 + 3
    earlier[:, t - 1] = (earlier[:, t - 1] + 5) % 20 + 3
    with torch.no_grad():
        logits = model(src, tgt, src_mask=mask)["logits"]
        logits_later = model(src, later, src_mask=mask)["logits"]
        logits_earlier = model(src, earlier, src_mask=mask)["logits"]
    assert logits.shape == (3, 6, 23)
    torch.testing.assert_close(logits_later[:, : t + 1], logits[:, : t + 1], atol=1e-5, rtol=0)
    assert (logits_later[:, t + 1 :] - logits[:, t + 1 :]).abs().max() > 1e-3
    torch.testing.assert_close(logits_earlier[:, : t - 1], logits[:, : t - 1], atol=1e-5, rtol=0)
    assert (logits_earlier[:, t:] - logits[:, t:]).abs().max() > 1e-3  # the past does count


def test_source_padding_is_ignored() -> None:
    model = tiny()
    src, mask = source_batch()
    other = src.clone()
    other[~mask] = 9  # garbage under the padding
    tgt = torch.randint(3, 23, (3, 5))
    with torch.no_grad():
        a = model(src, tgt, src_mask=mask)["logits"]
        b = model(other, tgt, src_mask=mask)["logits"]
        # the default mask is src_ids != pad
        torch.testing.assert_close(model(src, tgt)["logits"], a)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("twins", [False, True])
@pytest.mark.parametrize("position_encoding", ENCODINGS)
@pytest.mark.parametrize("norm_position", ["post", "pre"])
def test_cached_incremental_decoding_equals_full_decode(
    norm_position: str, position_encoding: str, twins: bool
) -> None:
    model = tiny(norm_position=norm_position, position_encoding=position_encoding)
    if twins:
        fast.for_inference(model.eval())
    src, mask = source_batch()
    tgt = torch.randint(3, 23, (3, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        memory = model.encode(src, mask)
        full = model.decode(tgt, memory, mask)  # (3, 8, vocab)
        cache = KVCache(model.config.n_decoder_layers)
        for t in range(tgt.shape[1]):
            step = model.decode(tgt[:, t : t + 1], memory, mask, cache)
            assert cache.length == t + 1
            assert (step[:, 0] - full[:, t]).abs().max() < 1e-5
        # the full decode equals one uncached call per prefix too (the reference path)
        prefix = model.decode(tgt[:, :4], memory, mask)
        torch.testing.assert_close(prefix, full[:, :4], atol=1e-5, rtol=0)


# --- the loss -----------------------------------------------------------------------------


def explicit_smoothed_loss(logits: torch.Tensor, target: torch.Tensor, eps: float) -> torch.Tensor:
    """Mean over non-pad targets of -sum_j q_j log p_j, with q built as a full matrix."""
    n, vocab = logits.shape
    q = torch.full((n, vocab), eps / (vocab - 1), dtype=torch.float64)
    q[:, PAD] = 0.0  # no mass on pad
    q[torch.arange(n), target] += 1.0 - eps
    assert torch.allclose(q.sum(-1), torch.ones(n, dtype=torch.float64))
    per_token = -(q * torch.log_softmax(logits.double(), -1)).sum(-1)
    keep = target != PAD
    return per_token[keep].mean()


def test_label_smoothing_equals_explicit_distribution() -> None:
    torch.manual_seed(0)
    logits = 3 * torch.randn(10, 7)
    target = torch.tensor([3, 1, 0, 6, 2, 0, 4, 5, 1, 3])  # two pads, ignored
    n = int((target != PAD).sum())
    loss, nll = label_smoothed_cross_entropy(logits, target, 0.1, PAD)
    expected = explicit_smoothed_loss(logits, target, 0.1)
    assert abs(loss.item() / n - expected.item()) < 1e-5
    plain = F.cross_entropy(logits, target, ignore_index=PAD)
    assert abs(nll.item() / n - plain.item()) < 1e-5
    # epsilon = 0 is plain cross-entropy
    loss0, nll0 = label_smoothed_cross_entropy(logits, target, 0.0, PAD)
    torch.testing.assert_close(loss0 / n, plain)
    torch.testing.assert_close(nll0, loss0)


def test_forward_loss_is_smoothed_mean_over_target_tokens() -> None:
    for eps in (0.0, 0.1):
        model = tiny(label_smoothing=eps)
        src, mask = source_batch()
        tgt_out = torch.tensor([[5, 6, 7, EOS], [8, 9, EOS, PAD], [EOS, PAD, PAD, PAD]])
        tgt_in = torch.tensor([[BOS, 5, 6, 7], [BOS, 8, 9, PAD], [BOS, PAD, PAD, PAD]])
        with torch.no_grad():
            out = model(src, tgt_in, tgt_out, src_mask=mask)
            logits = model(src, tgt_in, src_mask=mask)["logits"]
        assert set(out) == {"loss", "nll_loss", "n_tokens"}  # no logits kept
        assert out["n_tokens"].item() == 8
        flat_logits, flat_target = logits.reshape(-1, 23), tgt_out.reshape(-1)
        expected = explicit_smoothed_loss(flat_logits, flat_target, eps)
        assert abs(out["loss"].item() - expected.item()) < 1e-5
        plain = F.cross_entropy(flat_logits, flat_target, ignore_index=PAD)
        assert abs(out["nll_loss"].item() - plain.item()) < 1e-5


@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_loss_trains_every_parameter_once(position_encoding: str) -> None:
    # With attention dropout, CPU training attention runs its own backward pass
    # (nn/attention.py: _DropoutAttention), which must reach a relative-bias table too.
    model = tiny(position_encoding=position_encoding, attention_dropout=0.1).train()
    src, mask = source_batch()
    tgt = torch.randint(3, 23, (3, 5))
    model(src, tgt, tgt, src_mask=mask)["loss"].backward()
    names = {name for name, p in model.named_parameters() if p.grad is None}
    assert not names, f"parameters without gradient: {names}"


# --- sizes, presets, config ---------------------------------------------------------------


def test_parameter_counts_match_the_paper() -> None:
    # Table 3: base 65M, big 213M, with the shared ~37k BPE vocabulary of WMT EN-DE.
    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        base = Transformer(TransformerConfig.preset("transformer-base"))
        big = Transformer(TransformerConfig.preset("transformer-big"))
    assert abs(count_parameters(base) / 65e6 - 1) < 0.04
    assert abs(count_parameters(big) / 213e6 - 1) < 0.02
    assert big.config.dropout == 0.3 and big.config.d_ff == 4096


def test_presets_and_config_round_trip(tmp_path) -> None:
    small = TransformerConfig.preset("transformer-small", src_vocab_size=8000, tgt_vocab_size=8000)
    assert (small.d_model, small.n_heads, small.n_encoder_layers) == (256, 4, 3)
    base = TransformerConfig.preset("transformer-base")
    assert (base.d_model, base.n_heads, base.d_ff, base.n_decoder_layers) == (512, 8, 2048, 6)
    assert base.label_smoothing == 0.1 and base.position_encoding == "sinusoidal"
    assert TransformerConfig.from_dict(small.to_dict()) == small
    small.save(tmp_path / "config.json")
    assert TransformerConfig.load(tmp_path / "config.json") == small


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"tgt_vocab_size": 100}, "share_embeddings"),
        ({"n_heads": 7}, "divisible"),
        ({"position_encoding": "spiral"}, "position encoding"),
        ({"norm_position": "middle"}, "norm_position"),
        ({"eos_id": 0}, "pad_id and eos_id"),
        ({"bos_id": 40000}, "bos_id"),
        ({"label_smoothing": 1.0}, "label_smoothing"),
    ],
)
def test_impossible_configs_are_refused(overrides: dict, message: str) -> None:
    with pytest.raises(AttnlabError, match=message):
        TransformerConfig(**overrides)
    with pytest.raises(AttnlabError, match="unknown preset"):
        TransformerConfig.preset("transformer-huge")


def test_too_long_input_is_a_clear_error() -> None:
    model = tiny(max_positions=8, position_encoding="rope")
    with pytest.raises(AttnlabError, match="max_positions"):
        model.encode(torch.full((1, 9), 5))


def test_ids_outside_the_vocabularies_are_a_clear_error() -> None:
    # Ids from a larger tokenizer failed as a bare IndexError inside the embedding lookup.
    from attnlab.decode import greedy_search

    model = tiny(share_embeddings=False, tgt_vocab_size=19)
    src, _ = source_batch()
    tgt = torch.randint(3, 19, (3, 4))
    with pytest.raises(AttnlabError, match=r"src_ids holds id 23, outside .* src_vocab_size 23"):
        model(src.masked_fill(src == src[0, 0], 23), tgt)
    with pytest.raises(AttnlabError, match=r"tgt_ids holds id 19, outside .* tgt_vocab_size 19"):
        model(src, tgt.masked_fill(tgt == tgt[0, 0], 19))
    with pytest.raises(AttnlabError, match="src_ids holds id 30"):
        greedy_search(model, src.masked_fill(src == src[0, 0], 30))


# --- saving shared and tied weights -------------------------------------------------------


@pytest.mark.parametrize(
    "share, tie", [(True, True), (False, True), (False, False)], ids=["shared", "tied", "untied"]
)
def test_save_load_round_trip_with_tied_weights(tmp_path, share: bool, tie: bool) -> None:
    sizes = {} if share else {"tgt_vocab_size": 19}
    model = tiny(seed=0, share_embeddings=share, tie_output=tie, **sizes)
    if share:
        assert model.target_embedding is model.src_embed
    if tie:
        assert model.output_proj is None  # the projection *is* the target embedding
    src, mask = source_batch()
    tgt = torch.randint(3, 19, (3, 5))
    with torch.no_grad():
        expected = model(src, tgt, src_mask=mask)["logits"]
    # The state holds each tensor once, so both safetensors entry points work.
    save_model(model, str(tmp_path / "a.safetensors"))
    save_file(model.state_dict(), str(tmp_path / "b.safetensors"))
    assert len(load_file(str(tmp_path / "b.safetensors"))) == len(model.state_dict())
    for name in ("a", "b"):
        fresh = tiny(seed=1, share_embeddings=share, tie_output=tie, **sizes)
        load_model(fresh, str(tmp_path / f"{name}.safetensors"), strict=True)
        with torch.no_grad():
            torch.testing.assert_close(fresh(src, tgt, src_mask=mask)["logits"], expected)
        if tie:  # training one still moves the other: the tie survived loading
            with torch.no_grad():
                fresh.target_embedding.weight[5] += torch.randn(32)
                moved = fresh(src, tgt, src_mask=mask)["logits"]
            assert (moved[..., 5] - expected[..., 5]).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"layer_norm_eps": -1e-5}, "layer_norm_eps must be >= 0"),
        ({"relative_buckets": -2}, "relative_buckets must be a positive integer"),
        ({"rope_base": -5.0}, "rope_base must be >= 1"),
        ({"rope_base": 1e-300}, "rope_base must be >= 1"),  # NaN outputs, exit 0
        # a ZeroDivisionError and an IndexError at the first forward pass
        ({"position_encoding": "relative_bias", "relative_buckets": 2}, "at least 4"),
        ({"position_encoding": "relative_bias", "relative_max_distance": 8}, "must exceed half"),
    ],
)
def test_negative_norm_and_position_settings_are_refused(setting, message) -> None:
    # A translation model's config.json with these loaded (NaN outputs) or crashed at build.
    with pytest.raises(AttnlabError, match=message):
        TransformerConfig.preset("transformer-small", **setting)


def test_embeddings_are_scaled_by_sqrt_d_model_before_the_positions() -> None:
    # Section 3.4: "we multiply those weights by sqrt(d_model)"; then the sinusoidal codes are
    # added (3.5). The encoder stack's input is checked against the formula.
    from attnlab.nn.positions import sinusoidal_table

    model = tiny(position_encoding="sinusoidal")  # eval mode: no dropout
    src, mask = source_batch()
    seen = []
    model.encoder.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(args[0]), with_kwargs=True
    )
    with torch.no_grad():
        model.encode(src, mask)
    expected = model.src_embed.weight[src] * 32**0.5 + sinusoidal_table(7, 32)
    torch.testing.assert_close(seen[0], expected)
