"""GPT: the decoder-only Transformer language model (Radford et al. 2018; GPT-2, 2019).

Read top to bottom like GPT-2's section 2.3 and nanoGPT's model.py:
token embedding + position (learned absolute, GPT-2's; any scheme of ``nn/positions.py``),
dropout; N pre-LN blocks of masked self-attention and a feed-forward network (the encoder
layer of ``nn/blocks.py`` run causally: no cross-attention); a final LayerNorm; the LM head,
the token embedding matrix transposed (tied, as GPT-2). The model predicts token t + 1 from
tokens 0..t: p(x_{t+1} | x_{<=t}) = softmax(h_t W_e^T).

Parameter shapes match HF transformers' ``GPT2LMHeadModel`` up to its Conv1D transposes, so
checkpoints map one-to-one (``attnlab.interop.gpt2``). Incremental decoding keeps the past
keys and values in a ``GPTCache``; left-padded batches give each row positions counted from
its first real token, as HF's ``generate`` does.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.config import GPTConfig
from attnlab.decode.cache import HeadMajorKVBuffer, KVCache
from attnlab.errors import AttnlabError, check_id_range, check_token_batch
from attnlab.nn.attention import padding_bias
from attnlab.nn.blocks import EncoderLayer
from attnlab.nn.positions import build_position_encoding


class GPTOutput(dict):
    """What GPT.forward returns: a dict (the trainer reads ``["loss"]``) with attribute access.

    Keys present: ``logits`` (batch, seq, vocab); ``loss`` (0-d, mean next-token cross-entropy)
    when targets were given; ``attentions`` (per layer (batch, heads, seq, keys)) when asked.
    """

    @property
    def logits(self) -> Tensor:
        """(batch, seq, vocab): unnormalised next-token scores at every position."""
        return self["logits"]

    @property
    def loss(self) -> Tensor | None:
        """Mean cross-entropy over the targets that are not -100, or None without targets."""
        return self.get("loss")

    @property
    def attentions(self) -> list[Tensor] | None:
        """Attention weights per layer, (batch, heads, seq, keys), or None unless asked."""
        return self.get("attentions")


class GPTCache(KVCache):
    """Past keys and values per layer (``KVCache``), and which past positions are padding.

    ``key_mask`` (batch, length) is 1 at real tokens and 0 at (left) padding, or None while
    every cached position is real: a later step's queries must not attend to the pads, and
    its positions count real tokens only. Keys and values are stored head-major, as sampling
    reads them (``HeadMajorKVBuffer``).
    """

    def __init__(self, n_layers: int) -> None:
        super().__init__(n_layers, buffer=HeadMajorKVBuffer)
        self.key_mask: Tensor | None = None

    def reorder(self, index: Tensor, cross_index: Tensor | None = None) -> None:
        """Keep/duplicate batch rows by index (keys, values and the padding mask alike)."""
        super().reorder(index, cross_index)
        if self.key_mask is not None:
            self.key_mask = self.key_mask.index_select(0, index)


class GPTBlock(EncoderLayer):
    """A pre-LN decoder block: x + Attn(LN(x)) with the causal mask, then x + FFN(LN(x)).

    The encoder layer's modules and names (self_attn, norm1, ffn, norm2), run causally and
    with a key/value cache; GPT-2's ln_1, attn, ln_2, mlp.
    """

    def forward(
        self,
        x: Tensor,
        bias: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        cache: KVCache | None = None,
        index: int = 0,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """x (batch, seq, d_model) -> (same shape, weights (batch, heads, seq, keys) or None).

        With a cache, x holds only the new positions; slot ``index`` is read and extended.
        """
        h = self.attn_residual.sublayer_input(x)
        h, weights = self.self_attn(
            h, bias=bias, causal=True, rope=rope, cache=cache, layer=index,
            need_weights=need_weights,
        )  # fmt: skip
        x = self.attn_residual(x, h)
        return self.ffn_residual(x, self.ffn(self.ffn_residual.sublayer_input(x))), weights


class GPT(nn.Module):
    """Decoder-only Transformer LM: embeddings, N causal pre-LN blocks, final LN, tied LM head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = c = config
        self.embed = nn.Embedding(c.vocab_size, c.d_model)  # W_e, GPT-2's wte
        self.positions = build_position_encoding(
            c.position_encoding,
            c.d_model,
            c.n_heads,
            c.max_positions,
            bidirectional=False,  # a token sees only the past
            relative_buckets=c.relative_buckets,
            relative_max_distance=c.relative_max_distance,
            rope_base=c.rope_base,
        )
        self.dropout = nn.Dropout(c.dropout)
        self.layers = nn.ModuleList(GPTBlock(**block_args(c)) for _ in range(c.n_layers))
        self.final_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_eps)
        # Tied: the head is W_e itself (no second tensor); untied: its own (vocab, d_model).
        self.lm_head = None if c.tie_embeddings else nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.apply(self.init_weights)
        self.init_residual_projections()

    def init_weights(self, module: nn.Module) -> None:
        """GPT-2's initialisation: N(0, 0.02) weights, zero biases, LayerNorm as the identity."""
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def init_residual_projections(self) -> None:
        """GPT-2 section 2.3: the projections into the residual stream get std 0.02 / sqrt(2N).

        Each block adds two branches (attention, FFN) to the stream; the scale keeps its
        variance from growing with depth.
        """
        std = self.config.initializer_range / math.sqrt(2 * self.config.n_layers)
        for layer in self.layers:
            nn.init.normal_(layer.self_attn.out_proj.weight, std=std)
            nn.init.normal_(layer.ffn.fc2.weight, std=std)

    def output_weight(self) -> Tensor:
        """The LM head's (vocab, d_model) matrix: the token embedding when tied."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def project(self, hidden: Tensor) -> Tensor:
        """Final hidden states (..., d_model) -> next-token logits (..., vocab_size)."""
        return F.linear(hidden, self.output_weight())

    def new_cache(self) -> GPTCache:
        """An empty key/value cache for incremental decoding with this model."""
        return GPTCache(self.config.n_layers)

    def forward(
        self,
        input_ids: Tensor,
        targets: Tensor | None = None,
        cache: GPTCache | None = None,
        need_weights: bool = False,
        attention_mask: Tensor | None = None,
        last_only: bool = False,
    ) -> GPTOutput:
        """Next-token logits for input_ids (batch, seq); the loss when targets are given.

        ``targets[b, t]`` is the token after ``input_ids[b, t]`` (already shifted), -100 where
        not scored. ``attention_mask`` is 1 at real tokens, 0 at left padding: (batch, seq) of
        these tokens, or (batch, cached + seq) including the cached ones. With a cache,
        input_ids are the positions after those cached, which the call appends to the cache.
        ``last_only`` computes the logits of the last position only, (batch, 1, vocab): all a
        decoding step reads (not with targets).
        """
        past = self._check_inputs(input_ids, targets, cache, attention_mask)
        if last_only and targets is not None:
            raise AttnlabError("last_only computes one position's logits: no loss with targets")
        seq_len = input_ids.shape[1]
        key_mask = self._key_mask(input_ids, past, cache, attention_mask)
        positions = _position_ids(key_mask, past, seq_len, input_ids.device)
        x = self.embed(input_ids)
        pos = self.positions.embed(positions)
        if pos is not None:
            x = x + pos
        x = self.dropout(x)
        bias = self.attention_bias(key_mask, past, seq_len, x.dtype)
        rope = self.rotary(positions)
        weights = []
        for i, layer in enumerate(self.layers):
            x, w = layer(x, bias, rope, cache, i, need_weights)
            if need_weights:
                weights.append(w)
        if cache is not None:
            cache.key_mask = key_mask
        if last_only:
            x = x[:, -1:]
        logits = self.project(self.final_norm(x))
        out = GPTOutput(logits=logits)
        if targets is not None:
            out["loss"] = next_token_loss(logits, targets)
        if need_weights:
            out["attentions"] = weights
        return out

    def _check_inputs(
        self,
        input_ids: Tensor,
        targets: Tensor | None,
        cache: GPTCache | None,
        attention_mask: Tensor | None,
    ) -> int:
        """Refuse malformed inputs; returns the number of positions already cached."""
        check_token_batch(input_ids, "input_ids", targets=targets)
        check_id_range(input_ids, "input_ids", self.config.vocab_size, "vocab_size")
        if targets is not None:
            scored = targets[targets != -100]
            check_id_range(scored.view(1, -1), "targets", self.config.vocab_size, "vocab_size")
        past = cache.length if cache is not None else 0
        seq_len = input_ids.shape[1]
        if seq_len == 0:
            raise AttnlabError("input_ids holds no tokens (seq length 0)")
        if past + seq_len > self.config.max_positions:
            raise AttnlabError(
                f"input reaches position {past + seq_len} but the model's context is "
                f"{self.config.max_positions} tokens (max_positions): truncate it"
            )
        if attention_mask is not None and (
            attention_mask.dim() != 2
            or attention_mask.shape[0] != input_ids.shape[0]
            or attention_mask.shape[1] not in (seq_len, past + seq_len)
        ):
            raise AttnlabError(
                f"attention_mask must be (batch, seq) or (batch, cached + seq) = "
                f"({input_ids.shape[0]}, {seq_len} or {past + seq_len}), "
                f"got {tuple(attention_mask.shape)}"
            )
        return past

    @staticmethod
    def _key_mask(
        input_ids: Tensor, past: int, cache: GPTCache | None, attention_mask: Tensor | None
    ) -> Tensor | None:
        """0/1 mask of every key position (batch, past + seq), or None when all are real."""
        old = cache.key_mask if cache is not None else None
        if attention_mask is None and old is None:
            return None
        if attention_mask is not None and attention_mask.shape[1] == past + input_ids.shape[1]:
            mask = attention_mask.long()
        else:
            batch, device = input_ids.shape[0], input_ids.device
            if old is None:
                old = torch.ones(batch, past, dtype=torch.long, device=device)
            new = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
            mask = torch.cat([old, new.long()], dim=1)
        return None if bool(mask.all()) else mask

    def attention_bias(
        self, key_mask: Tensor | None, past: int, seq_len: int, dtype: torch.dtype
    ) -> Tensor | None:
        """Padding (batch, 1, 1, keys) plus a scheme's score bias (1, heads, seq, keys), or None.

        The causal mask itself is applied by the attention (causal=True).
        """
        bias = None
        if key_mask is not None:
            bias = padding_bias(key_mask, dtype)
        device = self.embed.weight.device
        keys = torch.arange(past + seq_len, device=device)
        pos_bias = self.positions.attention_bias(keys[past:], keys)
        if pos_bias is not None:
            pos_bias = pos_bias.to(dtype)
            bias = pos_bias if bias is None else bias + pos_bias
        return bias

    def rotary(self, positions: Tensor) -> tuple[Tensor, Tensor] | None:
        """RoPE's (cos, sin) for positions (seq,) -> (seq, d_head) or (batch, seq) -> (batch, 1, seq, d_head)."""
        rope = self.positions.rotary(positions.reshape(-1))
        if rope is None or positions.dim() == 1:
            return rope
        cos, sin = (part.view(*positions.shape, -1).unsqueeze(1) for part in rope)
        return cos, sin


def block_args(config: GPTConfig) -> dict[str, Any]:
    """GPTBlock's arguments for this config: pre-LN, and Shaw's tables when it asks for them."""
    shaw = config.position_encoding == "shaw"  # Shaw et al.: positions inside self-attention
    return {
        "d_model": config.d_model,
        "n_heads": config.n_heads,
        "d_ff": config.d_ff,
        "dropout": config.dropout,
        "attention_dropout": config.attention_dropout,
        "activation": config.activation,
        "norm_position": "pre",
        "layer_norm_eps": config.layer_norm_eps,
        "shaw_max_distance": config.shaw_max_distance if shaw else None,
        "shaw_values": config.shaw_values,
    }


def _position_ids(key_mask: Tensor | None, past: int, seq_len: int, device: torch.device) -> Tensor:
    """Positions of the new tokens: past..past+seq-1 (seq,), or counted over real tokens (batch, seq).

    A left-padded row's first real token is at position 0 (HF's cumsum(mask) - 1); pads get 0.
    """
    if key_mask is None:
        return torch.arange(past, past + seq_len, device=device)
    return (key_mask.cumsum(-1) - 1).clamp(min=0)[:, past:]


def next_token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean -log p(target) over the targets that are not -100, in fp32 at least; 0 when none are.

    logits (batch, seq, vocab); targets (batch, seq), already shifted to the next token.
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    total = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    return total / (targets != -100).sum().clamp(min=1)
