"""The positional-encoding lab: every scheme trained on the same budget, then scored past it.

``ablate_positions`` trains one model per positional scheme (nn/positions.py) and seed, with
the same preset, vocabulary (learnt once, shared), text, training length, steps, learning rate
and seed, then measures each model's held-out loss on windows of 1x, 2x, 4x, 8x ... the
training length: how well a scheme extrapolates. Two tasks: ``lm``, next-token prediction by a
GPT (tasks/lm.py; held-out loss per predicted token), and ``mlm``, BERT's masked LM
(tasks/pretrain.py; loss per masked token, masks fixed by a seed).

Every model is built for the longest evaluation (``max_positions``), except ``learned``: its
table has one row per trained position, as BERT's and GPT-2's, so it cannot score longer
windows, and those cells read "n/a (table)". Rows of a longer learned table would never be
trained, and their scores would measure random vectors, not the scheme.

The output directory holds ``ablation.json`` (the settings), ``runs/<scheme>-seed<k>/`` (each
model, and its ``result.json`` written atomically once scored), and the summary:
``results.json``, ``results.md`` and ``results.png``. A run started again with the same
settings skips every finished model and resumes an unfinished one from its checkpoint.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from attnlab.config import POSITION_ENCODINGS, check_field_types
from attnlab.errors import AttnlabError
from attnlab.io import (
    check_input_file,
    check_out_location,
    clear_dir,
    contents,
    lock_out_dir,
    write_text_atomic,
)

TASKS = ("lm", "mlm")
STATE_FILE = "ablation.json"  # the settings a resumed ablation must share
RESULT_FILE = "result.json"  # in each run's folder, once its model is trained and scored
TABLE_NOTE, TEXT_NOTE = "n/a (table)", "n/a (text)"
PROBE_STEPS = 10  # steps timed to turn minutes into a step count
DEFAULT_PRESETS = {"lm": "gpt-char", "mlm": "bert-mini"}
DEFAULT_LR = {"lm": 1e-3, "mlm": 5e-4}  # a small BERT from scratch learns slowly at 1e-4


@dataclass(kw_only=True)
class AblateOptions:
    """Settings of a positional-encoding ablation, named as the CLI flags."""

    out: Path
    corpus: list[Path]
    valid: list[Path] = field(default_factory=list)  # empty: the task's own held-out split
    task: str = "lm"
    preset: str | None = None  # None: gpt-char (lm) or bert-mini (mlm)
    model_config: dict[str, Any] = field(default_factory=dict)  # the preset's fields overridden
    steps: int = 1000
    minutes: float | None = None  # training minutes per model: the steps come from a probe
    schemes: list[str] = field(default_factory=lambda: list(POSITION_ENCODINGS))
    train_length: int = 128
    eval_lengths: list[int] = field(default_factory=lambda: [1, 2, 4, 8])  # x train_length
    seeds: int = 1
    seed: int = 0
    batch_size: int = 32
    lr: float | None = None  # None: 1e-3 (lm) or 5e-4 (mlm)
    eval_tokens: int = 32768  # held-out tokens scored at each length (the same text at each)
    overwrite: bool = False
    progress: bool = True
    cache_dir: Path | None = None

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        self.corpus = [Path(p) for p in self.corpus]
        self.valid = [Path(p) for p in self.valid]

    def validate(self) -> None:
        """Raise AttnlabError for impossible settings, before anything is read or written."""
        check_field_types(self, None)
        if self.task not in TASKS:
            raise AttnlabError(f"task must be lm or mlm, got {self.task!r}", options=("task",))
        if not self.corpus:
            raise AttnlabError("corpus: give at least one text file", options=("corpus",))
        unknown = [s for s in self.schemes if s not in POSITION_ENCODINGS]
        if unknown or not self.schemes or len(set(self.schemes)) != len(self.schemes):
            raise AttnlabError(
                f"schemes must name each scheme once, from {', '.join(POSITION_ENCODINGS)}"
                + (f" (unknown: {', '.join(unknown)})" if unknown else ""),
                options=("schemes",),
            )
        for name in ("steps", "train_length", "seeds", "batch_size"):
            if getattr(self, name) < 1:
                raise AttnlabError(f"{name} must be at least 1", options=(name,))
        if self.eval_tokens < 1:
            raise AttnlabError("eval_tokens must be at least 1", options=("eval_tokens",))
        lengths = self.eval_lengths
        if not lengths or min(lengths) < 1 or sorted(set(lengths)) != lengths:
            raise AttnlabError(
                "eval_lengths must be increasing multiples of the training length, each >= 1",
                options=("eval_lengths",),
            )
        if self.minutes is not None and not 0 < self.minutes < math.inf:
            raise AttnlabError("minutes must be a number > 0", options=("minutes",))
        if self.lr is not None and not 0 < self.lr < math.inf:
            raise AttnlabError("lr must be a number > 0", options=("lr",))
        per_run = {"position_encoding", "max_positions", "vocab_size", "pad_token_id"}
        fixed = sorted(per_run & set(self.model_config))
        if fixed:
            raise AttnlabError(
                f"model_config: the ablation sets {', '.join(fixed)} itself",
                options=("model_config",),
            )

    @property
    def model_preset(self) -> str:
        """The preset every model is built from."""
        return self.preset or DEFAULT_PRESETS[self.task]

    @property
    def peak_lr(self) -> float:
        """The learning rate every model trains with."""
        return self.lr if self.lr is not None else DEFAULT_LR[self.task]

    def settings(self) -> dict[str, Any]:
        """What every run shares and a resumed ablation must keep: all but where it writes, what
        it shows, and which schemes and seeds it runs (more of those extend an ablation)."""
        kept = asdict(self)
        for name in ("out", "overwrite", "progress", "cache_dir", "schemes", "seeds"):
            kept.pop(name)
        kept.update(preset=self.model_preset, lr=self.peak_lr)
        return json.loads(json.dumps(kept, default=str))


def parse_schemes(text: str) -> list[str]:
    """'all' or 'a,b,...' -> scheme names (checked by AblateOptions.validate)."""
    if text.strip() == "all":
        return list(POSITION_ENCODINGS)
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_lengths(text: str) -> list[int]:
    """'1,2,4,8' -> [1, 2, 4, 8]."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise AttnlabError(
            f"eval_lengths must be integers separated by commas, got {text!r}",
            options=("eval_lengths",),
        ) from None


def table_size(scheme: str, opts: AblateOptions) -> int:
    """max_positions of a scheme's model: the training length for learned, else the longest evaluation."""
    if scheme == "learned":
        return opts.train_length
    return opts.train_length * opts.eval_lengths[-1]


# ---------------------------------------------------------------------------- the two tasks


class Runs(Protocol):
    """What the ablation needs of a task: shared data, one trained model per call, its scores."""

    def prepare(self) -> None:
        """Learn the shared vocabulary (saved in out/tokenizer) and read the held-out text."""
        ...

    def train(self, scheme: str, seed: int, steps: int, run_dir: Path) -> dict[str, Any]:
        """Train (or resume) one model into run_dir; the trainer's summary (step, wall_s)."""
        ...

    def score(self, run_dir: Path, length: int) -> float | str:
        """Held-out loss (nats per predicted token) of run_dir's model on windows of length,
        or why there is none (TABLE_NOTE, TEXT_NOTE)."""
        ...


def _save_whole(save: Callable[[Path], None], where: Path) -> None:
    """save(folder) into a stage renamed to where: a killed ablation leaves all of it or none."""
    stage = where.with_name(where.name + ".tmp")
    shutil.rmtree(stage, ignore_errors=True)
    save(stage)
    stage.rename(where)


def _resume_or_fresh(run_dir: Path) -> dict[str, bool]:
    """A job's resume/overwrite flags: continue run_dir's checkpoint, or start it afresh."""
    from attnlab.train.trainer import has_checkpoint

    if run_dir.exists() and has_checkpoint(run_dir):
        return {"resume": True, "overwrite": False}
    return {"resume": False, "overwrite": run_dir.exists()}


class MaskedLMRuns:
    """``mlm``: BERT pretraining (tasks/pretrain.py, objective mlm) from a seeded initial model."""

    def __init__(self, opts: AblateOptions) -> None:
        self.opts = opts

    def prepare(self) -> None:
        """A WordPiece vocabulary learnt on the corpus once, and the held-out documents."""
        from attnlab.tasks.pretrain import PretrainOptions, default_cache_dir
        from attnlab.text.corpus_cache import TokenizedCorpus
        from attnlab.text.masking import MaskingCollator
        from attnlab.text.tokenizer import BertTokenizer, train_wordpiece

        opts, saved = self.opts, self.opts.out / "tokenizer"
        if saved.is_dir():
            self.tokenizer = BertTokenizer.from_dir(saved)
        else:
            self.tokenizer = train_wordpiece(opts.corpus, 8000)
            _save_whole(self.tokenizer.save, saved)
        cache = opts.cache_dir or default_cache_dir()
        if opts.valid:
            self.held_out = TokenizedCorpus.build(opts.valid, self.tokenizer, cache)
        else:  # the documents pretrain holds out of the corpus, and so never trains on
            corpus = TokenizedCorpus.build(opts.corpus, self.tokenizer, cache)
            held = min(PretrainOptions(out=opts.out).eval_documents, corpus.n_documents // 10)
            if held < 2:
                raise AttnlabError(
                    f"the corpus has {corpus.n_documents} documents, too few to hold 2 out: "
                    "give valid text",
                    options=("valid",),
                )
            self.held_out = corpus.split(held)[1]
        t = self.tokenizer
        self.collator = MaskingCollator(t.pad_id, t.mask_id, t.vocab_size, t.special_ids)

    def _initial_model(self, scheme: str, seed: int) -> Path:
        """The seeded initial BertForPreTraining of this scheme, saved for pretrain's init."""
        import torch

        from attnlab.config import BertConfig
        from attnlab.interop.hf import save_bert
        from attnlab.models.bert import BertForPreTraining

        where = self.opts.out / "initial" / f"{scheme}-seed{seed}"
        config = BertConfig.preset(
            self.opts.model_preset,
            vocab_size=self.tokenizer.vocab_size,
            pad_token_id=self.tokenizer.pad_id,
            position_encoding=scheme,
            max_positions=table_size(scheme, self.opts),
            **self.opts.model_config,
        )
        torch.manual_seed(seed)
        model = BertForPreTraining(config, sentence_head=False)
        save_bert(model, where, self.tokenizer, overwrite=True)
        return where

    def train(self, scheme: str, seed: int, steps: int, run_dir: Path) -> dict[str, Any]:
        """pretrain(objective mlm) for steps from the seeded initial model."""
        from attnlab.tasks.pretrain import PretrainOptions, pretrain

        opts = self.opts
        job = PretrainOptions(
            out=run_dir, corpus=opts.corpus, init=self._initial_model(scheme, seed),
            objective="mlm", steps=steps, batch_size=opts.batch_size, seq_len=opts.train_length,
            lr=opts.peak_lr, eval_examples=0, save_every=max(steps // 4, 50), keep_last=1,
            seed=seed, progress=opts.progress, cache_dir=opts.cache_dir,
            **_resume_or_fresh(run_dir),
        )  # fmt: skip
        return pretrain(job)

    def score(self, run_dir: Path, length: int) -> float | str:
        """Mean loss per masked token (15%, masks fixed by a seed) of held-out windows of length."""
        import torch

        from attnlab.interop.hf import load_bert
        from attnlab.tasks.pretrain import evaluation
        from attnlab.text.pretraining import ExampleBuilder

        model = load_bert(run_dir, heads=True, trained_heads=True)
        if length > model.config.max_positions:
            return TABLE_NOTE
        t = self.tokenizer
        builder = ExampleBuilder(self.held_out, t.cls_id, t.sep_id, length, "mlm", seed=12345)
        n_examples = max(1, -(-self.opts.eval_tokens // length))
        evaluate = evaluation(builder, self.collator, n_examples, self.opts.batch_size, seed=0)
        with torch.no_grad():
            metrics = evaluate(model)
        return metrics.get("eval_mlm_loss", TEXT_NOTE)


class NextTokenRuns:
    """``lm``: a GPT trained by tasks/lm.py's job on the shared character vocabulary."""

    def __init__(self, opts: AblateOptions) -> None:
        self.opts = opts

    def prepare(self) -> None:
        """The characters of the corpus (and valid) once, and the held-out token stream."""
        from attnlab.tasks.lm import HELD_OUT_SHARE
        from attnlab.tasks.pretrain import default_cache_dir
        from attnlab.text.lm_tokenizer import LMTokenizer, train_char
        from attnlab.text.token_stream import TokenStream, held_out_split

        opts, saved = self.opts, self.opts.out / "tokenizer"
        if saved.is_dir():
            self.tokenizer = LMTokenizer.from_dir(saved)
        else:
            self.tokenizer = train_char([*opts.corpus, *opts.valid])
            _save_whole(self.tokenizer.save, saved)
        cache = opts.cache_dir or default_cache_dir()
        if opts.valid:  # as the job holds out: valid whole, else the corpus's last 10%
            self.held_out = TokenStream.build(opts.valid, self.tokenizer, cache).tokens
        else:
            stream = TokenStream.build(opts.corpus, self.tokenizer, cache).tokens
            self.held_out = held_out_split(stream, HELD_OUT_SHARE)[1]

    def train(self, scheme: str, seed: int, steps: int, run_dir: Path) -> dict[str, Any]:
        """train_lm for steps, the model's table sized by table_size."""
        from attnlab.tasks.lm import LMOptions, train_lm

        opts = self.opts
        job = LMOptions(
            out=run_dir, corpus=opts.corpus, valid=opts.valid, preset=opts.model_preset,
            model_config={**opts.model_config, "max_positions": table_size(scheme, opts)},
            tokenizer=str(opts.out / "tokenizer"), seq_len=opts.train_length,
            batch_size=opts.batch_size, steps=steps, lr=opts.peak_lr, position_encoding=scheme,
            eval_every=0, save_every=max(steps // 4, 50), keep_last=1, seed=seed,
            progress=opts.progress, cache_dir=opts.cache_dir, **_resume_or_fresh(run_dir),
        )  # fmt: skip
        return train_lm(job)

    def score(self, run_dir: Path, length: int) -> float | str:
        """Mean next-token loss over consecutive held-out windows of length tokens."""
        import torch

        from attnlab.tasks.lm import NextTokenLoss, evaluation, load_lm

        model, _ = load_lm(run_dir)
        if length > model.config.max_positions:
            return TABLE_NOTE
        if len(self.held_out) <= length:
            return TEXT_NOTE
        evaluate = evaluation(self.held_out, length, self.opts.eval_tokens, self.opts.batch_size)
        with torch.no_grad():
            return evaluate(NextTokenLoss(model).eval())["valid_loss"]


def task_runs(opts: AblateOptions) -> Runs:
    """The task's Runs."""
    return NextTokenRuns(opts) if opts.task == "lm" else MaskedLMRuns(opts)


# ---------------------------------------------------------------------------- the ablation


def _start(opts: AblateOptions) -> dict[str, Any]:
    """The ablation's state in out: made afresh, or read back when resuming the same settings."""
    state_file = opts.out / STATE_FILE
    if opts.overwrite and opts.out.exists():
        clear_dir(opts.out)
    if state_file.is_file():
        try:
            state = json.loads(state_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise AttnlabError(f"cannot read {state_file} ({err}): pass overwrite") from None
        if state.get("settings") != opts.settings():
            changed = sorted(
                k for k, v in opts.settings().items() if state.get("settings", {}).get(k) != v
            )
            raise AttnlabError(
                f"out {opts.out} holds an ablation with other settings ({', '.join(changed)}): "
                "give the same ones to resume it, or pass overwrite",
                options=("out", "overwrite"),
            )
        return state
    if contents(opts.out):
        raise AttnlabError(
            f"out {opts.out} already holds files that are no ablation (pass overwrite)",
            options=("out", "overwrite"),
        )
    opts.out.mkdir(parents=True, exist_ok=True)
    state = {"settings": opts.settings(), "steps": None if opts.minutes else opts.steps}
    write_text_atomic(state_file, json.dumps(state, indent=2))
    return state


def _planned_steps(
    opts: AblateOptions, runs: Runs, state: dict[str, Any], say: Callable[[str], None]
) -> int:
    """The step count every model trains for: --steps, or what a probe says fits in minutes."""
    if state["steps"] is not None:
        return int(state["steps"])
    probe = opts.out / "probe"
    shutil.rmtree(probe, ignore_errors=True)
    summary = runs.train(opts.schemes[0], opts.seed, PROBE_STEPS, probe)
    seconds_per_step = summary["wall_s"] / max(summary["step"], 1)
    shutil.rmtree(probe, ignore_errors=True)
    steps = max(1, int(opts.minutes * 60 / seconds_per_step))
    say(f"{seconds_per_step:.3f} s a step ({opts.schemes[0]}): {steps} steps in {opts.minutes} min")
    state.update(steps=steps, probe_seconds_per_step=seconds_per_step)
    write_text_atomic(opts.out / STATE_FILE, json.dumps(state, indent=2))
    return steps


def training_seconds(run_dir: Path, summary: dict[str, Any]) -> float:
    """A run's training time over all its sessions: its log's last elapsed_s (a resumed run's
    summary counts only its own session)."""
    from attnlab.train.log import METRICS_FILE

    log = run_dir / METRICS_FILE
    rows = log.read_text(encoding="utf-8").splitlines() if log.is_file() else []
    last = json.loads(rows[-1]) if rows else {}
    return float(last.get("elapsed_s", summary["wall_s"]))


def run_one(opts: AblateOptions, runs: Runs, scheme: str, seed: int, steps: int) -> dict[str, Any]:
    """Train and score one (scheme, seed); its result.json is written when both are done."""
    import time

    run_dir = opts.out / "runs" / f"{scheme}-seed{seed}"
    summary = runs.train(scheme, seed, steps, run_dir)
    began = time.perf_counter()
    losses = {}
    for multiple in opts.eval_lengths:
        length = multiple * opts.train_length
        losses[str(length)] = runs.score(run_dir, length)
    result = {
        "scheme": scheme,
        "seed": seed,
        "steps": summary["step"],
        "train_seconds": training_seconds(run_dir, summary),
        "score_seconds": time.perf_counter() - began,
        "loss": losses,
    }
    write_text_atomic(run_dir / RESULT_FILE, json.dumps(result, indent=2))
    return result


def ablate_positions(opts: AblateOptions, say: Callable[[str], None] = lambda _: None) -> dict:
    """Train and score every (scheme, seed) not yet done in out; write the summary; return it."""
    opts.validate()
    for file in [*opts.corpus, *opts.valid]:
        check_input_file(file, "corpus file")
    check_out_location(opts.out, [*opts.corpus, *opts.valid], "out")
    with lock_out_dir(opts.out, "out"):
        state = _start(opts)
        runs = task_runs(opts)
        runs.prepare()
        steps = _planned_steps(opts, runs, state, say)
        results = []
        for scheme in opts.schemes:
            for seed in range(opts.seed, opts.seed + opts.seeds):
                done = opts.out / "runs" / f"{scheme}-seed{seed}" / RESULT_FILE
                if done.is_file():
                    say(f"{scheme} seed {seed}: done before, kept")
                    results.append(json.loads(done.read_text(encoding="utf-8")))
                    continue
                say(f"{scheme} seed {seed}: training {steps} steps")
                results.append(run_one(opts, runs, scheme, seed, steps))
        from attnlab.tasks.ablate_report import write_report

        return write_report(opts, state, results)
