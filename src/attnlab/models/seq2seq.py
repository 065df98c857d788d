"""The encoder-decoder Transformer (Vaswani et al. 2017, section 3).

Read top to bottom like the paper:
- section 3.4, embeddings: a learned table per token, multiplied by sqrt(d_model); with a
  joint vocabulary one table serves source and target, and the pre-softmax projection is the
  same matrix (``share_embeddings``, ``tie_output``);
- section 3.5, positions: any scheme of ``attnlab.nn.positions`` (sinusoidal by default),
  then dropout on the sum (section 5.4, "residual dropout");
- section 3.1, the encoder and decoder stacks of ``attnlab.nn.blocks`` (figure 1);
- section 3.4, the output: a linear projection to the target vocabulary (softmax in the loss);
- section 5.4, label smoothing with epsilon_ls = 0.1.

Teacher forcing (section 5): the decoder reads the target "shifted right" (``<sos> y1 ...
y_m``) and predicts ``y1 ... y_m <eos>``; the causal mask keeps position t from seeing
later targets. Greedy and beam search live in ``attnlab.decode``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.config import TransformerConfig
from attnlab.errors import AttnlabError, check_id_range, check_token_batch
from attnlab.nn.attention import Cache, MultiHeadAttention, padding_bias
from attnlab.nn.blocks import Decoder, Encoder
from attnlab.nn.positions import PositionEncoding, build_position_encoding


def label_smoothed_cross_entropy(
    logits: Tensor, target: Tensor, epsilon: float, pad_id: int
) -> tuple[Tensor, Tensor]:
    """Summed label-smoothed cross-entropy and summed plain NLL over non-pad targets.

    logits (n, vocab), target (n,). The smoothed target distribution is
    ``q = (1 - eps) * onehot(y) + eps * uniform(vocab without pad)``: pad is never a target, so
    giving it probability mass would teach the model to emit it. Then
    ``-sum_j q_j log p_j = (1 - eps) * (-log p_y) + eps / (V - 1) * sum_{j != pad} (-log p_j)``
    and, with ``log p_j = z_j - logsumexp(z)``,
    ``sum_{j != pad} (-log p_j) = (V - 1) * logsumexp(z) - sum_{j != pad} z_j``:
    no (n, vocab) one-hot or log-softmax tensor is built.
    """
    logits = logits.float()
    keep = target != pad_id
    lse = logits.logsumexp(-1)  # (n,)
    nll = lse - logits.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # -log p_y, (n,)
    nll = nll.masked_fill(~keep, 0.0)
    if epsilon == 0:
        return nll.sum(), nll.sum()
    n_labels = logits.shape[-1] - 1  # V - 1: every token but pad
    uniform_nll = n_labels * lse - (logits.sum(-1) - logits[:, pad_id])  # (n,)
    loss = (1.0 - epsilon) * nll + (epsilon / n_labels) * uniform_nll.masked_fill(~keep, 0.0)
    return loss.sum(), nll.sum()


class Transformer(nn.Module):
    """Encoder-decoder Transformer: encode the source once, decode the target (with a KV cache)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = c = config
        self.src_embed = nn.Embedding(c.src_vocab_size, c.d_model, padding_idx=c.pad_id)
        # A shared table exists once (tgt_embed None), so weights save and load without aliases.
        self.tgt_embed = (
            None
            if c.share_embeddings
            else nn.Embedding(c.tgt_vocab_size, c.d_model, padding_idx=c.pad_id)
        )
        self.embed_scale = math.sqrt(c.d_model)
        self.src_positions = self._positions(bidirectional=True)
        self.tgt_positions = self._positions(bidirectional=False)  # the decoder sees only the past
        self.dropout = nn.Dropout(c.dropout)
        layer_args = dict(
            d_model=c.d_model,
            n_heads=c.n_heads,
            d_ff=c.d_ff,
            dropout=c.dropout,
            attention_dropout=c.attention_dropout,
            activation=c.activation,
            layer_norm_eps=c.layer_norm_eps,
            shaw_max_distance=c.shaw_max_distance if c.position_encoding == "shaw" else None,
            shaw_values=c.shaw_values,
        )
        self.encoder = Encoder(c.n_encoder_layers, c.norm_position, **layer_args)
        self.decoder = Decoder(c.n_decoder_layers, c.norm_position, **layer_args)
        self.output_proj = (
            None if c.tie_output else nn.Linear(c.d_model, c.tgt_vocab_size, bias=False)
        )
        self._init_weights()

    def _positions(self, bidirectional: bool) -> PositionEncoding:
        c = self.config
        return build_position_encoding(
            c.position_encoding,
            c.d_model,
            c.n_heads,
            c.max_positions,
            bidirectional=bidirectional,
            relative_buckets=c.relative_buckets,
            relative_max_distance=c.relative_max_distance,
            rope_base=c.rope_base,
        )

    def _init_weights(self) -> None:
        # Xavier-uniform projections and zero biases, as the paper's reference code
        # (tensor2tensor) does. The fused Q|K|V and K|V matrices are initialised block by
        # block, like the paper's separate W^Q, W^K, W^V (one Xavier over the fused shape
        # would use a smaller bound).
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        for module in self.modules():  # after the pass above, which visits the Linears later
            if isinstance(module, MultiHeadAttention):
                fused = (module.q_proj, module.kv_proj) if module.cross else (module.qkv_proj,)
                for linear in fused:
                    for block in linear.weight.data.split(module.d_model, dim=0):
                        nn.init.xavier_uniform_(block)
        # Embeddings N(0, d_model^-1/2): times sqrt(d_model) they have unit variance, the scale
        # of the sinusoids; and as the tied output matrix, a unit-variance hidden state gives
        # logits of unit variance.
        for table in (self.src_embed, self.tgt_embed):
            if table is not None:
                nn.init.normal_(table.weight, std=self.config.d_model**-0.5)
                table.weight.data[self.config.pad_id].zero_()

    @property
    def target_embedding(self) -> nn.Embedding:
        """The target token table (the source one when embeddings are shared)."""
        return self.src_embed if self.tgt_embed is None else self.tgt_embed

    def _embed(
        self,
        ids: Tensor,
        table: nn.Embedding,
        positions: PositionEncoding,
        start: int = 0,
        lengths: Tensor | None = None,
    ) -> Tensor:
        """ids (batch, seq) at positions start.. -> dropout(E[ids] * sqrt(d_model) + PE), (batch, seq, d_model)."""
        x = table(ids) * self.embed_scale
        pos = positions.embed(torch.arange(start, start + ids.shape[1], device=ids.device), lengths)
        if pos is not None:
            x = x + pos
        return self.dropout(x)

    def _check_length(self, n: int, side: str) -> None:
        if n > self.config.max_positions:
            raise AttnlabError(
                f"{side} has {n} positions but the model takes at most "
                f"{self.config.max_positions}: truncate it or raise max_positions"
            )

    @staticmethod
    def _memory_bias(src_mask: Tensor, dtype: torch.dtype) -> Tensor | None:
        # None when nothing is padded, so attention can take its unmasked fast path.
        return None if bool(src_mask.all()) else padding_bias(src_mask, dtype)

    def encode(self, src_ids: Tensor, src_mask: Tensor | None = None) -> Tensor:
        """Source ids (batch, src_len) -> encoder output (batch, src_len, d_model).

        src_mask (batch, src_len) is True/1 for real tokens; by default ``src_ids != pad_id``.
        """
        return self.encode_with_weights(src_ids, src_mask)[0]

    def encode_with_weights(
        self, src_ids: Tensor, src_mask: Tensor | None = None, need_weights: bool = False
    ) -> tuple[Tensor, list[Tensor]]:
        """encode(), and with need_weights each layer's self-attention weights (batch, heads, src, src)."""
        check_token_batch(src_ids, "src_ids", src_mask=src_mask)
        check_id_range(src_ids, "src_ids", self.config.src_vocab_size, "src_vocab_size")
        if src_mask is None:
            src_mask = src_ids != self.config.pad_id
        src_len = src_ids.shape[1]
        self._check_length(src_len, "the source")
        x = self._embed(src_ids, self.src_embed, self.src_positions, lengths=src_mask.sum(-1))
        positions = torch.arange(src_len, device=src_ids.device)
        bias = self._memory_bias(src_mask, x.dtype)  # (batch, 1, 1, src_len) or None
        pos_bias = self.src_positions.attention_bias(positions, positions)  # (1, heads, s, s)
        if pos_bias is not None:
            pos_bias = pos_bias.to(x.dtype)
            bias = pos_bias if bias is None else bias + pos_bias
        memory, _, weights = self.encoder(
            x, bias=bias, rope=self.src_positions.rotary(positions), need_weights=need_weights
        )
        return memory, weights

    def decode_hidden(
        self,
        tgt_ids: Tensor,
        memory: Tensor | None,
        src_mask: Tensor,
        cache: Cache | None = None,
    ) -> Tensor:
        """Decoder output (batch, tgt_len, d_model) before the vocabulary projection.

        With a cache, tgt_ids holds only the new positions (they follow cache.length earlier
        ones), and memory is read only while the cache has no cross-attention keys/values yet.
        memory and src_mask may have one row per group of consecutive target rows (the beams of
        a sentence); the group then shares it.
        """
        return self.decode_with_weights(tgt_ids, memory, src_mask, cache)[0]

    def decode_with_weights(
        self,
        tgt_ids: Tensor,
        memory: Tensor | None,
        src_mask: Tensor,
        cache: Cache | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """decode_hidden(), and with need_weights each layer's weights: (hidden, self, cross).

        Self-attention weights are (batch, heads, tgt, tgt), cross-attention weights (batch,
        heads, tgt, src); both empty lists without need_weights.
        """
        check_id_range(tgt_ids, "tgt_ids", self.config.tgt_vocab_size, "tgt_vocab_size")
        start = cache.length if cache is not None else 0
        new = tgt_ids.shape[1]
        self._check_length(start + new, "the target")
        lengths = (tgt_ids != self.config.pad_id).sum(-1) if cache is None else None
        x = self._embed(tgt_ids, self.target_embedding, self.tgt_positions, start, lengths)
        q_pos = torch.arange(start, start + new, device=tgt_ids.device)
        k_pos = torch.arange(start + new, device=tgt_ids.device)
        # Only positional biases here: the attention adds the causal mask itself, and target
        # padding needs no mask, as it only ever follows real tokens.
        self_bias = self.tgt_positions.attention_bias(q_pos, k_pos)  # (1, heads, new, all)
        if self_bias is not None:
            self_bias = self_bias.to(x.dtype)
        return self.decoder(
            x,
            memory,
            self_bias=self_bias,
            memory_bias=self._memory_bias(src_mask, x.dtype),
            rope=self.tgt_positions.rotary(q_pos),
            cache=cache,
            need_weights=need_weights,
        )

    def project(self, hidden: Tensor) -> Tensor:
        """Decoder output (..., d_model) -> logits (..., tgt_vocab_size): x W_out^T, or x E^T when tied."""
        if self.output_proj is None:
            return F.linear(hidden, self.target_embedding.weight)
        return self.output_proj(hidden)

    def decode(
        self,
        tgt_ids: Tensor,
        memory: Tensor | None,
        src_mask: Tensor,
        cache: Cache | None = None,
    ) -> Tensor:
        """Target ids (batch, tgt_len) + encoder output -> logits (batch, tgt_len, tgt_vocab_size).

        With a cache, tgt_ids holds only the new positions (see decode_hidden).
        """
        return self.project(self.decode_hidden(tgt_ids, memory, src_mask, cache))

    def forward(
        self,
        src_ids: Tensor,
        tgt_in: Tensor,
        tgt_out: Tensor | None = None,
        src_mask: Tensor | None = None,
        tgt_normalizer: Tensor | None = None,
        need_weights: bool = False,
    ) -> dict[str, Tensor | list[Tensor]]:
        """Teacher forcing: src_ids (batch, src_len), tgt_in / tgt_out (batch, tgt_len).

        Without tgt_out, returns {"logits": (batch, tgt_len, vocab)}; need_weights adds each
        layer's attention weights, as HF names them: "encoder_attentions" (batch, heads, src,
        src), "decoder_attentions" (batch, heads, tgt, tgt), "cross_attentions" (batch, heads,
        tgt, src). With it, returns "loss"
        (label-smoothed cross-entropy summed over non-pad target tokens / their count),
        "nll_loss" (the same without smoothing: log-perplexity per token) and "n_tokens"; the
        projection then runs only at non-pad positions and the logits are not kept.
        ``tgt_normalizer`` replaces the count as the divisor: the target tokens of a whole
        optimiser step over its micro-batches and processes (text/parallel.py: TokenBatches),
        so that averaging their losses gives the mean over every token of the step, as fairseq
        normalises by the step's token count.
        """
        check_token_batch(tgt_in, "tgt_in", tgt_out=tgt_out)  # encode() checks the source
        if len(tgt_in) != len(src_ids):
            raise AttnlabError(
                f"tgt_in has {len(tgt_in)} rows but src_ids {len(src_ids)}: one target per source"
            )
        if src_mask is None:
            src_mask = src_ids != self.config.pad_id
        if need_weights and tgt_out is not None:
            raise AttnlabError("need_weights returns logits and weights: pass no tgt_out with it")
        memory, encoder_weights = self.encode_with_weights(src_ids, src_mask, need_weights)
        hidden, self_weights, cross_weights = self.decode_with_weights(
            tgt_in, memory, src_mask, need_weights=need_weights
        )
        if need_weights:
            return {
                "logits": self.project(hidden),
                "encoder_attentions": encoder_weights,
                "decoder_attentions": self_weights,
                "cross_attentions": cross_weights,
            }
        if tgt_out is None:
            return {"logits": self.project(hidden)}
        keep = tgt_out != self.config.pad_id
        logits = self.project(hidden[keep])  # (n_tokens, vocab)
        loss, nll = label_smoothed_cross_entropy(
            logits, tgt_out[keep], self.config.label_smoothing, self.config.pad_id
        )
        n_tokens = keep.sum()
        denom = n_tokens.clamp(min=1) if tgt_normalizer is None else tgt_normalizer
        denom = denom.to(loss.dtype)
        return {"loss": loss / denom, "nll_loss": nll / denom, "n_tokens": n_tokens}
