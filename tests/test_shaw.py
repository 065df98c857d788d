"""Shaw et al. 2018 relative position representations (the ``shaw`` scheme).

The references are the paper's equations written out element by element (numpy loops over
i and j), a two-token example worked by hand, and properties of the scheme: the position
term of a score depends only on the clipped offset clip(j - i, -k, k), so shifting a
sequence leaves its scores unchanged and every offset beyond k looks the same.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from attnlab.config import BertConfig, TransformerConfig
from attnlab.decode.cache import KVCache
from attnlab.errors import AttnlabError
from attnlab.models.bert import BertForPreTraining, BertModel
from attnlab.models.seq2seq import Transformer
from attnlab.nn.attention import (
    MultiHeadAttention,
    RelativeMultiHeadAttention,
    relative_attention,
    relative_scores,
)
from attnlab.nn.positions import RelativePositionRepresentations

D_MODEL, HEADS = 16, 4
D_HEAD = D_MODEL // HEADS


def _attention(max_distance: int, values: bool = True, seed: int = 0) -> RelativeMultiHeadAttention:
    torch.manual_seed(seed)
    attn = RelativeMultiHeadAttention(D_MODEL, HEADS, 0.0, max_distance, values).eval()
    with torch.no_grad():  # tables as large as the keys, so the position term is not ~0
        attn.relative.keys.normal_()
        if attn.relative.values is not None:
            attn.relative.values.normal_()
    return attn


def _scores(attn: RelativeMultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    """The layer's pre-softmax scores e_ij for x (batch, seq, d_model): (batch, heads, seq, seq)."""
    q, k, _ = attn.split_heads(attn.qkv_proj(x), 3)
    a_keys, _ = attn.relative(x.shape[1], x.shape[1])
    return relative_scores(q, k, a_keys)


def numpy_relation_aware_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, w_k: np.ndarray, w_v: np.ndarray | None, clip: int
) -> tuple[np.ndarray, np.ndarray]:
    """Eqs. (3) and (4) of the paper for one head, looping over i and j: (z, alpha).

    q (n_q, d) are the last n_q of the n_k positions; w_k, w_v (2 clip + 1, d) hold w_{-k..k}.
    """
    n_q, n_k, d = q.shape[0], k.shape[0], q.shape[1]
    e = np.zeros((n_q, n_k))
    for i in range(n_q):
        pos_i = n_k - n_q + i
        for j in range(n_k):
            offset = max(-clip, min(clip, j - pos_i))
            e[i, j] = q[i] @ (k[j] + w_k[offset + clip]) / math.sqrt(d)
    alpha = np.exp(e - e.max(1, keepdims=True))
    alpha /= alpha.sum(1, keepdims=True)
    z = np.zeros((n_q, d))
    for i in range(n_q):
        pos_i = n_k - n_q + i
        for j in range(n_k):
            offset = max(-clip, min(clip, j - pos_i))
            z[i] += alpha[i, j] * (v[j] + (0 if w_v is None else w_v[offset + clip]))
    return z, alpha


# --- the offsets ------------------------------------------------------------------------------


def test_offsets_are_clipped_key_minus_query_positions() -> None:
    table = RelativePositionRepresentations(D_HEAD, max_distance=2)
    got = table.offsets(5, 5)
    want = [[max(-2, min(2, j - i)) + 2 for j in range(5)] for i in range(5)]
    assert got.tolist() == want
    # a decoding step's one query is the last position: it sees offsets -4..0, clipped at -2
    assert table.offsets(1, 5).tolist() == [[0, 0, 0, 1, 2]]
    assert table.keys.shape == table.values.shape == (5, D_HEAD)


def test_keys_only_variant_has_no_value_table() -> None:
    table = RelativePositionRepresentations(D_HEAD, max_distance=3, values=False)
    a_keys, a_values = table(4, 4)
    assert a_keys.shape == (4, 4, D_HEAD) and a_values is None
    assert [name for name, _ in table.named_parameters()] == ["keys"]


# --- scores depend on the clipped offset only -------------------------------------------------


def test_position_term_depends_only_on_the_clipped_offset() -> None:
    # With one content vector at every position (q_i = q, k_j = k), e_ij differs only by
    # q a^K_ij: equal for equal clipped offsets, and every offset beyond k the same.
    clip, n = 3, 12
    attn = _attention(clip)
    x = torch.randn(1, 1, D_MODEL).expand(1, n, D_MODEL)
    with torch.no_grad():
        e = _scores(attn, x)[0]  # (heads, n, n)
    for i in range(n):
        for j in range(n):
            offset = max(-clip, min(clip, j - i))
            reference = e[:, clip, clip + offset] if offset >= 0 else e[:, n - 1, n - 1 + offset]
            torch.testing.assert_close(e[:, i, j], reference)
    far_right = e[:, 0, clip:]  # offsets 3..11, all clipped to +3
    far_left = e[:, n - 1, : n - clip]  # offsets -11..-3, all clipped to -3
    assert torch.allclose(far_right, far_right[:, :1].expand_as(far_right))
    assert torch.allclose(far_left, far_left[:, :1].expand_as(far_left))
    assert not torch.allclose(e[:, 0, 1], e[:, 0, 2])  # offsets 1 and 2 differ (within k)


@pytest.mark.parametrize("shift", [1, 5, 20])
def test_shifting_a_sequence_leaves_its_scores_unchanged(shift: int) -> None:
    # Nothing absolute enters: the same tokens after `shift` other ones score each other as
    # before, offsets beyond k included.
    attn = _attention(max_distance=4, seed=1)
    x = torch.randn(2, 10, D_MODEL)
    shifted = torch.cat((torch.randn(2, shift, D_MODEL), x), dim=1)
    with torch.no_grad():
        e = _scores(attn, x)
        e_shifted = _scores(attn, shifted)[..., shift:, shift:]
    torch.testing.assert_close(e_shifted, e, atol=1e-5, rtol=1e-5)


# --- against the equations ---------------------------------------------------------------------


@pytest.mark.parametrize("values", [True, False])
@pytest.mark.parametrize("q_len", [7, 2])  # the full sequence; the last two, as after a cache
def test_relative_attention_matches_the_paper_equations(values: bool, q_len: int) -> None:
    torch.manual_seed(2)
    clip, k_len = 2, 7
    q = torch.randn(1, 1, q_len, D_HEAD, dtype=torch.float64)
    k, v = torch.randn(2, 1, 1, k_len, D_HEAD, dtype=torch.float64)
    table = RelativePositionRepresentations(D_HEAD, clip, values).double()
    with torch.no_grad():
        table.keys.normal_()
        if values:
            table.values.normal_()
        a_keys, a_values = table(q_len, k_len)
        out, weights = relative_attention(q, k, v, a_keys, a_values)
    w_v = table.values.detach().numpy() if values else None
    z, alpha = numpy_relation_aware_attention(
        q[0, 0].numpy(), k[0, 0].numpy(), v[0, 0].numpy(), table.keys.detach().numpy(), w_v, clip
    )
    np.testing.assert_allclose(weights[0, 0].numpy(), alpha, atol=1e-12)
    np.testing.assert_allclose(out[0, 0].numpy(), z, atol=1e-12)


def test_two_tokens_by_hand() -> None:
    # d_model = d_head = 1, one head, every projection the identity, k = 1; x = (1, 2), so
    # q = k = v = (1, 2). Tables w_{-1, 0, 1}: w^K = (0.5, 0, -0.5), w^V = (-1, 0, 0.5).
    #   e_00 = 1 (1 + 0) = 1      e_01 = 1 (2 - 0.5) = 1.5
    #   e_10 = 2 (1 + 0.5) = 3    e_11 = 2 (2 + 0) = 4
    #   alpha_0 = softmax(1, 1.5) = (0.3775407, 0.6224593)
    #   alpha_1 = softmax(3, 4) = (0.2689414, 0.7310586)
    #   z_0 = 0.3775407 (1 + 0) + 0.6224593 (2 + 0.5) = 1.9336890
    #   z_1 = 0.2689414 (1 - 1) + 0.7310586 (2 + 0) = 1.4621172
    attn = RelativeMultiHeadAttention(1, 1, 0.0, max_distance=1, bias=False).eval()
    with torch.no_grad():
        attn.qkv_proj.weight.fill_(1.0)
        attn.out_proj.weight.fill_(1.0)
        attn.relative.keys.copy_(torch.tensor([[0.5], [0.0], [-0.5]]))
        attn.relative.values.copy_(torch.tensor([[-1.0], [0.0], [0.5]]))
        out, weights = attn(torch.tensor([[[1.0], [2.0]]]), need_weights=True)
    torch.testing.assert_close(
        weights[0, 0], torch.tensor([[0.3775407, 0.6224593], [0.2689414, 0.7310586]])
    )
    torch.testing.assert_close(out[0, :, 0], torch.tensor([1.9336890, 1.4621172]))


def test_tables_are_shared_by_the_heads_and_own_to_each_layer() -> None:
    config = BertConfig.preset("bert-tiny", vocab_size=50, position_encoding="shaw")
    model = BertModel(config)
    tables = [layer.self_attn.relative for layer in model.encoder.layers]
    assert len(tables) == config.n_layers and tables[0] is not tables[1]
    k = config.shaw_max_distance
    assert tables[0].keys.shape == (2 * k + 1, config.d_head)  # one vector per offset, no head axis


# --- training ------------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [True, False])
def test_gradients_reach_the_relative_tables(values: bool) -> None:
    attn = _attention(max_distance=2, values=values).train()
    x = torch.randn(2, 6, D_MODEL)
    out, _ = attn(x, causal=True)
    out.square().sum().backward()
    assert attn.relative.keys.grad is not None and attn.relative.keys.grad.abs().sum() > 0
    if values:
        assert attn.relative.values.grad.abs().sum() > 0
    # with 6 positions and k = 2 every offset from -2 to 0 is used; the causal mask hides the
    # future, so offsets +1 and +2 get no gradient
    used = attn.relative.keys.grad.abs().sum(-1)
    assert (used[:3] > 0).all() and (used[3:] == 0).all()


def test_a_shaw_seq2seq_model_learns_to_reverse() -> None:
    # Reversing needs positions; the model has no other source of them.
    torch.manual_seed(0)
    config = TransformerConfig(
        src_vocab_size=12, tgt_vocab_size=12, d_model=32, n_heads=4, d_ff=64,
        n_encoder_layers=1, n_decoder_layers=1, dropout=0.0, label_smoothing=0.0,
        position_encoding="shaw", shaw_max_distance=8,
    )  # fmt: skip
    model = Transformer(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        src = torch.randint(3, 12, (16, 6))
        tgt = src.flip(1)
        bos = torch.full((16, 1), config.bos_id)
        eos = torch.full((16, 1), config.eos_id)
        loss = model(src, torch.cat((bos, tgt), 1), torch.cat((tgt, eos), 1))["loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5


def test_a_shaw_bert_pretraining_loss_falls() -> None:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_positions=16,
        position_encoding="shaw", shaw_max_distance=4, dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    model = BertForPreTraining(config, sentence_head=False).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    ids = torch.randint(5, 30, (8, 12))
    labels = torch.full_like(ids, -100)
    labels[:, ::3] = ids[:, ::3]
    masked = ids.clone()
    masked[:, ::3] = 4
    losses = []
    for _ in range(40):
        loss = model(masked, mlm_labels=labels)["loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0]


# --- decoding and the fast twins ------------------------------------------------------------------


def _seq2seq(**overrides) -> Transformer:
    torch.manual_seed(0)
    config = TransformerConfig(
        src_vocab_size=20, tgt_vocab_size=20, d_model=32, n_heads=4, d_ff=64,
        n_encoder_layers=2, n_decoder_layers=2, position_encoding="shaw", shaw_max_distance=3,
        **overrides,
    )  # fmt: skip
    model = Transformer(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RelativePositionRepresentations):
                module.keys.normal_()
                if module.values is not None:
                    module.values.normal_()
    return model


def test_cached_decoding_equals_the_full_pass() -> None:
    model = _seq2seq()
    src = torch.randint(3, 20, (3, 9))
    tgt = torch.randint(3, 20, (3, 8))  # 8 positions: offsets reach past k = 3
    mask = torch.ones_like(src, dtype=torch.bool)
    with torch.no_grad():
        memory = model.encode(src, mask)
        full = model.decode(tgt, memory, mask)
        cache, steps = KVCache(n_layers=2), []
        for t in range(tgt.shape[1]):
            steps.append(model.decode(tgt[:, t : t + 1], memory, mask, cache=cache))
        # two positions at once after the cache, as a prefix then a continuation
        cache2 = KVCache(n_layers=2)
        first = model.decode(tgt[:, :5], memory, mask, cache=cache2)
        rest = model.decode(tgt[:, 5:], memory, mask, cache=cache2)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat((first, rest), 1), full, atol=1e-5, rtol=1e-5)


def test_search_with_a_cache_equals_search_without_and_the_twins_change_nothing() -> None:
    # Greedy and beam search reorder and drop cached rows as sentences end; with Shaw's
    # offsets counted from each new query they must choose what full passes choose.
    from attnlab import fast
    from attnlab.decode.search import beam_search, greedy_search

    model = _seq2seq(eos_id=2)
    src = torch.randint(3, 20, (4, 7))
    settings = dict(max_len_a=0.0, max_len_b=9)
    with torch.no_grad():
        greedy = greedy_search(model, src, **settings)
        assert greedy == greedy_search(model, src, use_cache=False, **settings)
        beams = beam_search(model, src, beam_size=3, **settings)
        assert beams == beam_search(model, src, beam_size=3, use_cache=False, **settings)
        with fast.inference_twins(model, "all"):
            assert greedy_search(model, src, **settings) == greedy
            assert beam_search(model, src, beam_size=3, **settings) == beams
    assert any(len(ids) > 3 for ids in greedy)  # past k = 3, where offsets clip


def test_fast_twins_leave_shaw_attention_on_its_plain_path() -> None:
    from attnlab import fast

    config = BertConfig(
        vocab_size=40, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_positions=32,
        position_encoding="shaw", shaw_max_distance=3, attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = BertModel(config).eval()
    ids = torch.randint(1, 40, (2, 10))
    keep = torch.zeros_like(ids, dtype=torch.bool)
    keep[:, [0, 4, 9]] = True
    with torch.no_grad():
        want = model(ids).last_hidden_state
        fast.for_training(model, "all")
        fast.for_inference(model, "all")
        assert all(
            type(layer.self_attn) is RelativeMultiHeadAttention for layer in model.encoder.layers
        )
        got = model(ids).last_hidden_state
        kept = model(ids, keep=keep).last_hidden_state
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kept, want[keep], atol=1e-5, rtol=1e-5)


def test_other_schemes_keep_plain_attention() -> None:
    model = BertModel(BertConfig.preset("bert-tiny", vocab_size=50))
    assert all(type(layer.self_attn) is MultiHeadAttention for layer in model.encoder.layers)


# --- configuration and checkpoints -------------------------------------------------------------


def test_config_refuses_a_clipping_distance_below_one() -> None:
    with pytest.raises(AttnlabError, match="shaw_max_distance must be a positive integer"):
        BertConfig(position_encoding="shaw", shaw_max_distance=0)
    with pytest.raises(AttnlabError, match="shaw_values must be true or false"):
        TransformerConfig.from_dict({"position_encoding": "shaw", "shaw_values": 1})


def test_a_shaw_bert_saves_and_loads_with_its_tables(tmp_path) -> None:
    from attnlab.interop.hf import load_bert, save_bert

    config = BertConfig.preset(
        "bert-tiny", vocab_size=50, position_encoding="shaw", shaw_max_distance=5, shaw_values=False
    )
    torch.manual_seed(0)
    model = BertForPreTraining(config).eval()
    save_bert(model, tmp_path / "ckpt")
    again = load_bert(tmp_path / "ckpt", heads=True, trained_heads=True)
    assert again.config.shaw_max_distance == 5 and again.config.shaw_values is False
    ids = torch.randint(1, 50, (2, 9))
    with torch.no_grad():
        assert torch.equal(again(ids)["mlm_logits"], model(ids)["mlm_logits"])


def test_a_shaw_gpt_decodes_with_a_cache_as_without_and_saves(tmp_path) -> None:
    gpt = pytest.importorskip("attnlab.models.gpt")
    from attnlab.config import GPTConfig
    from attnlab.interop.gpt2 import load_gpt, save_gpt

    torch.manual_seed(0)
    config = GPTConfig.preset(
        "gpt-char", vocab_size=30, n_layers=2, d_model=32, n_heads=4, d_ff=64,
        position_encoding="shaw", shaw_max_distance=3,
    )  # fmt: skip
    model = gpt.GPT(config).eval()
    assert all(type(layer.self_attn) is RelativeMultiHeadAttention for layer in model.layers)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RelativePositionRepresentations):
                module.keys.normal_()
                module.values.normal_()
        ids = torch.randint(0, 30, (2, 9))
        full = model(ids).logits
        cache, steps = model.new_cache(), []
        for t in range(ids.shape[1]):
            steps.append(model(ids[:, t : t + 1], cache=cache).logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    save_gpt(model, tmp_path / "gpt")
    again = load_gpt(tmp_path / "gpt").eval()
    assert again.config.shaw_max_distance == 3
    with torch.no_grad():
        assert torch.equal(again(ids).logits, full)
