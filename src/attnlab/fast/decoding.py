"""The decoding twin of ``GPTBlock``: a cached one-token step by direct function calls.

Sampling runs each block on one new position per row. At that size the products are small,
and the plain block's module calls cost as much as the arithmetic: the norms, the Q|K|V, W^O and
FFN projections, the residuals and their dropouts are a dozen ``nn.Module`` calls. The twin
computes the same pre-LN block from the same parameters, in the same order, calling the
functions directly: x + W^O Attn(LN1(x)), then x + FFN(LN2(x)).

It takes that route only for a step that needs nothing else: evaluation (no dropout), a cache,
one new position, no attention weights asked for, and attention by eq. (1) itself (Shaw et
al.'s relative attention keeps its own class and the plain route). Attention is the fused
kernel: one query against the cached keys needs no causal mask, and there the fused kernel
beats the explicit formula that the attention twin takes for a few queries (bench/RESULTS.md).
Everything else, the prompt's step included, is the plain block's forward.

``DecodingGPT``, the model's twin, does the same around the blocks: for such a step with no
padding mask, it checks the input as the plain model does, adds the position's vector, calls
each block's step and the final norm directly, and skips the hooks its scheme leaves empty
(no score bias, no rotation) and the dropout that evaluation leaves out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.decode.cache import KVCache
from attnlab.fast.attention import FastMultiHeadAttention
from attnlab.models.gpt import GPT, GPTBlock, GPTCache, GPTOutput
from attnlab.nn.attention import MultiHeadAttention, apply_rotary, scaled_dot_product_attention
from attnlab.nn.positions import PositionEncoding

# The attention classes that compute eq. (1) itself (the plain one and its twin).
EQUATION_ONE = (MultiHeadAttention, FastMultiHeadAttention)


def _norm(x: Tensor, norm: nn.LayerNorm) -> Tensor:
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


def _linear(x: Tensor, layer: nn.Linear) -> Tensor:
    return F.linear(x, layer.weight, layer.bias)


class DecodingGPTBlock(GPTBlock):
    """Twin of GPTBlock: a cached one-token step in evaluation without the module calls."""

    def forward(
        self,
        x: Tensor,
        bias: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        cache: KVCache | None = None,
        index: int = 0,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """As GPTBlock.forward; a one-token cached step takes the direct route."""
        if not self.takes_direct_route(x, cache, need_weights):
            return super().forward(x, bias, rope, cache, index, need_weights)
        return self.step(x, bias, rope, cache, index), None

    def takes_direct_route(self, x: Tensor, cache: KVCache | None, need_weights: bool) -> bool:
        """Whether this call is a one-token cached step in evaluation that needs no weights."""
        return (
            cache is not None
            and x.shape[1] == 1
            and not need_weights
            and not self.training
            and self.pre_norm
            and type(self.self_attn) in EQUATION_ONE
        )

    def step(
        self,
        x: Tensor,
        bias: Tensor | None,
        rope: tuple[Tensor, Tensor] | None,
        cache: KVCache,
        index: int,
    ) -> Tensor:
        """x (batch, 1, d_model) -> (batch, 1, d_model); extends the cache's slot ``index``."""
        attn, ffn = self.self_attn, self.ffn
        q, k, v = attn.split_heads(_linear(_norm(x, self.norm1), attn.qkv_proj), 3)
        if rope is not None:
            q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        k, v = cache.update(index, k, v)
        out, _ = scaled_dot_product_attention(q, k, v, bias)  # one query sees every cached key
        x = x + _linear(attn.merge_heads(out), attn.out_proj)
        return x + _linear(ffn.act(_linear(_norm(x, self.norm2), ffn.fc1)), ffn.fc2)


def _overrides(scheme: PositionEncoding, hook: str) -> bool:
    """Whether a position scheme fills this hook (the base class's hooks return None)."""
    return getattr(type(scheme), hook) is not getattr(PositionEncoding, hook)


class DecodingGPT(GPT):
    """Twin of GPT: a cached one-token step without mask in evaluation, blocks called directly."""

    def forward(
        self,
        input_ids: Tensor,
        targets: Tensor | None = None,
        cache: GPTCache | None = None,
        need_weights: bool = False,
        attention_mask: Tensor | None = None,
        last_only: bool = False,
    ) -> GPTOutput:
        """As GPT.forward; a one-token cached step with no padding takes the direct route."""
        plain = (
            cache is None
            or targets is not None
            or attention_mask is not None
            or not self.takes_direct_route(input_ids, cache, need_weights)
        )
        if plain:
            return super().forward(
                input_ids, targets, cache, need_weights, attention_mask, last_only
            )
        return GPTOutput(logits=self.step(input_ids, cache))

    def takes_direct_route(self, input_ids: Tensor, cache: GPTCache, need_weights: bool) -> bool:
        """Whether every block steps directly: one new token after cached ones, no padding."""
        return (
            input_ids.dim() == 2
            and cache.length > 0
            and cache.key_mask is None
            and all(  # the block's check reads x's sequence length: input_ids' is the same
                isinstance(layer, DecodingGPTBlock)
                and layer.takes_direct_route(input_ids, cache, need_weights)
                for layer in self.layers
            )
        )

    def step(self, input_ids: Tensor, cache: GPTCache) -> Tensor:
        """input_ids (batch, 1) after cache.length cached positions -> logits (batch, 1, vocab)."""
        past = self._check_inputs(input_ids, None, cache, None)
        positions = torch.arange(past, past + 1, device=input_ids.device)
        x = F.embedding(input_ids, self.embed.weight)
        pos = self.positions.embed(positions)
        if pos is not None:
            x = x + pos
        bias = rope = None
        if _overrides(self.positions, "attention_bias"):
            bias = self.attention_bias(None, past, 1, x.dtype)
        if _overrides(self.positions, "rotary"):
            rope = self.rotary(positions)
        for i, layer in enumerate(self.layers):
            x = layer.step(x, bias, rope, cache, i)  # type: ignore[operator]
        return self.project(_norm(x, self.final_norm))
