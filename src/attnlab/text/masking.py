"""Masked-LM corruption, applied per batch (Devlin et al. 2019, §3.1 "Task #1: Masked LM").

Each sequence gets `round(n * mask_prob)` of its n maskable tokens chosen (at least one,
as google-research/bert's `create_masked_lm_predictions`), uniformly without replacement;
of those, 80% become [MASK], 10% a random token and 10% stay unchanged, and the model
predicts the originals. Masking per batch rather than once per corpus is RoBERTa's
dynamic masking (Liu et al. 2019, §4.1); static masking falls out of seeding one
generator per example (`static_generator`). Whole-word masking (google's
`--do_whole_word_mask`, Chinese BERT-wwm) chooses words instead of tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from attnlab.errors import AttnlabError
from attnlab.text.pretraining import Example

IGNORE_INDEX = -100  # label of a position that is not predicted (cross_entropy's default)
MASK_FRACTION, RANDOM_FRACTION = 0.8, 0.1  # of chosen tokens; the remaining 10% stay


def static_generator(seed: int, index: int) -> torch.Generator:
    """A generator for example `index` that is the same every epoch (static masking)."""
    # SeedSequence mixes (seed, index) so that neighbouring indices get unrelated streams.
    state = np.random.SeedSequence([seed, index]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state))


def mask_tokens(
    input_ids: torch.Tensor,
    maskable: torch.Tensor,
    generator: torch.Generator | Sequence[torch.Generator],
    mask_id: int,
    replacement_ids: torch.Tensor,
    mask_prob: float = 0.15,
    word_starts: torch.Tensor | None = None,
    max_predictions: int | None = None,
    lengths: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masked-LM corruption of a batch: (corrupted input_ids, labels).

    input_ids: (batch, seq) long; maskable: (batch, seq) bool, False at special tokens and
    padding; generator: one for the batch, or one per row (static masking); replacement_ids:
    (n,) long, the ids a random replacement is drawn from; word_starts: (batch, seq) bool,
    given for whole-word masking (a word is a start token and the non-start tokens after
    it; words holding an unmaskable token are never chosen); lengths: each row's unpadded
    length (default: seq). Labels hold the original id at chosen positions and IGNORE_INDEX
    elsewhere.
    """
    batch, seq = input_ids.shape
    lengths = [seq] * batch if lengths is None else list(lengths)
    generators = [generator] * batch if isinstance(generator, torch.Generator) else generator
    if len(generators) != batch or len(lengths) != batch:
        raise AttnlabError(f"masking a batch of {batch} rows needs one generator and length a row")
    if len(replacement_ids) == 0:
        raise AttnlabError("no token id is eligible as a random replacement")

    # Draws per row over the row's own length only, so a row's mask depends on its own
    # generator and tokens, not on its batch neighbours or the padding (static masking).
    scores = torch.ones(batch, seq)  # ranks positions; 1.0 never beats a draw in [0, 1)
    actions = torch.ones(batch, seq)  # < 0.8 -> [MASK], < 0.9 -> random token, else keep
    picks = torch.zeros(batch, seq, dtype=torch.long)  # index into replacement_ids
    for row, (length, rng) in enumerate(zip(lengths, generators, strict=True)):
        scores[row, :length] = torch.rand(length, generator=rng)
        actions[row, :length] = torch.rand(length, generator=rng)
        picks[row, :length] = torch.randint(len(replacement_ids), (length,), generator=rng)

    n_predict = _predictions_per_row(maskable, mask_prob, max_predictions)
    if word_starts is None:
        chosen = _choose_tokens(scores, maskable, n_predict)
    else:
        chosen = _choose_words(scores, maskable, word_starts, n_predict)

    labels = torch.where(chosen, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    corrupted = input_ids.clone()
    # The 80/10/10 decision is taken per token, whole-word masking included, as google
    # does: a chosen word may mix [MASK], random and kept tokens.
    to_mask = chosen & (actions < MASK_FRACTION)
    to_random = chosen & (actions >= MASK_FRACTION) & (actions < MASK_FRACTION + RANDOM_FRACTION)
    corrupted[to_mask] = mask_id
    corrupted[to_random] = replacement_ids[picks[to_random]]
    return corrupted, labels


def _predictions_per_row(
    maskable: torch.Tensor, mask_prob: float, max_predictions: int | None
) -> torch.Tensor:
    """How many tokens each row of maskable (batch, seq) has chosen: (batch,) long."""
    n_maskable = maskable.sum(dim=1)
    # google: round(n * p), at least one, at most max_predictions; here n counts maskable
    # tokens only, so [CLS] and [SEP] do not inflate the rate. In double precision, as
    # Python's round: in float32, 190 * 0.15 is 28.5 and rounds to 29, not google's 28.
    n_predict = torch.clamp(torch.round(n_maskable.double() * mask_prob), min=1)
    seq = maskable.shape[1]
    if max_predictions is not None and max_predictions < seq:  # a cap past seq caps nothing,
        n_predict = torch.clamp(n_predict, max=max_predictions)  # and past 2**63 overflows
    return torch.minimum(n_predict, n_maskable).long()


def _choose_tokens(
    scores: torch.Tensor, maskable: torch.Tensor, n_predict: torch.Tensor
) -> torch.Tensor:
    """The n_predict maskable positions of lowest score in each row (a uniform subset)."""
    keys = torch.where(maskable, scores, torch.full_like(scores, 2.0))
    order = keys.argsort(dim=1)
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(keys.shape[1]).expand_as(order).contiguous())
    return maskable & (ranks < n_predict[:, None])


def _choose_words(
    scores: torch.Tensor,
    maskable: torch.Tensor,
    word_starts: torch.Tensor,
    n_predict: torch.Tensor,
) -> torch.Tensor:
    """Whole words in random order, skipping any that would exceed n_predict tokens (google)."""
    chosen = torch.zeros_like(maskable)
    for row in range(maskable.shape[0]):
        ok = maskable[row].numpy()
        begins = word_starts[row].numpy().copy()
        begins[0] = True
        word_of = np.cumsum(begins) - 1  # word index of each position
        first_positions = np.flatnonzero(begins)
        sizes = np.bincount(word_of, minlength=len(first_positions))
        # A word holding a special token (say an [UNK] inside a jieba word) is never
        # chosen: masking only its other tokens would split it.
        candidates = np.flatnonzero(np.bincount(word_of[~ok], minlength=len(sizes)) == 0)
        order = candidates[np.argsort(scores[row].numpy()[first_positions[candidates]])]
        limit, count = int(n_predict[row]), 0
        taken = np.zeros(len(first_positions), dtype=bool)
        for word in order:
            if count >= limit:
                break
            if count + sizes[word] > limit:
                continue
            taken[word] = True
            count += sizes[word]
        chosen[row] = torch.from_numpy(taken[word_of])
    return chosen


class MaskingCollator:
    """Pads examples into a batch and applies BERT's masked-LM corruption."""

    def __init__(
        self,
        pad_id: int,
        mask_id: int,
        vocab_size: int,
        special_ids: set[int],
        mask_prob: float = 0.15,
        whole_word: bool = False,
        random_token_low: int = 0,
        max_predictions: int | None = None,
        pad_to_multiple_of: int | None = None,
    ) -> None:
        """Mask `mask_prob` of the non-special tokens, replacing some by ids >= random_token_low."""
        # random_token_low lets a checkpoint's vocabulary skip rows that never occur in
        # text (BERT's [unused*] tokens); special ids are never a replacement either way.
        if not 0.0 < mask_prob < 1.0:
            raise AttnlabError(f"mask_prob must lie in (0, 1), got {mask_prob}")
        if max_predictions is not None and max_predictions < 1:
            raise AttnlabError(f"max_predictions must be at least 1, got {max_predictions}")
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise AttnlabError(f"pad_to_multiple_of must be at least 1, got {pad_to_multiple_of}")
        self.pad_id, self.mask_id = pad_id, mask_id
        self.special_ids = torch.tensor(sorted(set(special_ids) | {pad_id, mask_id}))
        candidates = torch.arange(random_token_low, vocab_size)
        self.replacement_ids = candidates[~torch.isin(candidates, self.special_ids)]
        if len(self.replacement_ids) == 0:
            raise AttnlabError(
                f"no id in [{random_token_low}, {vocab_size}) is eligible as a random replacement"
            )
        self.mask_prob = mask_prob
        self.whole_word = whole_word
        self.max_predictions = max_predictions
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(
        self,
        examples: Sequence[Example],
        generator: torch.Generator | Sequence[torch.Generator],
    ) -> dict[str, torch.Tensor]:
        """Batch `examples`, masking with `generator`, or with one generator per example.

        Dynamic masking passes the trainer's generator (its state checkpoints with the
        run); static masking passes `[static_generator(seed, i) for i in indices]`, which
        masks example i the same way every epoch. Returns input_ids, attention_mask,
        token_type_ids, mlm_labels (all (batch, seq) long) and, when every example has a
        sentence-level label, nsp_labels (batch,) long.
        """
        if not examples:
            raise AttnlabError("cannot collate an empty batch")
        lengths = [len(example.input_ids) for example in examples]
        seq = max(lengths)
        if self.pad_to_multiple_of:
            seq = -(-seq // self.pad_to_multiple_of) * self.pad_to_multiple_of
        ids = np.full((len(examples), seq), self.pad_id, dtype=np.int64)
        types = np.zeros((len(examples), seq), dtype=np.int64)
        starts = np.ones((len(examples), seq), dtype=bool)
        attention = np.zeros((len(examples), seq), dtype=np.int64)
        for row, (example, length) in enumerate(zip(examples, lengths, strict=True)):
            ids[row, :length] = example.input_ids
            types[row, :length] = example.token_type_ids
            starts[row, :length] = example.word_starts
            attention[row, :length] = 1

        input_ids = torch.from_numpy(ids)
        maskable = torch.from_numpy(attention.astype(bool)) & ~torch.isin(
            input_ids, self.special_ids
        )
        corrupted, labels = mask_tokens(
            input_ids,
            maskable,
            generator,
            self.mask_id,
            self.replacement_ids,
            mask_prob=self.mask_prob,
            word_starts=torch.from_numpy(starts) if self.whole_word else None,
            max_predictions=self.max_predictions,
            lengths=lengths,
        )
        batch = {
            "input_ids": corrupted,
            "attention_mask": torch.from_numpy(attention),
            "token_type_ids": torch.from_numpy(types),
            "mlm_labels": labels,
        }
        sentence_labels = [example.label for example in examples]
        if all(label >= 0 for label in sentence_labels):
            batch["nsp_labels"] = torch.tensor(sentence_labels, dtype=torch.long)
        elif any(label >= 0 for label in sentence_labels):
            raise AttnlabError("a batch mixes examples with and without sentence-level labels")
        return batch
