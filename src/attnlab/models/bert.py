"""BERT (Devlin et al. 2019): embeddings, a post-LN GELU encoder, the pooler, pretraining heads.

Read top to bottom like the paper's section 3:
input representation = token + segment + position embeddings, LayerNorm, dropout (figure 2);
an encoder of N Transformer layers; the pooler (dense + tanh on [CLS]); the masked-LM head
(dense + GELU + LayerNorm, then the word-embedding matrix transposed, plus a bias) and the
next-sentence head (a linear layer on the pooled [CLS]).

Parameter shapes match HF transformers' ``BertModel`` so checkpoints map one-to-one
(``attnlab.interop.hf``), Q, K and V sharing one fused matrix. Beyond the paper, as config
options: any positional scheme of ``nn/positions.py``, pre-LN layers, and ALBERT's factorised
embeddings and cross-layer sharing (such models are saved in attnlab's own format).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.config import BertConfig
from attnlab.errors import AttnlabError, check_id_range, check_token_batch
from attnlab.nn.attention import padding_bias
from attnlab.nn.blocks import ACTIVATION_FUNCTIONS, Encoder
from attnlab.nn.loss import SummedCrossEntropy
from attnlab.nn.positions import build_position_encoding


@dataclass
class BertOutput:
    """What BertModel returns; shapes use (batch, seq, d_model)."""

    last_hidden_state: Tensor  # (batch, seq, d_model); (count, d_model) of the kept positions
    pooler_output: Tensor | None  # (batch, d_model): tanh(W [CLS] + b); None without a pooler
    hidden_states: list[Tensor] | None = None  # N + 1: the embeddings' output, then each layer's
    attentions: list[Tensor] | None = None  # per layer: (batch, heads, seq, seq)


class BertEmbeddings(nn.Module):
    """Token + segment (+ absolute position) embeddings, then LayerNorm and dropout.

    With ALBERT's factorisation (embedding_size E < d_model) the tables are E wide and a
    linear map lifts the sum to d_model: V*E + E*H parameters instead of V*H.
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        width = config.d_embedding
        self.word_embeddings = nn.Embedding(
            config.vocab_size, width, padding_idx=config.pad_token_id
        )
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, width)
        self.positions = build_position_encoding(
            config.position_encoding,
            width,
            config.n_heads,
            config.max_positions,
            bidirectional=True,
            relative_buckets=config.relative_buckets,
            relative_max_distance=config.relative_max_distance,
            rope_base=config.rope_base,
            d_head=config.d_model // config.n_heads,
        )
        self.norm = nn.LayerNorm(width, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)
        self.projection = nn.Linear(width, config.d_model) if width != config.d_model else None

    def forward(
        self, input_ids: Tensor, token_type_ids: Tensor, lengths: Tensor | None = None
    ) -> Tensor:
        """input_ids, token_type_ids (batch, seq) -> (batch, seq, d_model).

        ``lengths`` (batch,), each sequence's real tokens, is read by the ``normalized``
        position scheme only.
        """
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        pos = self.positions.embed(positions, lengths)
        if pos is not None:
            x = x + pos
        x = self.dropout(self.norm(x))
        return self.projection(x) if self.projection is not None else x


class BertPooler(nn.Module):
    """tanh(W h_[CLS] + b): the sentence vector the NSP head (and classifiers) read."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.d_model, config.d_model)

    def forward(self, hidden: Tensor) -> Tensor:
        """(batch, seq, d_model) -> (batch, d_model) from position 0."""
        return torch.tanh(self.dense(hidden[:, 0]))


class BertModel(nn.Module):
    """The BERT encoder: embeddings, N layers, pooler."""

    def __init__(self, config: BertConfig, add_pooler: bool = True) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        shaw = config.position_encoding == "shaw"  # Shaw et al.: positions inside self-attention
        self.encoder = Encoder(
            config.n_layers,
            norm_position=config.norm_position,
            share_layers=config.share_layers,
            d_model=config.d_model,
            n_heads=config.n_heads,
            d_ff=config.d_ff,
            dropout=config.dropout,
            attention_dropout=config.attention_dropout,
            activation=config.activation,
            layer_norm_eps=config.layer_norm_eps,
            shaw_max_distance=config.shaw_max_distance if shaw else None,
            shaw_values=config.shaw_values,
        )
        self.pooler = BertPooler(config) if add_pooler else None
        self.apply(self.init_weights)

    def init_weights(self, module: nn.Module) -> None:
        """BERT's initialisation of one module: N(0, initializer_range) weights, zero biases.

        LayerNorm starts as the identity (weight 1, bias 0).
        """
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
            if module.padding_idx is not None:
                module.weight.data[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def attention_bias(
        self, attention_mask: Tensor | None, seq_len: int, dtype: torch.dtype
    ) -> Tensor | None:
        """The one additive bias every layer shares: padding (batch, 1, 1, seq) + positional (1, heads, seq, seq)."""
        bias = None
        if attention_mask is not None and not bool(attention_mask.all()):
            bias = padding_bias(attention_mask, dtype)
        positions = torch.arange(seq_len, device=self.embeddings.word_embeddings.weight.device)
        pos_bias = self.embeddings.positions.attention_bias(positions, positions)
        if pos_bias is not None:
            pos_bias = pos_bias.to(dtype)
            bias = pos_bias if bias is None else bias + pos_bias
        return bias

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        need_weights: bool = False,
        output_hidden_states: bool = False,
        keep: Tensor | None = None,
    ) -> BertOutput:
        """Encode input_ids (batch, seq); attention_mask defaults to all ones, token_type_ids to zeros.

        ``keep`` (batch, seq, bool) names the positions whose final states the caller reads
        (a classifier: [CLS]; the MLM loss: the masked tokens): the last layer computes only
        those, and ``last_hidden_state`` is then (count, d_model), equal to the full output
        indexed by ``keep``. The pooler then needs position 0 kept in every sequence.
        """
        check_token_batch(
            input_ids, "input_ids", attention_mask=attention_mask, token_type_ids=token_type_ids
        )
        check_id_range(input_ids, "input_ids", self.config.vocab_size, "vocab_size")
        check_id_range(
            token_type_ids, "token_type_ids", self.config.type_vocab_size, "type_vocab_size"
        )
        seq_len = input_ids.shape[1]
        if seq_len == 0:
            raise AttnlabError("input_ids holds no tokens (seq length 0)")
        if seq_len > self.config.max_positions:
            raise AttnlabError(
                f"input has {seq_len} tokens but the model takes at most "
                f"{self.config.max_positions}: truncate it"
            )
        if keep is not None:
            _check_keep(keep, input_ids, need_weights or output_hidden_states)
            if self.pooler is not None and not bool(keep[:, 0].all()):
                raise AttnlabError(
                    "keep must hold position 0 ([CLS]) of every sequence for the pooler"
                )
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        lengths = attention_mask.sum(-1) if attention_mask is not None else None
        x = self.embeddings(input_ids, token_type_ids, lengths)
        bias = self.attention_bias(attention_mask, seq_len, x.dtype)
        positions = torch.arange(seq_len, device=input_ids.device)
        rope = self.embeddings.positions.rotary(positions)
        x, hidden, weights = self.encoder(
            x, bias=bias, rope=rope, need_weights=need_weights,
            output_hidden_states=output_hidden_states, keep=keep,
        )  # fmt: skip
        pooled = None
        if self.pooler is not None:
            if keep is None:
                pooled = self.pooler(x)
            else:  # each sequence's first kept row is its [CLS]
                counts = keep.sum(1)
                pooled = self.pooler(x[counts.cumsum(0) - counts].unsqueeze(1))
        return BertOutput(
            last_hidden_state=x,
            pooler_output=pooled,
            hidden_states=hidden if output_hidden_states else None,
            attentions=weights if need_weights else None,
        )


def cls_only(input_ids: Tensor) -> Tensor:
    """The ``keep`` mask (batch, seq) that asks BertModel for position 0 ([CLS]) alone."""
    keep = torch.zeros_like(input_ids, dtype=torch.bool)
    keep[:, 0] = True
    return keep


def _check_keep(keep: Tensor, input_ids: Tensor, full_outputs: bool) -> None:
    if keep.dtype != torch.bool or keep.shape != input_ids.shape:
        raise AttnlabError(
            f"keep must be a bool tensor shaped like input_ids {tuple(input_ids.shape)}, "
            f"got {keep.dtype} {tuple(keep.shape)}"
        )
    if full_outputs:
        raise AttnlabError(
            "keep computes only some positions of the last layer: it cannot be combined with "
            "need_weights or output_hidden_states"
        )
    if not bool(keep.any()):
        raise AttnlabError("keep selects no position: pass None to compute them all")


class BertMLMHead(nn.Module):
    """Masked-LM head: dense + act + LayerNorm, then logits against the tied word embeddings + bias."""

    def __init__(self, config: BertConfig, word_embeddings: nn.Embedding) -> None:
        super().__init__()
        self.dense = nn.Linear(config.d_model, config.d_embedding)
        self.act = ACTIVATION_FUNCTIONS[config.activation]
        self.norm = nn.LayerNorm(config.d_embedding, eps=config.layer_norm_eps)
        self.word_embeddings = word_embeddings  # shared, not a copy: weight tying
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden: Tensor) -> Tensor:
        """(..., d_model) -> (..., vocab_size) logits."""
        h = self.norm(self.act(self.dense(hidden)))
        return F.linear(h, self.word_embeddings.weight, self.bias)


class BertForPreTraining(nn.Module):
    """BERT with the masked-LM and next-sentence-prediction heads (paper section 3.1).

    sentence_head=False drops the pooler and NSP head (RoBERTa's MLM-only objective), so no
    parameter goes unused; ALBERT's sentence-order prediction reuses the same 2-way head.
    """

    def __init__(self, config: BertConfig, sentence_head: bool = True) -> None:
        super().__init__()
        self.config = config
        self.bert = BertModel(config, add_pooler=sentence_head)
        self.mlm = BertMLMHead(config, self.bert.embeddings.word_embeddings)
        self.nsp = nn.Linear(config.d_model, 2) if sentence_head else None  # IsNext / NotNext
        self.mlm_loss = SummedCrossEntropy()  # summed over the masked tokens, in fp32
        for module in (self.mlm.dense, self.mlm.norm, self.nsp):  # outside self.bert's apply()
            if module is not None:
                self.bert.init_weights(module)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        mlm_labels: Tensor | None = None,
        nsp_labels: Tensor | None = None,
        mlm_normalizer: Tensor | None = None,
    ) -> dict[str, Tensor]:
        """Logits and, when labels are given, losses.

        With ``mlm_labels`` (batch, seq; -100 = not masked) the vocabulary projection runs only
        at masked positions (``mlm_logits`` is then (n_masked, vocab)): the other ~85% of
        positions carry no loss, and the projection is the costliest matmul of the model. For
        the same reason the last encoder layer computes only the masked positions and [CLS].
        Without labels, ``mlm_logits`` covers every position (batch, seq, vocab).
        ``mlm_normalizer`` replaces the per-batch count of masked tokens as the divisor of the
        summed MLM loss, so that micro-batches and DDP ranks add up to the full batch's mean.
        """
        check_token_batch(input_ids, "input_ids", mlm_labels=mlm_labels)
        masked = keep = None
        if mlm_labels is not None:
            # The loss reads the last layer at the masked positions (and [CLS] for the
            # sentence head) only, so the last layer computes just those rows.
            masked = mlm_labels != -100
            keep = masked.clone()
            if self.nsp is not None:
                keep[:, 0] = True
            if not bool(keep.any()):
                keep = None
        out = self.bert(input_ids, attention_mask, token_type_ids, keep=keep)
        hidden = out.last_hidden_state
        result: dict[str, Tensor] = {}
        if self.nsp is not None:
            result["nsp_logits"] = self.nsp(out.pooler_output)
        if masked is None:
            result["mlm_logits"] = self.mlm(hidden)
            return result
        logits = self.mlm(hidden[masked if keep is None else masked[keep]])  # (masked, V)
        result["mlm_logits"] = logits
        if mlm_normalizer is not None:
            loss = self.mlm_loss(logits, mlm_labels[masked]) / mlm_normalizer
        elif logits.numel():
            loss = self.mlm_loss(logits, mlm_labels[masked]) / len(logits)
        else:  # nothing masked: a zero loss still connected to the graph, so backward() works
            loss = hidden.sum() * 0.0
        result["mlm_loss"] = loss
        if nsp_labels is not None and self.nsp is not None:
            result["nsp_loss"] = F.cross_entropy(result["nsp_logits"].float(), nsp_labels)
            loss = loss + result["nsp_loss"]
        result["loss"] = loss
        return result


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once, as HF counts them)."""
    return sum(p.numel() for p in model.parameters())
