"""Fine-tuning heads on a BERT encoder (Devlin et al. 2019, section 4 and figure 4).

Figure 4 of the paper fine-tunes one pretrained encoder for four kinds of task by adding a
single small layer and training everything end to end:

(a, b) sentence and sentence-pair classification: the pooled [CLS] vector -> dropout ->
       linear to the labels (one output and a squared error for regression, as STS-B); or,
       for a checkpoint trained so (sentence-transformers), the mean of the last layer's
       token states in place of the [CLS] pooler (Reimers and Gurevych 2019, section 3);
(c)    question answering (SQuAD, section 4.2): a start vector S and an end vector E score
       every token of the passage; the answer span maximises S.T_i + E.T_j, i <= j;
(d)    token tagging (NER, section 5.3): each token's final hidden state -> dropout ->
       linear to the tags, scored on the first sub-token of each word.

Parameter names match HF transformers' ``BertFor*`` classes (``bert.*``, ``classifier.*``,
``qa_outputs.*``) so a head's weights map one-to-one (``attnlab.interop.hf``); the losses
are HF's too, so training either library on the same checkpoint gives the same numbers.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.config import BertConfig
from attnlab.errors import AttnlabError
from attnlab.models.bert import BertModel, cls_only

PROBLEM_TYPES = ("single_label_classification", "regression")
POOLINGS = ("cls", "mean")  # what a sentence classifier reads of the encoder


def _dropout(config: BertConfig, classifier_dropout: float | None) -> float:
    # HF's config.classifier_dropout, defaulting to the encoder's hidden dropout (0.1).
    return config.dropout if classifier_dropout is None else classifier_dropout


def _init_head(model: nn.Module, head: nn.Linear) -> None:
    # The head starts as BERT's other linear layers do: N(0, initializer_range), zero bias.
    model.bert.init_weights(head)


def mean_pool(hidden: Tensor, attention_mask: Tensor | None) -> Tensor:
    """(batch, seq, d) -> (batch, d): the mean over real tokens (attention_mask 1; all if None)."""
    if attention_mask is None:
        return hidden.mean(1)
    mask = attention_mask.unsqueeze(-1)  # (batch, seq, 1)
    count = mask.sum(1).clamp(min=1).to(hidden.dtype)  # counted exactly, then cast
    return (hidden * mask.to(hidden.dtype)).sum(1) / count


class BertForSequenceClassification(nn.Module):
    """Figure 4 (a, b): [CLS] pooler -> dropout -> linear; cross-entropy, or MSE for regression.

    ``problem_type="regression"`` means one output per example (a similarity score, as in
    STS-B) trained with mean squared error; otherwise ``num_labels`` logits and cross-entropy.
    ``pooling="mean"`` reads the mean of the last layer's states over real tokens instead of
    the [CLS] pooler (which it then has none of), as a sentence-transformers checkpoint was
    trained; HF's BertForSequenceClassification has only the pooler.
    """

    def __init__(
        self,
        config: BertConfig,
        num_labels: int,
        problem_type: str = "single_label_classification",
        classifier_dropout: float | None = None,
        pooling: str = "cls",
    ) -> None:
        super().__init__()
        if problem_type not in PROBLEM_TYPES:
            raise AttnlabError(f"problem_type must be one of {list(PROBLEM_TYPES)}")
        if pooling not in POOLINGS:
            raise AttnlabError(
                f"pooling must be cls or mean, got {pooling!r}", options=("pooling",)
            )
        if problem_type == "regression":
            num_labels = 1
        if num_labels < 1:
            raise AttnlabError(f"num_labels must be >= 1, got {num_labels}")
        self.config = config
        self.num_labels = num_labels
        self.problem_type = problem_type
        self.classifier_dropout = classifier_dropout  # HF's config field, saved with the model
        self.pooling = pooling  # saved with the model too (config.json's "attnlab")
        self.bert = BertModel(config, add_pooler=pooling == "cls")
        self.dropout = nn.Dropout(_dropout(config, classifier_dropout))
        self.classifier = nn.Linear(config.d_model, num_labels)
        _init_head(self, self.classifier)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        labels: Tensor | None = None,
    ) -> dict[str, Tensor]:
        """input_ids (batch, seq) -> logits (batch, num_labels), and loss when labels (batch,) are given."""
        if self.pooling == "mean":  # every real token's last state is read
            hidden = self.bert(input_ids, attention_mask, token_type_ids).last_hidden_state
            pooled = mean_pool(hidden, attention_mask)  # (batch, d_model)
        else:  # only [CLS] is read from the last layer, so only [CLS] is computed there
            keep = cls_only(input_ids)
            pooled = self.bert(input_ids, attention_mask, token_type_ids, keep=keep).pooler_output
        logits = self.classifier(self.dropout(pooled))  # (batch, num_labels)
        out = {"logits": logits}
        if labels is not None:
            if self.problem_type == "regression":
                out["loss"] = F.mse_loss(logits.float().squeeze(-1), labels.float())
            else:
                out["loss"] = F.cross_entropy(logits.float(), labels)
        return out


class BertForTokenClassification(nn.Module):
    """Figure 4 (d): every token's hidden state -> dropout -> linear to the tags.

    Labels of -100 (the later sub-tokens of a word, special tokens, padding) carry no loss:
    the paper scores only each word's first sub-token. No pooler: nothing reads [CLS] alone.
    """

    def __init__(
        self, config: BertConfig, num_labels: int, classifier_dropout: float | None = None
    ) -> None:
        super().__init__()
        if num_labels < 1:
            raise AttnlabError(f"num_labels must be >= 1, got {num_labels}")
        self.config = config
        self.num_labels = num_labels
        self.classifier_dropout = classifier_dropout
        self.bert = BertModel(config, add_pooler=False)
        self.dropout = nn.Dropout(_dropout(config, classifier_dropout))
        self.classifier = nn.Linear(config.d_model, num_labels)
        _init_head(self, self.classifier)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        labels: Tensor | None = None,
    ) -> dict[str, Tensor]:
        """input_ids (batch, seq) -> logits (batch, seq, num_labels); loss over labels != -100."""
        hidden = self.bert(input_ids, attention_mask, token_type_ids).last_hidden_state
        logits = self.classifier(self.dropout(hidden))  # (batch, seq, num_labels)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(
                logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100
            )
        return out


class BertForQuestionAnswering(nn.Module):
    """Section 4.2 / figure 4 (c): one linear layer gives each token a start and an end logit.

    ``qa_outputs`` holds the paper's S and E vectors as the two rows of one (2, d) matrix.
    The loss is the mean of the start and end cross-entropies; a position outside the
    sequence (an answer cut off by the window) is clamped to ``seq`` and ignored, as HF does.
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.bert = BertModel(config, add_pooler=False)
        self.qa_outputs = nn.Linear(config.d_model, 2)
        _init_head(self, self.qa_outputs)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        start_positions: Tensor | None = None,
        end_positions: Tensor | None = None,
    ) -> dict[str, Tensor]:
        """input_ids (batch, seq) -> start_logits, end_logits (batch, seq), and the loss given targets.

        Targets are token positions (batch,), as in HF, or distributions over the tokens
        (batch, seq), e.g. shares of several gold answers.
        """
        hidden = self.bert(input_ids, attention_mask, token_type_ids).last_hidden_state
        start_logits, end_logits = self.qa_outputs(hidden).unbind(-1)  # 2 x (batch, seq)
        out = {"start_logits": start_logits, "end_logits": end_logits}
        if start_positions is not None and end_positions is not None:
            start_loss = _span_loss(start_logits, start_positions)
            end_loss = _span_loss(end_logits, end_positions)
            out["loss"] = (start_loss + end_loss) / 2
        return out


def _span_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy of (batch, seq) logits with positions (out of range: ignored) or distributions."""
    if targets.is_floating_point():
        return F.cross_entropy(logits.float(), targets.float())
    seq = logits.shape[1]
    return F.cross_entropy(logits.float(), targets.clamp(0, seq), ignore_index=seq)


TaskModel = BertForSequenceClassification | BertForTokenClassification | BertForQuestionAnswering
