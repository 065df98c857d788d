"""BERT pretraining examples from a tokenized corpus (Devlin et al. 2019, §3.1 and Appendix A.2).

`ExampleBuilder` turns each document of a `TokenizedCorpus` (attnlab.text.corpus_cache) into
`[CLS] A [SEP] B [SEP]` pairs with google-research/bert's `create_instances_from_document`
logic: sentences are gathered into a chunk until a target length, A is a random prefix of the
chunk, and B is the rest (IsNext) or, half the time, text from another document (NotNext).
Two variants the notes name are built from the same corpus: RoBERTa's full sentences
without NSP (Liu et al. 2019, §4.2 "FULL-SENTENCES": packed across document ends) and
ALBERT's sentence-order prediction (Lan et al. 2020, §3.1). As google shuffles its
instances, an epoch's examples are mixed across documents (a shuffle buffer, so memory
stays bounded). Masking happens later, per batch, in `attnlab.text.masking`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from attnlab.errors import AttnlabError
from attnlab.text.corpus_cache import CorpusView, TokenizedCorpus

OBJECTIVES = ("mlm", "mlm+nsp", "mlm+sop")
IS_NEXT, NOT_NEXT = 0, 1  # NSP labels, HF's convention (SOP: 0 = in order, 1 = swapped)
NO_LABEL = -1  # the label of an 'mlm' example, which has no sentence-level task
# Examples an epoch mixes at a time: a long document's examples spread over this many
# (google shuffles all instances of a run in memory; here the buffer's slots bound it).
_SHUFFLE_BUFFER = 10_000


@dataclass
class Example:
    """One pretraining input: [CLS] A [SEP] B [SEP], or [CLS] A [SEP] for 'mlm'."""

    input_ids: np.ndarray  # int32 (seq,)
    token_type_ids: np.ndarray  # int8 (seq,): 0 for [CLS] A [SEP], 1 for B [SEP]
    word_starts: np.ndarray  # bool (seq,): specials and each segment's first token count as starts
    label: int  # NSP: 0 IsNext, 1 NotNext; SOP: 0 in order, 1 swapped; -1 for 'mlm'


# A segment under construction: token ids and word-start flags, concatenated sentences.
_Segment = tuple[np.ndarray, np.ndarray]


class ExampleBuilder:
    """Turns a tokenized corpus into pretraining examples, one reproducible pass per epoch."""

    def __init__(
        self,
        corpus: TokenizedCorpus | CorpusView,
        cls_id: int,
        sep_id: int,
        max_seq_len: int = 128,
        objective: str = "mlm+nsp",
        short_seq_prob: float = 0.1,
        seed: int = 0,
    ) -> None:
        """Build examples of at most `max_seq_len` tokens for `objective` (see OBJECTIVES)."""
        if objective not in OBJECTIVES:
            raise AttnlabError(
                f"unknown pretraining objective {objective!r}: "
                f"choose one of {', '.join(OBJECTIVES)}"
            )
        minimum = 3 if objective == "mlm" else 5  # room for the specials and 1 token a segment
        if not isinstance(max_seq_len, int) or max_seq_len < minimum:
            raise AttnlabError(
                f"max_seq_len must be an integer >= {minimum} for {objective}, got {max_seq_len!r}"
            )
        if not 0.0 <= short_seq_prob <= 1.0:
            raise AttnlabError(f"short_seq_prob must lie in [0, 1], got {short_seq_prob}")
        if corpus.n_documents == 0:
            raise AttnlabError("the corpus has no documents")
        if objective == "mlm+nsp" and corpus.n_documents < 2:
            raise AttnlabError(
                "the corpus has a single document (a blank line ends one): next-sentence "
                "prediction needs at least two (use objective mlm)",
                options=("objective",),
            )
        self.corpus = corpus
        self._base = corpus.corpus if isinstance(corpus, CorpusView) else corpus
        self.cls_id, self.sep_id = cls_id, sep_id
        self.max_seq_len = max_seq_len
        self.objective = objective
        self.short_seq_prob = short_seq_prob
        self.seed = seed

    def epoch(self, epoch: int) -> Iterator[Example]:
        """Yield one epoch's examples, the same for the same (seed, epoch)."""
        # A generator per (seed, epoch) rather than one carried across epochs: resuming at
        # epoch k needs no replay of epochs 0..k-1.
        rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
        documents = (int(d) for d in rng.permutation(self.corpus.n_documents))
        if self.objective == "mlm":
            examples = self._full_sentences(documents)
        else:
            examples = (e for d in documents for e in self._pair_examples(d, rng))
        # Without mixing, a document's examples would follow one another, and a long one
        # would fill whole batches with one topic.
        shuffle = np.random.Generator(np.random.PCG64([self.seed, epoch, 1]))
        yield from _shuffled(examples, _SHUFFLE_BUFFER, shuffle, self.max_seq_len)

    def count_epoch(self, epoch: int) -> int:
        """Number of examples `epoch(epoch)` yields (a full pass over the corpus)."""
        return sum(1 for _ in self.epoch(epoch))

    # ---- RoBERTa: full sentences, no sentence-level task -------------------------------------

    def _full_sentences(self, documents: Iterator[int]) -> Iterator[Example]:
        """Pack whole sentences into [CLS] text [SEP] up to max_seq_len, across documents.

        RoBERTa's FULL-SENTENCES: at a document's end packing goes on with the next one,
        after an extra [SEP]; so every example but the epoch's last is nearly full, where
        stopping at each document's end (DOC-SENTENCES) left short documents' examples
        mostly padding. A sentence longer than the budget is cut into budget-sized pieces
        that pack like sentences.
        """
        budget = self.max_seq_len - 2
        current: list[tuple[int, int] | None] = []  # token spans; None: a document separator
        length = 0
        for document in documents:
            if current and length < budget:
                current.append(None)
                length += 1
            for sentence in self.corpus.sentence_ids(document):
                start, end = self._span(sentence)
                for piece in range(start, end, budget):
                    size = min(piece + budget, end) - piece
                    if current and length + size > budget:
                        yield self._packed(current)
                        current, length = [], 0
                    current.append((piece, piece + size))
                    length += size
        if current:
            yield self._packed(current)

    def _packed(self, spans: list[tuple[int, int] | None]) -> Example:
        """[CLS] text [SEP] of token spans, None giving a [SEP] between documents."""
        while spans and spans[-1] is None:  # a separator with nothing after it
            spans = spans[:-1]
        return self._example(self._concat(spans), None, NO_LABEL)

    # ---- BERT (NSP) and ALBERT (SOP): segment pairs ------------------------------------------

    def _pair_examples(self, document: int, rng: np.random.Generator) -> Iterator[Example]:
        """google-research/bert's create_instances_from_document (SOP: see _sop_pair)."""
        # A range, each span read when its sentence joins a chunk: a list of the document's
        # spans would cost memory in proportion to the document's length.
        sentences = self.corpus.sentence_ids(document)
        max_tokens = self.max_seq_len - 3  # room for [CLS], [SEP], [SEP]
        # Mostly full-length sequences; sometimes shorter ones, so that pretraining also
        # sees the short inputs of fine-tuning.
        target = max_tokens
        if rng.random() < self.short_seq_prob:
            target = int(rng.integers(2, max_tokens + 1))

        chunk: list[tuple[int, int]] = []
        length = 0
        i = 0
        while i < len(sentences):
            span = self._span(sentences[i])
            chunk.append(span)  # at most target sentences: each holds a token
            length += span[1] - span[0]
            if i == len(sentences) - 1 or length >= target:
                a_end = 1 if len(chunk) < 2 else int(rng.integers(1, len(chunk)))
                if self.objective == "mlm+nsp":
                    a, b, label, unused = self._nsp_pair(document, chunk, a_end, target, rng)
                    i -= unused  # google puts the sentences of a NotNext B's place back
                else:
                    pair = self._sop_pair(chunk, a_end, rng)
                    a, b, label = pair if pair is not None else (None, None, NO_LABEL)
                if a is not None:
                    a, b = _truncate_pair(a, b, max_tokens, rng)
                    yield self._example(a, b, label)
                chunk, length = [], 0
            i += 1

    def _nsp_pair(
        self,
        document: int,
        chunk: list[tuple[int, int]],
        a_end: int,
        target: int,
        rng: np.random.Generator,
    ) -> tuple[_Segment, _Segment, int, int]:
        """A and B for NSP, the label, and how many chunk sentences go back unused."""
        a = self._concat(chunk[:a_end])
        # A one-sentence chunk has no true B, so google always makes it NotNext.
        if len(chunk) > 1 and rng.random() >= 0.5:
            return a, self._concat(chunk[a_end:]), IS_NEXT, 0
        # Any document but this one; google tries 10 random draws and may still land on
        # the same document in a small corpus, which would mislabel the pair.
        other = int(rng.integers(0, self.corpus.n_documents - 1))
        other += other >= document
        other_sentences = self.corpus.sentence_ids(other)
        first = int(rng.integers(0, len(other_sentences)))
        b_target = target - len(a[0])
        b_spans, b_length = [], 0
        for sentence in other_sentences[first:]:
            span = self._span(sentence)
            b_spans.append(span)
            b_length += span[1] - span[0]
            if b_length >= b_target:
                break
        return a, self._concat(b_spans), NOT_NEXT, len(chunk) - a_end

    def _sop_pair(
        self, chunk: list[tuple[int, int]], a_end: int, rng: np.random.Generator
    ) -> tuple[_Segment, _Segment, int] | None:
        """Two consecutive segments of one document, swapped half the time (label 1).

        A deliberate departure from ALBERT's code, which pairs a one-sentence chunk with
        another document's text (labelled swapped): here the sentence is cut at a random
        token instead, so every pair is in-document, as the paper's SOP is defined.
        """
        if len(chunk) > 1:
            a, b = self._concat(chunk[:a_end]), self._concat(chunk[a_end:])
        else:
            # A lone sentence (a one-sentence document, or one longer than the target)
            # still gives two consecutive segments when cut at a random token.
            start, end = chunk[0]
            if end - start < 2:
                return None
            cut = int(rng.integers(start + 1, end))
            a, b = self._concat([(start, cut)]), self._concat([(cut, end)])
        if rng.random() < 0.5:
            return b, a, 1
        return a, b, 0

    # ---- assembly -------------------------------------------------------------------------

    def _span(self, sentence: int) -> tuple[int, int]:
        """Token range of a sentence in the corpus arrays."""
        offsets = self._base.sentence_offsets
        return int(offsets[sentence]), int(offsets[sentence + 1])

    def _concat(self, spans: list[tuple[int, int] | None]) -> _Segment:
        """Token ids and word starts of spans, joined; None stands for a [SEP] (a word start)."""
        tokens, starts = self._base.tokens, self._base.word_starts
        sep, true = np.array([self.sep_id], dtype=tokens.dtype), np.ones(1, dtype=bool)
        ids = np.concatenate([sep if span is None else tokens[span[0] : span[1]] for span in spans])
        flags = [true if span is None else starts[span[0] : span[1]] for span in spans]
        return ids, np.concatenate(flags).astype(bool)

    def _example(self, a: _Segment, b: _Segment | None, label: int) -> Example:
        """[CLS] A [SEP] (B [SEP]) with segment ids and word starts."""
        cls = np.array([self.cls_id], dtype=np.int32)
        sep = np.array([self.sep_id], dtype=np.int32)
        true = np.ones(1, dtype=bool)
        a_starts = a[1].copy()
        # A segment cut mid-word (truncation, a split sentence) begins a word of its own.
        a_starts[0] = True
        ids = [cls, a[0].astype(np.int32), sep]
        starts = [true, a_starts, true]
        types = [np.zeros(len(a[0]) + 2, dtype=np.int8)]
        if b is not None:
            b_starts = b[1].copy()
            b_starts[0] = True
            ids += [b[0].astype(np.int32), sep]
            starts += [b_starts, true]
            types.append(np.ones(len(b[0]) + 1, dtype=np.int8))
        return Example(
            input_ids=np.concatenate(ids),
            token_type_ids=np.concatenate(types),
            word_starts=np.concatenate(starts),
            label=label,
        )


class _Slots:
    """A shuffle buffer's examples, kept in arrays allocated once rather than one object each.

    Thousands of small per-example arrays, each held for hundreds of steps, are scattered
    through the heap among a training step's large temporaries, and the process's memory
    grew step after step (seen with HF's BertForPreTraining in bench/pretrain_quality.py);
    with these slots it grows several times more slowly. A slot is copied out when drawn, so
    what the consumer holds is short-lived; the examples and their order are unchanged.
    """

    def __init__(self, size: int, max_len: int) -> None:
        self.ids = np.zeros((size, max_len), dtype=np.int32)
        self.types = np.zeros((size, max_len), dtype=np.int8)
        self.starts = np.zeros((size, max_len), dtype=bool)
        self.lengths = np.zeros(size, dtype=np.int64)
        self.labels = np.zeros(size, dtype=np.int64)

    def put(self, slot: int, example: Example) -> None:
        """Store example in slot (the slot's previous example is gone)."""
        n = len(example.input_ids)
        self.ids[slot, :n] = example.input_ids
        self.types[slot, :n] = example.token_type_ids
        self.starts[slot, :n] = example.word_starts
        self.lengths[slot], self.labels[slot] = n, example.label

    def get(self, slot: int) -> Example:
        """A copy of the example in slot."""
        n = int(self.lengths[slot])
        return Example(
            input_ids=self.ids[slot, :n].copy(),
            token_type_ids=self.types[slot, :n].copy(),
            word_starts=self.starts[slot, :n].copy(),
            label=int(self.labels[slot]),
        )


def _shuffled(
    items: Iterator[Example], size: int, rng: np.random.Generator, max_len: int
) -> Iterator[Example]:
    """items in a random order drawn from a buffer of `size` (a full shuffle if they fit)."""
    slots = _Slots(size, max_len)
    filled = 0
    for item in items:
        if filled < size:
            slots.put(filled, item)
            filled += 1
            continue
        slot = int(rng.integers(size))
        yield slots.get(slot)
        slots.put(slot, item)
    for slot in rng.permutation(filled):
        yield slots.get(int(slot))


def _truncate_pair(
    a: _Segment, b: _Segment, max_tokens: int, rng: np.random.Generator
) -> tuple[_Segment, _Segment]:
    """google-research/bert's truncate_seq_pair in closed form: trim to max_tokens in all."""
    # google removes one token at a time from the longer segment (B on a tie), each from
    # the front or the back with probability 1/2. The lengths that loop ends with are
    # computed directly, and the front cuts of each side drawn as one binomial, which is
    # the same distribution without a loop as long as a very long sentence.
    la, lb = len(a[0]), len(b[0])
    if la + lb <= max_tokens:
        return a, b
    short = min(la, lb)
    if max_tokens - short >= short:  # only the longer side is cut
        new_a, new_b = (max_tokens - lb, lb) if la > lb else (la, max_tokens - la)
    else:  # both are cut, ending within one token of each other (A the longer)
        new_a, new_b = (max_tokens + 1) // 2, max_tokens // 2
    return _trim(a, la - new_a, rng), _trim(b, lb - new_b, rng)


def _trim(segment: _Segment, remove: int, rng: np.random.Generator) -> _Segment:
    """Remove `remove` tokens, each from the front or the back with probability 1/2."""
    if remove == 0:
        return segment
    front = int(rng.binomial(remove, 0.5))
    end = len(segment[0]) - (remove - front)
    return segment[0][front:end], segment[1][front:end]
