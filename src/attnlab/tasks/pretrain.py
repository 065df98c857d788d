"""BERT pretraining (Devlin et al. 2019, section 3.1 and appendix A): corpus -> masked examples -> trainer.

The recipe joins the parts: a WordPiece vocabulary (given, or trained on the corpus), the
tokenized corpus in memory-mapped arrays, examples built per epoch (NSP / SOP / full
sentences), dynamic masking (or static), a BertForPreTraining of a preset size, and the one
shared trainer (AdamW, warm-up + linear decay, clipping, checkpoints, resume, DDP). The output
directory is an HF-compatible checkpoint with its tokenizer.
"""

from __future__ import annotations

import itertools
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnlab import fast
from attnlab.config import BertConfig
from attnlab.errors import AttnlabError
from attnlab.interop.hf import load_bert, save_bert, weight_names
from attnlab.io import check_input_file, clear_dir, contents
from attnlab.models.bert import BertForPreTraining
from attnlab.nn.mode import eval_mode
from attnlab.tasks.job import Job, publish, run_job
from attnlab.text.corpus_cache import TokenizedCorpus
from attnlab.text.masking import MaskingCollator, static_generator
from attnlab.text.pretraining import OBJECTIVES, Example, ExampleBuilder
from attnlab.text.tokenizer import BertTokenizer, train_wordpiece
from attnlab.train.config import RunOptions
from attnlab.train.data import Batch
from attnlab.train.trainer import (
    Evaluate,
    TrainConfig,
    Trainer,
    check_run_out,
    has_checkpoint,
    holds_run,
)

MASKING_SETTINGS = ("whole_word_masking", "static_masking", "mask_prob", "max_predictions")
TOKENIZER_DIR = "tokenizer"  # inside the output: the vocabulary a resumed run must reuse
MAX_BATCH_SIZE, MAX_SEQ_LEN = 1 << 20, 1 << 16  # sanity bounds on batch_size, seq_len


def check_upper_bounds(batch_size: int, seq_len: int) -> None:
    """Refuse a batch_size or seq_len past any model here, before the corpus is read.

    A batch of 1e20 examples or such a sequence length overflowed deep in numpy and itertools.
    """
    for name, value, high in (
        ("batch_size", batch_size, MAX_BATCH_SIZE),
        ("seq_len", seq_len, MAX_SEQ_LEN),
    ):
        if value > high:
            raise AttnlabError(f"{name} must be at most {high}", options=(name,))


def bundled_corpus() -> Path:
    """The small Chinese + English corpus shipped with attnlab (see attnlab/data/README.md)."""
    return Path(str(resources.files("attnlab").joinpath("data/pretrain_sample.txt")))


def default_cache_dir() -> Path:
    """Where tokenized corpora are cached between runs ($ATTNLAB_CACHE or ~/.cache/attnlab)."""
    root = os.environ.get("ATTNLAB_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "attnlab"
    )
    return Path(root) / "corpora"


def example_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """The masking generator of global example `index` in `epoch` (dynamic masking)."""
    # One stream per example, not per batch: a rank masking its slice of a global batch draws
    # exactly what one process masking the whole batch would, so DDP equals one process.
    return static_generator(seed * 1_000_003 + epoch, index)


class PretrainingBatches:
    """The pretraining BatchSource: each step's global batch, split into micro-batches and ranks.

    One optimiser step reads ``batch_size`` examples. They are masked example by example (each
    with its own generator), cut into ``grad_accum`` micro-batches, and each micro-batch into
    ``world_size`` row slices; this rank gets its slices. Every micro-batch also carries
    ``mlm_normalizer`` = (masked tokens in the whole step) / (micro-batches x ranks), so that
    averaging over accumulation steps and DDP ranks gives exactly the loss (and gradient) of
    one process reading the whole batch at once: the mean over all masked tokens of the step.

    Position = (epoch, steps already read in that epoch); resuming regenerates the epoch's
    examples (cheap: no model work) and skips those. Static masking reuses epoch 0's examples
    and masks every epoch.
    """

    def __init__(
        self,
        builder: ExampleBuilder,
        collator: MaskingCollator,
        batch_size: int,
        grad_accum: int = 1,
        seed: int = 0,
        static_masking: bool = False,
    ) -> None:
        if batch_size % grad_accum:
            raise AttnlabError(
                f"batch_size {batch_size} must be divisible by grad_accum {grad_accum}",
                options=("batch_size", "grad_accum"),
            )
        self.builder, self.collator = builder, collator
        self.batch_size, self.grad_accum = batch_size, grad_accum
        self.seed, self.static = seed, static_masking
        self.epoch, self.position = 0, 0
        self.rank, self.world_size = 0, 1

    def set_rank(self, rank: int, world_size: int) -> None:
        """Take this rank's rows of every micro-batch."""
        if (self.batch_size // self.grad_accum) % world_size:
            raise AttnlabError(
                f"batch_size {self.batch_size} / grad_accum {self.grad_accum} must be "
                f"divisible by the {world_size} processes",
                options=("batch_size", "grad_accum"),
            )
        self.rank, self.world_size = rank, world_size

    def state_dict(self) -> dict[str, Any]:
        """Where the stream stands (read between optimiser steps)."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go back to a saved position."""
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def _step_batches(self, chunk: list[Example], first: int, epoch: int) -> list[Batch]:
        """This rank's micro-batches of one step; every rank masks the whole step to count N."""
        micro = self.batch_size // self.grad_accum
        share = micro // self.world_size
        batches, masked = [], 0
        for start in range(0, self.batch_size, micro):
            generators = [
                example_generator(self.seed, epoch, first + start + i) for i in range(micro)
            ]
            full = self.collator(chunk[start : start + micro], generators)
            masked += int((full["mlm_labels"] != -100).sum())
            rows = slice(self.rank * share, (self.rank + 1) * share)
            batches.append({k: v[rows] for k, v in full.items()})
        normalizer = torch.tensor(max(masked, 1) / (self.grad_accum * self.world_size))
        for batch in batches:
            batch["mlm_normalizer"] = normalizer
        return batches

    def __iter__(self) -> Iterator[Batch]:
        while True:
            epoch = 0 if self.static else self.epoch
            examples = itertools.islice(
                self.builder.epoch(epoch), self.position * self.batch_size, None
            )
            produced = False
            while True:
                chunk = list(itertools.islice(examples, self.batch_size))
                if len(chunk) < self.batch_size:
                    break  # drop the last incomplete batch: every step sees B examples
                step_batches = self._step_batches(chunk, self.position * self.batch_size, epoch)
                produced = True
                for i, batch in enumerate(step_batches):
                    if i == len(step_batches) - 1:
                        self.position += 1  # the step is read once its last micro-batch is
                    yield batch
            if not produced and self.position == 0:
                raise AttnlabError(
                    f"the corpus yields fewer than batch_size {self.batch_size} examples "
                    "per epoch: use a smaller batch or more text",
                    options=("batch_size",),
                )
            self.epoch, self.position = self.epoch + 1, 0


def evaluation(
    builder: ExampleBuilder, collator: MaskingCollator, n_examples: int, batch_size: int, seed: int
) -> Callable[[nn.Module], dict[str, float]]:
    """A fixed held-out set (same examples and masks every time) and the function that scores it."""
    examples = list(itertools.islice(builder.epoch(0), n_examples))
    batches = []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        gens = [example_generator(seed + 7919, 0, start + i) for i in range(len(chunk))]
        batches.append(collator(chunk, gens))

    def evaluate(model: nn.Module) -> dict[str, float]:
        totals = {
            "mlm_loss": 0.0,
            "mlm_correct": 0,
            "mlm_count": 0,
            "nsp_correct": 0,
            "nsp_count": 0,
        }
        device = next(model.parameters()).device
        with fast.inference_twins(model):  # e.g. no layer computes padding
            for batch in batches:
                batch = {k: v.to(device) for k, v in batch.items()}
                out = model(**batch)
                labels = batch["mlm_labels"][batch["mlm_labels"] != -100]
                if labels.numel():
                    logits = out["mlm_logits"].float()
                    totals["mlm_loss"] += float(
                        torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
                    )
                    totals["mlm_correct"] += int((logits.argmax(-1) == labels).sum())
                    totals["mlm_count"] += labels.numel()
                if "nsp_labels" in batch and "nsp_logits" in out:
                    predicted = out["nsp_logits"].argmax(-1)
                    totals["nsp_correct"] += int((predicted == batch["nsp_labels"]).sum())
                    totals["nsp_count"] += batch["nsp_labels"].numel()
        metrics = {}
        if totals["mlm_count"]:
            metrics["eval_mlm_loss"] = totals["mlm_loss"] / totals["mlm_count"]
            metrics["eval_mlm_accuracy"] = totals["mlm_correct"] / totals["mlm_count"]
        if totals["nsp_count"]:
            key = "eval_sop_accuracy" if builder.objective == "mlm+sop" else "eval_nsp_accuracy"
            metrics[key] = totals["nsp_correct"] / totals["nsp_count"]
        return metrics

    return evaluate


@dataclass(kw_only=True)
class PretrainOptions(RunOptions):
    """Settings of a pretraining run (the shared ones in RunOptions), named as the CLI flags."""

    out: Path
    corpus: list[Path] = field(default_factory=list)
    preset: str | None = None  # None: bert-mini (or --init's sizes)
    objective: str = "mlm+nsp"
    steps: int = 1000
    batch_size: int = 32
    seq_len: int = 128
    lr: float = 1e-4
    warmup: int | None = None  # None: 10% of steps (the paper: 10k of 1M)
    grad_accum: int = 1
    whole_word_masking: bool = False
    static_masking: bool = False
    mask_prob: float = 0.15
    max_predictions: int | None = None  # masked tokens per sequence at most (google: 20 at 128)
    eval_documents: int = 200
    eval_examples: int = 512
    compile: bool = False
    tokenizer: Path | None = None
    vocab_size: int | None = None  # None: 8000, for a vocabulary trained on the corpus
    init: Path | None = None
    position_encoding: str | None = None  # None: learned (BERT's)
    embedding_size: int | None = None
    share_layers: bool = False
    dropout: float | None = None  # None: the preset's 0.1 (hidden and attention dropout)
    cache_dir: Path | None = None

    def validate(self) -> None:
        """Raise AttnlabError for impossible settings, before anything is written."""
        super().validate()
        if self.objective not in OBJECTIVES:
            raise AttnlabError(
                f"unknown objective {self.objective!r} (choose from {', '.join(OBJECTIVES)})"
            )
        if self.vocab_size is not None and (self.init is not None or self.tokenizer is not None):
            raise AttnlabError(  # it would be ignored in silence
                "vocab_size sizes a vocabulary trained on the corpus; init and tokenizer "
                "bring their own: drop it",
                options=("vocab_size", "init", "tokenizer"),
            )
        for name in (
            "steps",
            "batch_size",
            "seq_len",
            "grad_accum",
            "vocab_size",
            "max_predictions",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:  # vocab_size None: the default
                raise AttnlabError(f"{name} must be at least 1", options=(name,))
        check_upper_bounds(self.batch_size, self.seq_len)
        for name in ("eval_documents", "eval_examples"):  # 0: no held-out evaluation
            if getattr(self, name) < 0:
                raise AttnlabError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.init is None and self.preset not in (None, *BertConfig.presets()):
            BertConfig.preset(self.preset)  # raises, naming the presets (before tokenizing)
        shape = {"preset": self.preset, "position_encoding": self.position_encoding,
                 "embedding_size": self.embedding_size, "dropout": self.dropout,
                 "share_layers": self.share_layers or None}  # fmt: skip
        given = [name for name, value in shape.items() if value is not None]
        if self.init is not None and given:  # they would be ignored in silence
            raise AttnlabError(
                f"init takes the model's shape from its checkpoint: drop {', '.join(given)}",
                options=("init", *given),
            )


def check_out_dir(opts: PretrainOptions) -> None:
    """Refuse an --out that holds files or another run, unless resuming or overwriting."""
    # The trainer checks this too, but the tokenizer is written before it starts. A run killed
    # before its first log row or checkpoint holds only its vocabulary.
    out = opts.out
    started = holds_run(out) or (out / TOKENIZER_DIR).is_dir()
    if not (opts.resume or opts.overwrite) and [p.name for p in contents(out)] == [TOKENIZER_DIR]:
        # what an earlier start that failed (out of memory, say) or was killed early leaves
        raise AttnlabError(
            f"out {out} holds only the vocabulary of a run stopped before its first "
            "checkpoint: pass resume or overwrite to start it again",
            options=("out", "resume", "overwrite"),
        )
    inputs = [*opts.corpus, opts.tokenizer, opts.init, opts.cache_dir]
    check_run_out(out, opts.resume, opts.overwrite, started, "pretraining", inputs)


def run_tokenizer(opts: PretrainOptions, files: list[Path]) -> BertTokenizer:
    """The run's vocabulary: a resumed run's own, --tokenizer, --init's, or one trained now."""
    saved = opts.out / TOKENIZER_DIR
    if opts.resume and has_checkpoint(opts.out):  # saved before the run's first step
        if not saved.is_dir():
            raise AttnlabError(
                f"resume: {opts.out} holds no pretraining run (no {TOKENIZER_DIR}/ beside its "
                "checkpoints): a run of another job cannot be continued here",
                options=("resume",),
            )
        return BertTokenizer.from_dir(saved)
    if opts.tokenizer is not None:
        return BertTokenizer.from_dir(opts.tokenizer)
    if opts.init is not None:
        return BertTokenizer.from_dir(opts.init)
    return train_wordpiece(files, 8000 if opts.vocab_size is None else opts.vocab_size)


def _save_tokenizer(opts: PretrainOptions, tokenizer: BertTokenizer) -> None:
    saved = opts.out / TOKENIZER_DIR
    if opts.resume and has_checkpoint(opts.out):  # the run's own vocabulary stays
        return
    if opts.overwrite:  # the old run goes as a whole, before this one writes anything
        clear_dir(opts.out)
    elif saved.exists():  # a start killed before its first checkpoint: begin it again
        shutil.rmtree(saved)
    opts.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(saved)


def build_model(opts: PretrainOptions, tokenizer: BertTokenizer) -> BertForPreTraining:
    """A fresh preset-sized BertForPreTraining, or one initialised from --init."""
    sentence_head = opts.objective != "mlm"
    if opts.init is not None:
        model = load_bert(opts.init, heads=True)
        if sentence_head and model.config.type_vocab_size < 2:  # segment B's id 1: no embedding
            raise AttnlabError(
                f"init {opts.init} has one token type (type_vocab_size 1): objective "
                f"{opts.objective} needs two sentences told apart; use objective mlm",
                options=("init", "objective"),
            )
        if sentence_head and model.nsp is None:  # a masked-LM-only checkpoint: add the head
            grown = BertForPreTraining(model.config, sentence_head=True)
            grown.load_state_dict(model.state_dict(), strict=False)  # NSP (pooler) fresh
            model = grown
        heads = [("cls.predictions", "masked-LM")]
        heads += [("cls.seq_relationship", "sentence (NSP/SOP)")] if sentence_head else []
        names = weight_names(opts.init)
        fresh = [head for prefix, head in heads if not any(k.startswith(prefix) for k in names)]
        if fresh:  # as finetune says of a new classifier
            print(
                f"note: --init {opts.init} has no {' or '.join(fresh)} head: it starts from "
                "random weights",
                file=sys.stderr,
            )
        if model.config.vocab_size < tokenizer.vocab_size:
            raise AttnlabError(
                "the init model's vocabulary is smaller than the tokenizer's", options=("init",)
            )
        if model.config.max_positions < opts.seq_len:
            raise AttnlabError(
                f"seq_len {opts.seq_len} is above the model's max positions "
                f"({model.config.max_positions})",
                options=("seq_len",),
            )
        if not sentence_head:  # a trained pooler may come without an NSP head: drop it too
            model.nsp, model.bert.pooler = None, None
        return model.train()
    config = BertConfig.preset(
        opts.preset or "bert-mini",
        vocab_size=tokenizer.vocab_size,
        pad_token_id=tokenizer.pad_id,
        position_encoding=opts.position_encoding or "learned",
        embedding_size=opts.embedding_size,
        share_layers=opts.share_layers,
    )
    if opts.dropout is not None:
        config = config.replace(dropout=opts.dropout, attention_dropout=opts.dropout)
    if opts.seq_len > config.max_positions:
        raise AttnlabError(
            f"seq_len {opts.seq_len} is above the model's max positions ({config.max_positions})",
            options=("seq_len",),
        )
    return BertForPreTraining(config, sentence_head=sentence_head)


@dataclass
class PretrainingData:
    """The training stream and held-out scorer of a run, built and checked before any write."""

    batches: PretrainingBatches
    evaluate: Callable[[nn.Module], dict[str, float]] | None


def prepare_data(
    opts: PretrainOptions, files: list[Path], tokenizer: BertTokenizer
) -> PretrainingData:
    """Tokenize (or reuse the cache), hold out documents, build examples, masking and batches."""
    corpus = TokenizedCorpus.build(
        files,
        tokenizer,
        opts.cache_dir or default_cache_dir(),
        chinese_words=opts.whole_word_masking,
        progress=opts.progress,
    )
    held_out = min(opts.eval_documents, corpus.n_documents // 10)
    train_view, eval_view = corpus.split(held_out) if held_out >= 2 else (corpus, None)
    collator = MaskingCollator(
        tokenizer.pad_id,
        tokenizer.mask_id,
        tokenizer.vocab_size,
        tokenizer.special_ids,
        mask_prob=opts.mask_prob,
        max_predictions=opts.max_predictions,
        whole_word=opts.whole_word_masking,
    )
    builder = ExampleBuilder(
        train_view, tokenizer.cls_id, tokenizer.sep_id, opts.seq_len, opts.objective, seed=opts.seed
    )
    if sum(1 for _ in itertools.islice(builder.epoch(0), opts.batch_size)) < opts.batch_size:
        raise AttnlabError(
            f"the corpus yields fewer than batch_size {opts.batch_size} examples per epoch: "
            "use a smaller batch or more text",
            options=("batch_size",),
        )
    batches = PretrainingBatches(
        builder, collator, opts.batch_size, opts.grad_accum, opts.seed, opts.static_masking
    )
    evaluate = None
    wanted = opts.eval_examples > 0
    if (
        wanted
        and eval_view is not None
        and (eval_view.n_documents >= 2 or opts.objective != "mlm+nsp")
    ):
        eval_builder = ExampleBuilder(
            eval_view, tokenizer.cls_id, tokenizer.sep_id, opts.seq_len, opts.objective, seed=12345
        )
        evaluate = evaluation(
            eval_builder, collator, opts.eval_examples, opts.batch_size, opts.seed
        )
    return PretrainingData(batches, evaluate)


@dataclass
class CorpusJob(Job):
    """A job trained on masked batches of a corpus (pretrain, distill): what both hold.

    ``opts`` are the job's options, ``pretraining_options()`` their corpus, batch and masking
    part; ``files`` the corpus files, ``config`` the trainer's.
    """

    opts: Any
    files: list[Path]
    config: TrainConfig
    tokenizer: BertTokenizer = field(init=False)
    data: PretrainingData = field(init=False)

    def pretraining_options(self) -> PretrainOptions:
        """The options that read the corpus and make its batches (pretraining's)."""
        return self.opts

    def check_out(self) -> None:
        """Refuse an out that holds files or another run, unless resuming or overwriting."""
        check_out_dir(self.pretraining_options())

    def _trainer(self, model: nn.Module, evaluate: Evaluate | None) -> Trainer:
        """The shared trainer on the masked batches, with the training speed-ups swapped in."""
        model, speedups = fast.for_training(model), fast.TrainingSpeedups()
        return Trainer(model, self.data.batches, self.config, evaluate, speedups=speedups)


@dataclass
class PretrainJob(CorpusJob):
    """A pretraining run's steps, in the order ``run_job`` calls them (tasks/job.py)."""

    opts: PretrainOptions
    model: BertForPreTraining = field(init=False)

    def prepare(self, world_size: int) -> None:
        """Make the vocabulary, tokenize and check the data, build the model (rank 0)."""
        self.tokenizer = run_tokenizer(self.opts, self.files)
        self._build()
        self.data.batches.set_rank(0, world_size)  # refused before --overwrite clears --out

    def start_out(self) -> None:
        """Clear an overwritten run and save the vocabulary the other ranks read."""
        _save_tokenizer(self.opts, self.tokenizer)

    def follow(self) -> None:
        """The same data and initial model from rank 0's vocabulary."""
        self.tokenizer = BertTokenizer.from_dir(self.opts.out / TOKENIZER_DIR)
        self._build()

    def _build(self) -> None:
        self.data = prepare_data(self.opts, self.files, self.tokenizer)
        torch.manual_seed(self.opts.seed)  # the initial weights are part of the run
        self.model = build_model(self.opts, self.tokenizer)

    def trainer(self) -> Trainer:
        """The shared trainer on the masked batches, scoring the held-out examples."""
        return self._trainer(self.model, self.data.evaluate)

    def publish(self, trainer: Trainer, summary: dict[str, Any]) -> dict[str, Any]:
        """The trained model in --out, an HF checkpoint with its tokenizer."""
        publish_bert(self.model, self.tokenizer, self.opts.out)
        return summary


def pretrain(opts: PretrainOptions) -> dict[str, Any]:
    """Run (or resume) a pretraining job; returns the trainer's summary."""
    opts.validate()
    config = trainer_config(opts, warmup_divisor=10)  # 10% warm-up; checked before any write
    files = [Path(f) for f in opts.corpus] or [bundled_corpus()]
    for file in files:
        check_input_file(file, "corpus file")
    return run_job(PretrainJob(opts, files, config))


def trainer_config(opts: Any, warmup_divisor: int) -> TrainConfig:
    """The shared trainer's settings from a job's options (pretrain, distill): AdamW, linear decay."""
    return TrainConfig(
        out_dir=opts.out,
        steps=opts.steps,
        lr=opts.lr,
        warmup=opts.warmup if opts.warmup is not None else opts.steps // warmup_divisor,
        schedule="linear",
        optimizer="adamw",
        grad_accum=getattr(opts, "grad_accum", 1),
        precision=opts.precision,
        compile=opts.compile,
        seed=opts.seed,
        log_every=opts.log_every,
        eval_every=opts.eval_every,
        save_every=opts.save_every,
        keep_last=opts.keep_last,
        resume=opts.resume,
        overwrite=opts.overwrite,
        progress=opts.progress,
        job={  # distill's options have a teacher, not an objective
            "corpus": [str(f) for f in opts.corpus],
            "batch_size": opts.batch_size,
            "seq_len": opts.seq_len,
            **{k: str(getattr(opts, k)) for k in ("objective", "teacher") if hasattr(opts, k)},
            # the masking: a resumed run without --whole-word-masking changed it in silence
            **{k: getattr(opts, k) for k in MASKING_SETTINGS if hasattr(opts, k)},
        },
    )


def publish_bert(model: BertForPreTraining, tokenizer: BertTokenizer, out: Path) -> None:
    """Save a trained BERT into out/ (HF layout) through a stage directory (pretrain, distill)."""
    save_bert(model.eval(), out / "final.tmp", tokenizer, overwrite=True)
    publish(out / "final.tmp", out)


# ---------------------------------------------------------------------------- fill-mask


@torch.inference_mode()
def fill_mask(
    model: BertForPreTraining,
    tokenizer: BertTokenizer,
    text: str,
    top_k: int = 5,
    on_truncate: Callable[[int], None] | None = None,
) -> list[list[tuple[str, float]]]:
    """For each [MASK] in text, the top_k (token, probability) predictions of the MLM head.

    Probabilities are over every row of the model's vocabulary, as in HF's fill-mask
    pipeline; a row past the tokenizer's tokens is shown as the token "".

    A text longer than the model's positions is cut to them (on_truncate gets its length in
    tokens); a [MASK] that the cut would drop is an error. The model runs in evaluation mode
    (no dropout) and is left in the mode it came in.
    """
    if not isinstance(model, BertForPreTraining):
        raise AttnlabError(
            f"fill_mask needs a model with its masked-LM head, got {type(model).__name__} "
            "(load_bert(..., heads=True))"
        )
    if top_k < 1:
        raise AttnlabError("top_k must be at least 1", options=("top_k",))
    limit = model.config.max_positions
    enc = tokenizer.encode(text, max_length=limit)
    ids = torch.tensor([enc.ids])
    positions = (ids[0] == tokenizer.mask_id).nonzero().flatten()
    shown = text if len(text) <= 60 else text[:57] + "..."
    if enc.truncated:
        tokens = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(text))
        if tokens.count(tokenizer.mask_id) > len(positions):
            raise AttnlabError(
                f"a [MASK] in {shown!r} lies beyond the model's {limit} positions "
                f"(the text has {len(tokens) + 2} tokens): shorten the text before it"
            )
        if on_truncate is not None:
            on_truncate(len(tokens) + 2)
    if len(positions) == 0:
        raise AttnlabError(f"no [MASK] in {shown!r}: mark each position to fill with [MASK]")
    with eval_mode(model):
        hidden = model.bert(ids, token_type_ids=torch.tensor([enc.type_ids])).last_hidden_state
        probs = torch.softmax(model.mlm(hidden[0, positions]).float(), dim=-1)
    top = probs.topk(min(top_k, probs.shape[-1]), dim=-1)
    # A model may have more rows than its tokenizer has tokens (vocab_size padded past
    # vocab.txt); such a row has no token, shown as "" as in HF's fill-mask pipeline.
    known = tokenizer.vocab_size
    return [
        [
            (tokenizer.convert_ids_to_tokens([i])[0] if i < known else "", prob)
            for i, prob in zip(idx.tolist(), p.tolist(), strict=True)
        ]
        for p, idx in zip(top.values, top.indices, strict=True)
    ]
