"""Transformer blocks (attnlab.nn.blocks): FFN formula, LayerNorm placement, masking, caching.

Causality and padding are checked as properties (perturb what must not matter, see nothing
move; perturb what must matter, see it move); cached decoding against the full pass.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.decode.cache import KVCache
from attnlab.fast import INFERENCE, TRAINING, chosen, swap
from attnlab.fast.attention import FastEncoder, FastMultiHeadAttention
from attnlab.nn.attention import padding_bias
from attnlab.nn.blocks import Decoder, DecoderLayer, Encoder, EncoderLayer, FeedForward
from attnlab.nn.positions import RotaryPositions, sinusoidal_table

D_MODEL, N_HEADS, D_FF = 16, 2, 32
D_HEAD = D_MODEL // N_HEADS
LAYER = dict(d_model=D_MODEL, n_heads=N_HEADS, d_ff=D_FF)
NORMS = ["post", "pre"]


pytestmark = pytest.mark.usefixtures("one_thread")


def erf(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf)(x)


NUMPY_ACTIVATIONS = {
    "relu": lambda h: np.maximum(h, 0.0),
    "gelu": lambda h: 0.5 * h * (1.0 + erf(h / math.sqrt(2.0))),
    "gelu_tanh": lambda h: (
        0.5 * h * (1.0 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
    ),
}


@pytest.mark.parametrize("activation", NUMPY_ACTIVATIONS)
def test_feed_forward_equals_numpy_formula(activation: str) -> None:
    torch.manual_seed(0)
    ffn = FeedForward(D_MODEL, D_FF, activation)
    x = torch.randn(2, 3, D_MODEL)
    with torch.no_grad():
        out = ffn(x)
    w1, b1 = ffn.fc1.weight.double().detach().numpy(), ffn.fc1.bias.double().detach().numpy()
    w2, b2 = ffn.fc2.weight.double().detach().numpy(), ffn.fc2.bias.double().detach().numpy()
    act = NUMPY_ACTIVATIONS[activation]
    expected = act(x.double().numpy() @ w1.T + b1) @ w2.T + b2
    np.testing.assert_allclose(out.numpy(), expected, atol=1e-5)
    # each position alone: the FFN never mixes positions
    with torch.no_grad():
        torch.testing.assert_close(ffn(x[:, 1:2]), out[:, 1:2])


# --- LayerNorm placement ----------------------------------------------------------------------


def test_post_ln_output_is_normalized_and_pre_ln_is_not() -> None:
    torch.manual_seed(0)
    x = 3.0 + 5.0 * torch.randn(2, 5, D_MODEL)  # far from zero mean / unit std
    post = EncoderLayer(**LAYER, norm_position="post").eval()
    pre = EncoderLayer(**LAYER, norm_position="pre").eval()
    with torch.no_grad():
        y_post, _ = post(x)
        y_pre, _ = pre(x)
    # post-LN ends with LayerNorm (weight 1, bias 0 at init): every position standardised
    torch.testing.assert_close(y_post.mean(-1), torch.zeros(2, 5), atol=1e-5, rtol=0)
    torch.testing.assert_close(y_post.var(-1, unbiased=False), torch.ones(2, 5), atol=1e-3, rtol=0)
    # pre-LN adds to the raw residual stream, so the input's scale survives
    assert y_pre.mean(-1).abs().min() > 0.5
    assert (y_pre.std(-1) - 1).abs().min() > 0.5


@pytest.mark.parametrize("norm_position", NORMS)
def test_layers_follow_the_residual_and_layernorm_formulas(norm_position: str) -> None:
    # post-LN (the paper, 3.1): y = LN(x + Sublayer(x)); pre-LN (Xiong et al. 2020):
    # y = x + Sublayer(LN(x)); composed here from the layers' own sublayers, in eval mode.
    torch.manual_seed(1)
    x = torch.randn(2, 5, D_MODEL)
    memory = torch.randn(2, 3, D_MODEL)
    enc = EncoderLayer(**LAYER, norm_position=norm_position).eval()
    dec = DecoderLayer(**LAYER, norm_position=norm_position).eval()
    for layer in (enc, dec):  # LayerNorms that are not the identity
        for norm in (m for m in layer.modules() if isinstance(m, nn.LayerNorm)):
            nn.init.normal_(norm.weight, 1.0, 0.2)
            nn.init.normal_(norm.bias, 0.0, 0.2)

    def block(h: Tensor, sublayer, norm: nn.LayerNorm) -> Tensor:
        return norm(h + sublayer(h)) if norm_position == "post" else h + sublayer(norm(h))

    with torch.no_grad():
        h = block(x, lambda t: enc.self_attn(t)[0], enc.norm1)
        torch.testing.assert_close(enc(x)[0], block(h, enc.ffn, enc.norm2))
        h = block(x, lambda t: dec.self_attn(t, causal=True)[0], dec.norm1)
        h = block(h, lambda t: dec.cross_attn(t, memory)[0], dec.norm2)
        torch.testing.assert_close(dec(x, memory)[0], block(h, dec.ffn, dec.norm3))


@pytest.mark.parametrize("norm_position", NORMS)
def test_pre_ln_stacks_end_with_final_norm_and_post_ln_do_not(norm_position: str) -> None:
    enc = Encoder(2, norm_position, **LAYER)
    dec = Decoder(2, norm_position, **LAYER)
    assert len(enc.layers) == len(dec.layers) == 2
    for stack in (enc, dec):
        if norm_position == "pre":
            assert isinstance(stack.final_norm, nn.LayerNorm)
        else:
            assert stack.final_norm is None
    torch.manual_seed(0)
    x = 3.0 + 5.0 * torch.randn(1, 4, D_MODEL)
    with torch.no_grad():
        y, hidden, weights = enc.eval()(x, need_weights=True, output_hidden_states=True)
    # either way the stack's output is normalised: by the last layer (post) or final_norm (pre)
    torch.testing.assert_close(y.mean(-1), torch.zeros(1, 4), atol=1e-5, rtol=0)
    assert len(hidden) == 3 and torch.equal(hidden[0], x) and torch.equal(hidden[-1], y)
    assert len(weights) == 2 and weights[0].shape == (1, N_HEADS, 4, 4)


# --- the encoder layer and padding ------------------------------------------------------------


@pytest.mark.parametrize("norm_position", NORMS)
def test_encoder_layer_ignores_padded_positions(norm_position: str) -> None:
    torch.manual_seed(0)
    layer = EncoderLayer(**LAYER, norm_position=norm_position).eval()
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    bias = padding_bias(mask, torch.float32)
    x = torch.randn(2, 5, D_MODEL)
    x2 = x.clone()
    x2[1, 3:] = 100 * torch.randn(2, D_MODEL)
    with torch.no_grad():
        y, w = layer(x, bias=bias, need_weights=True)
        y2, _ = layer(x2, bias=bias)
        # without the bias the padded inputs do leak in
        y_unmasked, _ = layer(x2)
    torch.testing.assert_close(y2[:, :3], y[:, :3], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(y2[0], y[0], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(y_unmasked[1, :3], y[1, :3], atol=1e-3)
    assert torch.all(w[1, :, :, 3:] == 0)


# --- the decoder: causality and cached decoding -----------------------------------------------


def make_decoder(norm_position: str, n_layers: int = 2, seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(n_layers, norm_position, **LAYER).eval()


def rope_for(positions: Tensor) -> tuple[Tensor, Tensor]:
    return RotaryPositions(D_HEAD).rotary(positions)


@pytest.mark.parametrize("use_rope", [False, True])
@pytest.mark.parametrize("norm_position", NORMS)
def test_decoder_output_at_t_ignores_later_targets(norm_position: str, use_rope: bool) -> None:
    dec = make_decoder(norm_position)
    torch.manual_seed(1)
    tgt_len, t = 6, 2
    x, memory = torch.randn(2, tgt_len, D_MODEL), torch.randn(2, 5, D_MODEL)
    rope = rope_for(torch.arange(tgt_len)) if use_rope else None
    later, earlier = x.clone(), x.clone()
    later[:, t + 1 :] += 3 * torch.randn(2, tgt_len - t - 1, D_MODEL)
    earlier[:, t - 1] += 3 * torch.randn(2, D_MODEL)
    with torch.no_grad():
        y, _, _ = dec(x, memory, rope=rope)
        y_later, _, _ = dec(later, memory, rope=rope)
        y_earlier, _, _ = dec(earlier, memory, rope=rope)
    torch.testing.assert_close(y_later[:, : t + 1], y[:, : t + 1], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(y_later[:, t + 1 :], y[:, t + 1 :], atol=1e-3)
    torch.testing.assert_close(y_earlier[:, : t - 1], y[:, : t - 1], atol=1e-6, rtol=1e-6)
    assert (y_earlier[:, t] - y[:, t]).abs().max() > 1e-3  # the past does reach position t


@pytest.mark.parametrize("use_rope", [False, True])
@pytest.mark.parametrize("norm_position", NORMS)
def test_cached_decoder_equals_full_pass(norm_position: str, use_rope: bool) -> None:
    n_layers = 2
    dec = make_decoder(norm_position, n_layers)
    torch.manual_seed(2)
    tgt_len = 6
    x, memory = torch.randn(2, tgt_len, D_MODEL), torch.randn(2, 5, D_MODEL)
    memory_bias = padding_bias(torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]), x.dtype)
    rope = rope_for(torch.arange(tgt_len)) if use_rope else None
    cache = KVCache(n_layers)
    with torch.no_grad():
        full, full_self_w, full_cross_w = dec(
            x, memory, memory_bias=memory_bias, rope=rope, need_weights=True
        )
        steps = []
        for t in range(tgt_len):
            step_rope = rope_for(torch.tensor([t])) if use_rope else None
            # after the first step the memory is read from the cache only
            mem = memory if t == 0 else None
            y, self_w, cross_w = dec(
                x[:, t : t + 1],
                mem,
                memory_bias=memory_bias,
                rope=step_rope,
                cache=cache,
                need_weights=True,
            )
            steps.append(y)
            assert cache.length == t + 1
            assert self_w[0].shape == (2, N_HEADS, 1, t + 1)
            torch.testing.assert_close(self_w[-1][:, :, 0], full_self_w[-1][:, :, t, : t + 1])
            torch.testing.assert_close(cross_w[-1][:, :, 0], full_cross_w[-1][:, :, t])
    assert (torch.cat(steps, 1) - full).abs().max() < 1e-5
    for i in range(n_layers):
        assert cache.self_kv[i].kv[0].shape == (2, N_HEADS, tgt_len, D_HEAD)
        assert cache.cross_kv[i][0].shape == (2, N_HEADS, 5, D_HEAD)


def test_decoder_layer_attends_to_memory_and_respects_memory_padding() -> None:
    torch.manual_seed(3)
    layer = DecoderLayer(**LAYER).eval()
    x, memory = torch.randn(2, 3, D_MODEL), torch.randn(2, 5, D_MODEL)
    bias = padding_bias(torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]), x.dtype)
    other = memory.clone()
    other[1, 3:] = 50 * torch.randn(2, D_MODEL)
    with torch.no_grad():
        y, _, cross_w = layer(x, memory, memory_bias=bias, need_weights=True)
        y_pad, _, _ = layer(x, other, memory_bias=bias)
        y_mem, _, _ = layer(x, memory + 1.0, memory_bias=bias)
    torch.testing.assert_close(y_pad, y, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(y_mem, y, atol=1e-3)  # the memory does matter
    assert torch.all(cross_w[1, :, :, 3:] == 0)
    torch.testing.assert_close(cross_w.sum(-1), torch.ones(2, N_HEADS, 3))


# --- it learns --------------------------------------------------------------------------------


class TinySeq2Seq(nn.Module):
    """Embeddings + sinusoidal positions, 1-layer encoder and decoder, tied output projection."""

    def __init__(self, vocab: int, norm_position: str) -> None:
        super().__init__()
        layer = dict(LAYER, dropout=0.0)
        self.embed = nn.Embedding(vocab, D_MODEL)
        self.register_buffer("pe", sinusoidal_table(16, D_MODEL), persistent=False)
        self.encoder = Encoder(1, norm_position, **layer)
        self.decoder = Decoder(1, norm_position, **layer)

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        scale = math.sqrt(D_MODEL)
        memory, _, _ = self.encoder(self.embed(src) * scale + self.pe[: src.shape[1]])
        h, _, _ = self.decoder(self.embed(tgt_in) * scale + self.pe[: tgt_in.shape[1]], memory)
        return h @ self.embed.weight.T


@pytest.mark.parametrize("norm_position", NORMS)
def test_tiny_encoder_decoder_learns_to_copy(norm_position: str) -> None:
    torch.manual_seed(0)
    vocab, bos, seq = 10, 0, 5
    model = TinySeq2Seq(vocab, norm_position)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    src = torch.randint(1, vocab, (32, seq))
    tgt_in = torch.cat((torch.full((32, 1), bos), src[:, :-1]), 1)  # teacher forcing
    losses = []
    for _ in range(50):
        logits = model(src, tgt_in)
        loss = F.cross_entropy(logits.reshape(-1, vocab), src.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 1.8  # about log(9) at the start
    assert losses[-1] < 0.5 * losses[0]
    assert sum(losses[-5:]) < sum(losses[:5])


# --- the fast encoder: the last layer at the kept positions only -------------------------------


@pytest.mark.parametrize("share_layers", [False, True])
@pytest.mark.parametrize("use_rope", [False, True])
@pytest.mark.parametrize("norm_position", NORMS)
def test_fast_encoder_with_keep_equals_plain(
    norm_position: str, use_rope: bool, share_layers: bool
) -> None:
    # The plain encoder computes every position and returns full[keep]; the twin computes only
    # the kept rows in its last layer. Same values and gradients (no dropout, which the two
    # would draw for different shapes).
    torch.manual_seed(31)
    plain = Encoder(
        3, norm_position, share_layers=share_layers, **LAYER, dropout=0.0, attention_dropout=0.0
    ).train()
    twin = swap(copy.deepcopy(plain), chosen(TRAINING, "attention,kept_rows"))
    assert isinstance(twin, FastEncoder)
    x = torch.randn(3, 9, D_MODEL, requires_grad=True)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 6:] = 0
    keep = torch.rand(3, 9) < 0.4
    keep[:, 0] = True
    keep[2] = True  # one row keeps every position: the others' query lists are padded
    rope = RotaryPositions(D_HEAD).rotary(torch.arange(9)) if use_rope else None
    upstream = torch.randn(int(keep.sum()), D_MODEL)
    results = []
    for encoder in (plain, twin):
        out, _, _ = encoder(x, bias=padding_bias(mask, x.dtype), rope=rope, keep=keep)
        assert out.shape == (int(keep.sum()), D_MODEL)
        results.append((out, torch.autograd.grad(out, [x, *encoder.parameters()], upstream)))
    (a, a_grads), (b, b_grads) = results
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for ga, gb in zip(a_grads, b_grads, strict=True):
        torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-5)


# --- the unpadded encoder: no layer computes padding ---------------------------------------------


def _padded_batch() -> tuple[Tensor, Tensor]:
    """x (3, 9, D_MODEL) and its 0/1 mask: one full row, two rows ending in padding."""
    x = torch.randn(3, 9, D_MODEL)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, 5:] = 0
    mask[2, 2:] = 0
    return x, mask


KEEPS = {
    "every real token": lambda mask: mask.bool(),
    "[CLS] alone": lambda mask: torch.arange(mask.shape[1]) == 0,
    "a padding position too": lambda mask: mask.bool() | (torch.arange(mask.shape[1]) == 7),
}


@pytest.mark.parametrize("keep_name", list(KEEPS))
@pytest.mark.parametrize("share_layers", [False, True])
@pytest.mark.parametrize("use_rope", [False, True])
@pytest.mark.parametrize("norm_position", NORMS)
def test_unpadded_encoder_equals_plain_and_computes_no_padding(
    monkeypatch, norm_position: str, use_rope: bool, share_layers: bool, keep_name: str
) -> None:
    # The plain encoder computes every position and returns full[keep]. The twin computes the
    # real tokens (and the kept positions) only, in every layer: its layers see fewer rows.
    import attnlab.fast.attention as fast_attention

    torch.manual_seed(33)
    plain = Encoder(3, norm_position, share_layers=share_layers, **LAYER, dropout=0.1).eval()
    twin = swap(copy.deepcopy(plain), chosen(INFERENCE, "all"))
    assert isinstance(twin, fast_attention.UnpaddedEncoder)
    x, mask = _padded_batch()
    keep = KEEPS[keep_name](mask).expand_as(mask)
    rows_seen = []
    unpadded_layer = fast_attention.unpadded_layer

    def counting(layer: EncoderLayer, rows: Tensor, *args, **kwargs) -> Tensor:
        rows_seen.append(len(rows))
        return unpadded_layer(layer, rows, *args, **kwargs)

    monkeypatch.setattr(fast_attention, "unpadded_layer", counting)
    rope = RotaryPositions(D_HEAD).rotary(torch.arange(9)) if use_rope else None
    with torch.no_grad():
        want = plain(x, bias=padding_bias(mask, x.dtype), rope=rope, keep=keep)[0]
        got = twin(x, bias=padding_bias(mask, x.dtype), rope=rope, keep=keep)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert rows_seen == [int((mask.bool() | keep).sum())] * 3  # 16 (or 18) of 27 positions


def test_unpadded_encoder_keeps_the_general_path_where_it_does_not_serve(monkeypatch) -> None:
    # Training (dropout), a positional bias per query, no padding and no keep all take the
    # plain computation, with the same result as the plain encoder.
    import attnlab.fast.attention as fast_attention

    monkeypatch.setattr(fast_attention, "unpadded_layer", None)  # any use fails
    torch.manual_seed(34)
    plain = Encoder(2, **LAYER, dropout=0.0).eval()
    twin = swap(copy.deepcopy(plain), chosen(INFERENCE, "all"))
    x, mask = _padded_batch()
    keep, bias = mask.bool(), padding_bias(mask, x.dtype)
    per_query = bias + torch.randn(1, N_HEADS, 9, 9)  # e.g. ALiBi on top of the padding
    no_padding = padding_bias(torch.ones_like(mask), x.dtype)
    with torch.no_grad():
        for args in ((bias, None), (per_query, keep), (no_padding, keep)):
            torch.testing.assert_close(twin(x, *args[:1], keep=args[1])[0],
                                       plain(x, *args[:1], keep=args[1])[0])  # fmt: skip
        twin.train(), plain.train()
        torch.testing.assert_close(twin(x, bias, keep=keep)[0], plain(x, bias, keep=keep)[0])


def test_fast_encoder_layer_without_a_fast_attention_computes_every_row() -> None:
    # kept_rows chosen alone: the layer cannot ask its plain attention for some rows, so it
    # computes them all and keeps the rows asked for.
    torch.manual_seed(32)
    plain = Encoder(2, **LAYER, dropout=0.0).eval()
    twin = swap(copy.deepcopy(plain), chosen(TRAINING, "kept_rows"))
    assert not isinstance(twin.layers[0].self_attn, FastMultiHeadAttention)
    x, keep = torch.randn(2, 5, D_MODEL), torch.tensor([[1, 0, 1, 0, 0], [1, 1, 1, 1, 0]]) > 0
    with torch.no_grad():
        torch.testing.assert_close(twin(x, keep=keep)[0], plain(x)[0][keep])
