"""Decoder-only language modelling (Radford et al. 2018/2019): text -> token stream -> GPT.

Training joins the parts: a vocabulary (the corpus's characters, a byte-level BPE learnt on
it, or a given one), the corpus tokenized once into a memory-mapped stream
(text/token_stream.py), windows of ``seq_len`` tokens at seeded random offsets predicting the
next token at every position (nanoGPT's recipe), a ``GPT`` of a preset size, and the one
shared trainer (AdamW, warm-up then linear decay, clipping, checkpoints, exact resume, DDP).
Without ``valid`` the last 10% of the stream is held out, as nanoGPT splits shakespeare; its
loss and perplexity = exp(loss) are measured every ``eval_every`` steps. Under ``max_minutes``
the trainer plans the run's length from its step rate while it warms up, so the warm-up and
the decay fit the steps the clock allows.

Scoring (``evaluate_lm``) is the mean next-token negative log-likelihood in nats: per line (a
line's first token is not predicted) or, with ``stride``, over the file as one stream by HF's
sliding-window method ("Perplexity of fixed-length models").

An output directory is a GPT model folder (G1's interop/gpt2.py layout: ``config.json``,
``model.safetensors``) with its tokenizer files, and the run's ``metrics.jsonl``, ``loss.png``,
``checkpoints/`` and ``lm_run.json`` (what a resumed run must reuse).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from attnlab import fast
from attnlab.config import GPTConfig
from attnlab.errors import AttnlabError
from attnlab.io import check_input_file, clear_dir, write_text_atomic
from attnlab.models.gpt import GPT
from attnlab.tasks.job import Job, publish, run_job
from attnlab.tasks.pretrain import default_cache_dir
from attnlab.text.lm_tokenizer import BYTE_BPE, CHAR, LMTokenizer, train_byte_bpe, train_char
from attnlab.text.token_stream import (
    TokenStream,
    WindowBatches,
    evaluation_windows,
    held_out_split,
    text_chunks,
)
from attnlab.train.config import STRATEGIES, RunOptions
from attnlab.train.optim import planned_warmup
from attnlab.train.trainer import TrainConfig, Trainer, check_run_out, has_checkpoint, holds_run

RUN_FILE = "lm_run.json"  # in --out: the model config, steps and warm-up a resume reuses
HELD_OUT_SHARE = 0.1
DEFAULT_STEPS = 5000  # a run's length when neither --steps nor --max-minutes sets it
TIMED_STEPS = 10**9  # a time-limited run's nominal length: the trainer's plan and the clock end it
WARMUP_SHARE, MOST_WARMUP = 0.1, 1000  # the default warm-up: 10% of the steps, at most 1000
GPT_BETAS, GPT_EPS = (0.9, 0.99), 1e-8  # nanoGPT's (beta2 0.99 for its small models)
# (largest d_model, peak learning rate): the first row whose width fits the model's. Narrower
# models take larger rates: GPT-3's table 2.1 (Brown et al. 2020) gives 6e-4 at 768 and 3e-4
# at 1024, nanoGPT's baby GPT 1e-3 at 384; gpt-char's 192 learns fastest here at 2e-3
# (bench/RESULTS.md, language-model quality).
LR_BY_WIDTH = ((256, 2e-3), (512, 1e-3), (768, 6e-4), (1024, 3e-4), (math.inf, 2e-4))


@dataclass(kw_only=True)
class LMOptions(RunOptions):
    """Settings of a language-model run (the shared ones in RunOptions), named as the CLI flags."""

    out: Path
    corpus: list[Path] = field(default_factory=list)
    valid: list[Path] = field(default_factory=list)  # empty: hold out the corpus's last 10%
    preset: str = "gpt-char"
    model_config: dict[str, Any] = field(default_factory=dict)  # GPTConfig overrides
    tokenizer: str | None = None  # "char", "byte-bpe" or a folder; None: char (or --init's)
    vocab_size: int | None = None  # a byte-level BPE learnt on corpus: None is 8000
    init: Path | None = None  # start from this GPT folder's weights
    seq_len: int = 256
    batch_size: int = 4  # small: on a CPU's budget more, smaller steps learn more (docs/lm.md)
    grad_accum: int = 1
    steps: int | None = None  # None: DEFAULT_STEPS, or as many as max_minutes allows
    max_minutes: float | None = None
    lr: float | None = None  # None: by the model's width (LR_BY_WIDTH), printed by the run
    warmup: int | None = None  # None: 10% of the steps the run makes, at most 1000
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    dropout: float | None = None  # None: the preset's
    position_encoding: str | None = None  # None: the preset's (learned, as GPT-2)
    eval_every: int | None = 500
    eval_tokens: int = 131072  # held-out tokens scored per evaluation (0: all)
    save_every: int | None = 500
    cache_dir: Path | None = None
    compile: bool = False
    strategy: str = "ddp"  # under torchrun: "ddp" or "fsdp" (TrainConfig.strategy)

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        self.corpus = [Path(p) for p in self.corpus]
        self.valid = [Path(p) for p in self.valid]
        if self.init is not None:
            self.init = Path(self.init)
        if self.cache_dir is not None:
            self.cache_dir = Path(self.cache_dir)

    def validate(self) -> None:
        """Raise AttnlabError for impossible settings, before anything is read or written."""
        # RunOptions checks a given lr; None is the run's to choose (default_lr)
        given = self if self.lr is not None else dataclasses.replace(self, lr=1.0)
        super(LMOptions, given).validate()
        if not self.corpus:
            raise AttnlabError("corpus: give at least one text file", options=("corpus",))
        for name in ("seq_len", "batch_size", "grad_accum", "steps"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise AttnlabError(f"{name} must be at least 1", options=(name,))
        for name in ("eval_tokens", "weight_decay", "clip_norm"):
            if not 0 <= getattr(self, name) < math.inf:
                raise AttnlabError(f"{name} must be a finite number >= 0", options=(name,))
        for name in ("warmup", "eval_every", "save_every"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise AttnlabError(f"{name} must be >= 0", options=(name,))
        if self.max_minutes is not None and not 0 < self.max_minutes < math.inf:
            raise AttnlabError("max_minutes must be a number > 0", options=("max_minutes",))
        if self.strategy not in STRATEGIES:
            raise AttnlabError(
                f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}",
                options=("strategy",),
            )
        if self.strategy == "fsdp" and self.compile:
            raise AttnlabError("strategy fsdp does not combine with compile",
                               options=("strategy", "compile"))  # fmt: skip
        if self.dropout is not None and not 0 <= self.dropout < 1:
            raise AttnlabError("dropout must be from 0 to below 1", options=("dropout",))
        if self.vocab_size is not None and self.tokenizer not in (None, BYTE_BPE):
            raise AttnlabError(
                "vocab_size sizes a byte-level BPE learnt on the corpus (tokenizer byte-bpe)",
                options=("vocab_size", "tokenizer"),
            )
        if not isinstance(self.model_config, dict):
            raise AttnlabError("model_config must be a table of GPTConfig fields")
        shape = {"preset": self.preset != "gpt-char", "model_config": bool(self.model_config),
                 "dropout": self.dropout is not None,
                 "position_encoding": self.position_encoding is not None}  # fmt: skip
        given = [name for name, on in shape.items() if on]
        if self.init is not None and given:  # they would be ignored in silence
            raise AttnlabError(
                f"init takes the model's shape from its folder: drop {', '.join(given)}",
                options=("init", *given),
            )
        if self.init is None:
            GPTConfig.preset(self.preset)  # an unknown preset is named before any tokenizing


# ---------------------------------------------------------------------------- the run


@dataclass
class RunPlan:
    """What a run fixes at its start and a resumed run reuses (lm_run.json)."""

    model_config: dict[str, Any]
    steps: int
    warmup: int


def read_plan(out: Path) -> RunPlan:
    """The plan a started run wrote in out."""
    path = out / RUN_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return RunPlan(dict(data["model_config"]), int(data["steps"]), int(data["warmup"]))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise AttnlabError(f"cannot read {path} ({err}): is {out} a language-model run?") from None


def check_out_dir(opts: LMOptions) -> None:
    """Refuse an --out that holds files or another run, unless resuming or overwriting."""
    out = opts.out
    started = holds_run(out) or (out / RUN_FILE).is_file()
    inputs = [*opts.corpus, *opts.valid, opts.init, opts.cache_dir]
    if opts.tokenizer not in (None, CHAR, BYTE_BPE):
        inputs.append(Path(opts.tokenizer))
    check_run_out(out, opts.resume, opts.overwrite, started, "language-model", inputs)
    if opts.resume and has_checkpoint(out) and not (out / RUN_FILE).is_file():
        raise AttnlabError(f"--resume: {out} holds a run of another job, not a language model")


def run_tokenizer(opts: LMOptions, from_out: bool) -> LMTokenizer:
    """The run's vocabulary: the run's own (resumed), a folder's, or one learnt on the text."""
    if from_out:
        return LMTokenizer.from_dir(opts.out)
    kind = opts.tokenizer
    if kind is None:
        if opts.init is not None:
            return LMTokenizer.from_dir(opts.init)
        kind = CHAR
    if kind == CHAR:  # the held-out text's characters too: scoring it must not fail on one
        return train_char([*opts.corpus, *opts.valid])
    if kind == BYTE_BPE:
        return train_byte_bpe(opts.corpus, 8000 if opts.vocab_size is None else opts.vocab_size)
    return LMTokenizer.from_dir(kind)


def model_config(opts: LMOptions, tokenizer: LMTokenizer) -> GPTConfig:
    """The preset with the vocabulary's size and the run's overrides."""
    overrides: dict[str, Any] = {"vocab_size": tokenizer.vocab_size}
    if opts.dropout is not None:
        overrides["dropout"] = overrides["attention_dropout"] = opts.dropout
    if opts.position_encoding is not None:
        overrides["position_encoding"] = opts.position_encoding
    fixed = sorted(set(opts.model_config) & set(overrides))
    if fixed:
        raise AttnlabError(f"model_config: {', '.join(fixed)} come from the vocabulary and flags")
    return GPTConfig.preset(opts.preset, **overrides, **opts.model_config)


class NextTokenLoss(nn.Module):
    """The trainer's view of a GPT: ``(input_ids, targets) -> {"loss": mean next-token NLL}``."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """input_ids, targets: (batch, seq); targets[i, t] is the token after input_ids[i, t]."""
        return {"loss": self.model(input_ids, targets=targets).loss}


def evaluation(
    tokens: np.ndarray, seq_len: int, max_tokens: int, batch_size: int
) -> Callable[[nn.Module], dict[str, float]] | None:
    """The held-out loss (mean NLL per predicted token, nats) and perplexity exp(loss)."""
    windows = evaluation_windows(tokens, seq_len, max_tokens)
    if not windows:
        return None
    length = windows[0][1]
    rows = np.stack([np.asarray(tokens[s : s + length + 1]) for s, _ in windows]).astype(np.int64)
    data = torch.from_numpy(rows)

    def evaluate(model: nn.Module) -> dict[str, float]:
        device = next(model.parameters()).device
        total = 0.0
        with fast.inference_twins(model):
            for start in range(0, len(data), batch_size):
                chunk = data[start : start + batch_size].to(device)
                loss = model(input_ids=chunk[:, :-1], targets=chunk[:, 1:])["loss"]
                total += float(loss) * chunk[:, 1:].numel()
        mean = total / (len(data) * length)
        return {"valid_loss": mean, "valid_ppl": math.exp(min(mean, 50.0))}

    return evaluate


@dataclass
class LMData:
    """A run's training windows and held-out scorer, built before any write."""

    batches: WindowBatches
    evaluate: Callable[[nn.Module], dict[str, float]] | None
    notes: list[str]


def prepare_data(opts: LMOptions, tokenizer: LMTokenizer) -> LMData:
    """Tokenize (or reuse the cached stream), hold out text, and draw the windows."""
    cache = opts.cache_dir or default_cache_dir()
    stream = TokenStream.build(opts.corpus, tokenizer, cache, progress=opts.progress).tokens
    notes = []
    if opts.valid:
        train, held = stream, TokenStream.build(opts.valid, tokenizer, cache).tokens
    else:
        train, held = held_out_split(stream, HELD_OUT_SHARE)
        notes.append(f"no --valid: holding out the last {len(held):,} of {len(stream):,} tokens")
    batches = WindowBatches(train, opts.seq_len, opts.batch_size, opts.grad_accum, opts.seed)
    evaluate = evaluation(held, opts.seq_len, opts.eval_tokens, opts.batch_size)
    if evaluate is None:
        notes.append("the held-out text is too short to score: no evaluation")
    return LMData(batches, evaluate, notes)


def default_lr(d_model: int) -> float:
    """The peak learning rate of LR_BY_WIDTH for a model of this width."""
    return next(lr for width, lr in LR_BY_WIDTH if d_model <= width)


def plan_run(opts: LMOptions, config: GPTConfig) -> RunPlan:
    """The steps and warm-up a run starts with (under max_minutes, the trainer plans both)."""
    if opts.max_minutes is not None:  # Trainer._plan_schedule, from its step rate
        steps = opts.steps if opts.steps is not None else TIMED_STEPS
        warmup = opts.warmup if opts.warmup is not None else MOST_WARMUP
        return RunPlan(config.to_dict(), steps, warmup)
    steps = opts.steps if opts.steps is not None else DEFAULT_STEPS
    cap = planned_warmup(steps, WARMUP_SHARE, steps) if steps > 1 else 0
    warmup = min(opts.warmup, cap) if opts.warmup is not None else min(cap, MOST_WARMUP)
    if opts.warmup is not None and warmup < opts.warmup:
        print(f"note: warmup {opts.warmup} cut to {warmup}, 10% of the {steps} steps",
              file=sys.stderr)  # fmt: skip
    return RunPlan(config.to_dict(), steps, warmup)


def trainer_config(opts: LMOptions, plan: RunPlan) -> TrainConfig:
    """The shared trainer's settings for a language-model run: AdamW, warm-up, linear decay."""
    return TrainConfig(
        out_dir=opts.out,
        steps=plan.steps,
        lr=opts.lr,
        warmup=plan.warmup,
        warmup_share=WARMUP_SHARE if opts.max_minutes is not None else None,
        schedule="linear",
        optimizer="adamw",
        weight_decay=opts.weight_decay,
        betas=GPT_BETAS,
        eps=GPT_EPS,
        grad_accum=opts.grad_accum,
        clip_norm=opts.clip_norm or None,
        precision=opts.precision,
        compile=opts.compile,
        strategy=opts.strategy,
        seed=opts.seed,
        log_every=opts.log_every,
        eval_every=opts.eval_every or 0,
        save_every=opts.save_every or 0,
        keep_last=opts.keep_last,
        resume=opts.resume,
        overwrite=opts.overwrite,
        progress=opts.progress,
        max_seconds=opts.max_minutes * 60 if opts.max_minutes is not None else None,
        job={
            "corpus": [str(f) for f in opts.corpus],
            "valid": [str(f) for f in opts.valid],
            "batch_size": opts.batch_size,
            "seq_len": opts.seq_len,
        },
    )


@dataclass
class LMJob(Job):
    """A language-model run's steps, in the order ``run_job`` calls them (tasks/job.py)."""

    opts: LMOptions
    say: Callable[[str], None]
    tokenizer: LMTokenizer = field(init=False)
    data: LMData = field(init=False)
    model: GPT = field(init=False)
    plan: RunPlan = field(init=False)

    def check_out(self) -> None:
        """Refuse an --out that holds files or another run, unless resuming or overwriting."""
        check_out_dir(self.opts)

    def prepare(self, world_size: int) -> None:
        """Vocabulary, token streams, model and plan (rank 0); nothing written."""
        opts = self.opts
        resumed = opts.resume and has_checkpoint(opts.out)
        self.tokenizer = run_tokenizer(opts, from_out=resumed)
        self.data = prepare_data(opts, self.tokenizer)
        self.data.batches.set_rank(0, world_size)  # refused before --overwrite clears --out
        if resumed:
            self.plan = read_plan(opts.out)
            self._build(GPTConfig.from_dict(self.plan.model_config))
            return
        self._build(self._initial_config())
        self.plan = plan_run(opts, self.model.config)

    def _initial_config(self) -> GPTConfig:
        opts = self.opts
        if opts.init is not None:
            from attnlab.interop.gpt2 import load_gpt

            config = load_gpt(opts.init).config
            if self.tokenizer.vocab_size > config.vocab_size:
                raise AttnlabError(
                    f"the tokenizer has {self.tokenizer.vocab_size} tokens, more than init "
                    f"{opts.init}'s vocabulary of {config.vocab_size}",
                    options=("init",),
                )
        else:
            config = model_config(opts, self.tokenizer)
        if opts.seq_len > config.max_positions:
            raise AttnlabError(
                f"seq_len {opts.seq_len} is above the model's {config.max_positions} positions",
                options=("seq_len",),
            )
        return config

    def _build(self, config: GPTConfig) -> None:
        torch.manual_seed(self.opts.seed)  # the initial weights are part of the run
        if self.opts.init is not None:
            from attnlab.interop.gpt2 import load_gpt

            self.model = load_gpt(self.opts.init).train()
        else:
            self.model = GPT(config)
        if self.opts.lr is None:  # the same on every rank and on resume: the width decides
            d_model = self.model.config.d_model
            self.opts.lr = default_lr(d_model)
            self.data.notes.append(f"lr {self.opts.lr:g} (default for d_model {d_model})")

    def start_out(self) -> None:
        """Clear --overwrite's old run; write the tokenizer and plan the other ranks read."""
        opts = self.opts
        for note in self.data.notes:
            self.say(note)
        if opts.overwrite:
            clear_dir(opts.out)
        if not (opts.resume and has_checkpoint(opts.out)):
            self.tokenizer.save(opts.out)
            write_text_atomic(opts.out / RUN_FILE, json.dumps(dataclasses.asdict(self.plan)))

    def follow(self) -> None:
        """The vocabulary and plan rank 0 wrote, the same data and initial model."""
        self.tokenizer = LMTokenizer.from_dir(self.opts.out)
        self.data = prepare_data(self.opts, self.tokenizer)
        self.plan = read_plan(self.opts.out)
        self._build(GPTConfig.from_dict(self.plan.model_config))

    def trainer(self) -> Trainer:
        """The shared trainer on the windows, scoring the held-out text."""
        model = fast.for_training(NextTokenLoss(self.model))
        config = trainer_config(self.opts, self.plan)
        return Trainer(model, self.data.batches, config, self.data.evaluate,
                       speedups=fast.TrainingSpeedups())  # fmt: skip

    def publish(self, trainer: Trainer, summary: dict[str, Any]) -> dict[str, Any]:
        """The trained model in --out: a GPT folder with its tokenizer."""
        from attnlab.interop.gpt2 import save_gpt

        stage = self.opts.out / "final.tmp"
        model = self.model
        if trainer.full_weights is not None:  # --strategy fsdp: self.model holds shards
            whole = NextTokenLoss(GPT(self.model.config))
            whole.load_state_dict(trainer.full_weights)
            model = whole.model
        model = fast.to_plain(model).eval()
        save_gpt(model, stage, self.tokenizer, overwrite=True, eos_id=self.tokenizer.eos_id)
        publish(stage, self.opts.out)
        if self.opts.max_minutes is not None:  # the trainer's plan is in its summary
            return summary
        return {**summary, "planned_steps": self.plan.steps, "planned_warmup": self.plan.warmup}


def train_lm(opts: LMOptions, say: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Run (or resume) a language-model training job; returns the trainer's summary."""
    opts.validate()
    for file in [*opts.corpus, *opts.valid]:
        check_input_file(file, "corpus file")
    if opts.tokenizer not in (None, CHAR, BYTE_BPE) and not Path(opts.tokenizer).is_dir():
        raise AttnlabError(
            f"tokenizer must be char, byte-bpe or a tokenizer folder; {opts.tokenizer} is none",
            options=("tokenizer",),
        )
    return run_job(LMJob(opts, say))


# ---------------------------------------------------------------------------- using a model


def load_lm(model_dir: str | Path) -> tuple[GPT, LMTokenizer]:
    """The GPT (eval mode) and tokenizer of a model folder (attnlab's or HF GPT-2's)."""
    from attnlab.interop.gpt2 import is_gpt_folder, load_gpt

    root = Path(model_dir)
    if not root.is_dir():
        raise AttnlabError(f"model folder {root} not found")
    if not is_gpt_folder(root):
        raise AttnlabError(
            f"{root} is not a GPT language model ({_model_type(root)}): give a folder written by "
            "`attnlab lm train` or HF GPT2LMHeadModel.save_pretrained"
        )
    tokenizer = LMTokenizer.from_dir(root)
    model = load_gpt(root).eval()
    if tokenizer.vocab_size > model.config.vocab_size:
        raise AttnlabError(
            f"the tokenizer in {root} has {tokenizer.vocab_size} tokens but the model only "
            f"{model.config.vocab_size}: are they from the same run?"
        )
    return model, tokenizer


def _model_type(root: Path) -> str:
    """What config.json says a folder holds, for an error message."""
    try:
        kind = json.loads((root / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return "no readable config.json"
    return f"config.json model_type {kind!r}"


@torch.inference_mode()
def _sum_nll(model: GPT, input_ids: torch.Tensor, targets: torch.Tensor) -> float:
    """Summed next-token NLL (nats) of targets (-100: not scored) given input_ids, both (batch, seq)."""
    logits = model(input_ids).logits.float()
    loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"
    )
    return float(loss)


def _result(nll: float, tokens: int) -> dict[str, Any]:
    if tokens == 0:
        raise AttnlabError("the data holds no token to predict (each line needs two or more)")
    loss = nll / tokens
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": tokens}


def score_lines(
    model: GPT, tokenizer: LMTokenizer, lines: list[str], batch_size: int = 16, where: str = "data"
) -> dict[str, Any]:
    """Mean NLL per predicted token, each line scored on its own from its first token."""
    context = model.config.max_positions
    encoded = []
    for number, line in enumerate(lines, 1):
        ids = tokenizer.encode(line, what=f"line {number} of {where}")
        if len(ids) > context:
            raise AttnlabError(
                f"line {number} of {where} has {len(ids)} tokens, more than the model's context "
                f"of {context}: score the file as one stream with a stride",
                options=("stride",),
            )
        if len(ids) >= 2:
            encoded.append(ids)
    encoded.sort(key=len)
    nll, tokens = 0.0, 0
    device = next(model.parameters()).device
    with fast.inference_twins(model):
        for start in range(0, len(encoded), batch_size):
            chunk = encoded[start : start + batch_size]
            longest = max(map(len, chunk))
            ids = torch.full((len(chunk), longest), tokenizer.pad_id, dtype=torch.long)
            targets = torch.full((len(chunk), longest - 1), -100, dtype=torch.long)
            for row, line_ids in enumerate(chunk):  # right-padded: a causal model's earlier
                ids[row, : len(line_ids)] = torch.tensor(line_ids)  # positions never see pads
                targets[row, : len(line_ids) - 1] = torch.tensor(line_ids[1:])
            nll += _sum_nll(model, ids[:, :-1].to(device), targets.to(device))
            tokens += int((targets != -100).sum())
    return _result(nll, tokens)


def sliding_windows(n_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored) of HF's sliding-window perplexity over a stream of n_tokens.

    Each window [begin, end) scores the tokens from ``first`` to end - 1 that no earlier window
    scored, so every token but the stream's first is scored once, with at least
    window - stride tokens of context once the first window is past.
    """
    spans, scored_to = [], 1  # the stream's first token is never predicted
    for begin in range(0, n_tokens, stride):
        end = min(begin + window, n_tokens)
        if end > scored_to:
            spans.append((begin, end, max(scored_to, begin + 1)))
            scored_to = end
        if end == n_tokens:
            break
    return spans


def score_stream(
    model: GPT, ids: list[int], stride: int, window: int | None = None, batch_size: int = 16
) -> dict[str, Any]:
    """Mean NLL per predicted token of one stream of ids, by sliding windows (HF's method)."""
    window = window or model.config.max_positions
    if not 1 <= window <= model.config.max_positions:
        raise AttnlabError(
            f"seq_len must be from 1 to the model's context of {model.config.max_positions}",
            options=("seq_len",),
        )
    if not 1 <= stride <= window:
        raise AttnlabError(f"stride must be from 1 to the window of {window}", options=("stride",))
    spans = sliding_windows(len(ids), window, stride)
    stream = torch.tensor(ids, dtype=torch.long)
    device = next(model.parameters()).device
    nll, tokens = 0.0, 0
    with fast.inference_twins(model):
        for start in range(0, len(spans), batch_size):
            group = spans[start : start + batch_size]
            for length in sorted({end - begin for begin, end, _ in group}):  # one shape a batch
                same = [span for span in group if span[1] - span[0] == length]
                inputs = torch.stack([stream[b:e] for b, e, _ in same])
                targets = torch.full((len(same), length - 1), -100, dtype=torch.long)
                for row, (begin, end, first) in enumerate(same):
                    targets[row, first - begin - 1 :] = stream[first:end]
                nll += _sum_nll(model, inputs[:, :-1].to(device), targets.to(device))
                tokens += int((targets != -100).sum())
    return _result(nll, tokens)


def evaluate_lm(
    model_dir: str | Path,
    data: str | Path,
    stride: int | None = None,
    seq_len: int | None = None,
    batch_size: int = 16,
) -> dict[str, Any]:
    """{"loss", "perplexity", "tokens"} of a model on a file: per line, or as a stream with stride."""
    if batch_size < 1:
        raise AttnlabError("batch_size must be at least 1", options=("batch_size",))
    if seq_len is not None and stride is None:
        raise AttnlabError("seq_len sets the window of the stride method", options=("seq_len",))
    path = check_input_file(Path(data), "data file")
    model, tokenizer = load_lm(model_dir)
    if stride is None:
        from attnlab.io import text_lines

        lines = [line.rstrip("\n").removesuffix("\r") for line in text_lines(path, "data file ")]
        return score_lines(model, tokenizer, lines, batch_size, where=str(path))
    exact = tokenizer.kind != BYTE_BPE
    ids = [i for chunk in text_chunks(path, exact_anywhere=exact)
           for i in tokenizer.encode(chunk, what=f"data file {path}")]  # fmt: skip
    return score_stream(model, ids, stride, seq_len, batch_size)


def check_sampling(
    max_new_tokens: int = 200,
    greedy: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    num_samples: int = 1,
    stop: str | None = None,
    truncate_left: bool = False,
) -> None:
    """Raise AttnlabError for a sampling setting no generation can use (before a model loads)."""
    if max_new_tokens < 1:
        raise AttnlabError("max_new_tokens must be at least 1", options=("max_new_tokens",))
    if num_samples < 1:
        raise AttnlabError("num_samples must be at least 1", options=("num_samples",))
    if not greedy and not 0 < temperature < math.inf:
        raise AttnlabError(
            f"temperature must be > 0 when sampling, got {temperature} (greedy takes the most "
            "likely token)",
            options=("temperature",),
        )
    if top_k is not None and top_k < 1:
        raise AttnlabError("top_k must be at least 1", options=("top_k",))
    if top_p is not None and not 0 < top_p <= 1:
        raise AttnlabError(f"top_p must be in (0, 1], got {top_p}", options=("top_p",))
    if seed is not None:
        from attnlab.train.config import check_seed

        check_seed(seed)
    if stop == "":
        raise AttnlabError("stop must be a non-empty text", options=("stop",))


def prompt_ids(
    tokenizer: LMTokenizer, prompt: str, room: int, truncate_left: bool, number: int = 1
) -> list[int]:
    """A prompt's ids, at most room of them (the end kept if truncate_left), never none.

    An empty prompt starts from <|endoftext|> (byte-level BPE, as GPT-2's unconditional
    samples) or a line break (characters, as nanoGPT's sample.py).
    """
    ids = tokenizer.encode(prompt, what=f"prompt {number}")
    if not ids:
        start = (
            tokenizer.eos_id
            if tokenizer.eos_id is not None
            else tokenizer.backend.token_to_id("\n")
        )
        if start is None:
            raise AttnlabError("an empty prompt needs a start: this vocabulary has no line break")
        ids = [start]
    if len(ids) > room:
        if not truncate_left:
            raise AttnlabError(
                f"prompt {number} has {len(ids)} tokens: with max_new_tokens that is more than "
                f"the model's context allows ({room} prompt tokens); shorten it, lower "
                "max_new_tokens or pass truncate_left",
                options=("max_new_tokens", "truncate_left"),
            )
        ids = ids[-room:]
    return ids


def generate_texts(
    model: GPT,
    tokenizer: LMTokenizer,
    prompts: list[str],
    max_new_tokens: int = 200,
    greedy: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    num_samples: int = 1,
    stop: str | None = None,
    truncate_left: bool = False,
    batch_size: int = 8,
    on_text: Callable[[str], None] | None = None,
) -> list[tuple[str, str]]:
    """(prompt, completion) for each prompt and sample, in order: the generated text only.

    Rows (prompt x sample) are generated batch_size at a time, prompts left-padded. A
    byte-level BPE's ``<|endoftext|>`` ends a sample; ``stop`` cuts it where that text first
    appears. ``on_text`` (one prompt and sample only) gets the text as each token completes it.
    The same seed gives the same samples.
    """
    from attnlab.decode.sampling import generate

    check_sampling(max_new_tokens, greedy, temperature, top_k, top_p, seed, num_samples, stop)
    if batch_size < 1:
        raise AttnlabError("batch_size must be at least 1", options=("batch_size",))
    if on_text is not None and len(prompts) * num_samples != 1:
        raise AttnlabError("on_text streams one prompt's one sample")
    room = model.config.max_positions - max_new_tokens
    if room < 1:
        raise AttnlabError(
            f"max_new_tokens {max_new_tokens} leaves no room for a prompt in the model's "
            f"context of {model.config.max_positions}",
            options=("max_new_tokens",),
        )
    rows = [prompt_ids(tokenizer, p, room, truncate_left, n) for n, p in enumerate(prompts, 1)]
    rows = [ids for ids in rows for _ in range(num_samples)]
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    device = next(model.parameters()).device
    stream = tokenizer.stream() if on_text is not None else None
    if stream is not None:
        next(stream)
    completions = []

    def show(step: int, tokens: torch.Tensor) -> None:
        on_text(stream.send(int(tokens[0])))

    with fast.inference_twins(model):  # the decoding twin takes the one-token steps
        for start in range(0, len(rows), batch_size):
            ids, mask = left_padded(rows[start : start + batch_size], tokenizer.pad_id)
            new = generate(
                model, ids.to(device), max_new_tokens,
                attention_mask=mask.to(device), do_sample=not greedy, temperature=temperature,
                top_k=top_k, top_p=top_p, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                generator=generator, on_token=show if stream is not None else None,
            )  # fmt: skip
            made = new[:, ids.shape[1] :].tolist()  # each row's generated ids
            completions += [_completion(tokenizer, row, stop) for row in made]
    sources = [p for p in prompts for _ in range(num_samples)]
    return list(zip(sources, completions, strict=True))


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of token ids -> ids and attention mask (rows, longest), padded on the left."""
    longest = max(map(len, prompts))
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for row, prompt in enumerate(prompts):  # every row ends at its prompt's last token
        ids[row, longest - len(prompt) :] = torch.tensor(prompt)
        mask[row, longest - len(prompt) :] = 1
    return ids, mask


def _completion(tokenizer: LMTokenizer, new_ids: list[int], stop: str | None) -> str:
    """The text of a row's generated ids, up to <|endoftext|> and before the stop text."""
    if tokenizer.eos_id is not None and tokenizer.eos_id in new_ids:
        new_ids = new_ids[: new_ids.index(tokenizer.eos_id)]
    text = tokenizer.decode(new_ids)
    return text.split(stop, 1)[0] if stop else text
