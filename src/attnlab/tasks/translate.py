"""Machine translation (Vaswani et al. 2017, sections 5-6): parallel text -> Transformer -> BLEU.

The recipe joins the parts: a joint BPE vocabulary (given, or learnt on the training pairs),
length-sorted token-count batches, the encoder-decoder ``Transformer`` of a preset size
trained by the one shared trainer with the paper's settings (label smoothing 0.1 inside the
model, Adam(0.9, 0.98, 1e-9), inverse-square-root warm-up; the trainer's gradient clipping
too, unless --clip-norm 0), validation loss and sacreBLEU during training, and, with
--average-last N (default 1), the average of the last checkpoints as the final model (section
6.1: "we used a single model obtained by averaging the last 5 checkpoints").

An output directory is a translation model: ``config.json`` (the TransformerConfig plus
``"model_type": "attnlab-transformer"``), ``model.safetensors``, ``tokenizer.json``, and the
run's ``metrics.jsonl``, ``loss.png`` and ``checkpoints/``; ``best/`` holds the model of the
best validation BLEU.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import Tensor, nn

from attnlab import fast
from attnlab.config import TRANSFORMER_PRESETS, TransformerConfig
from attnlab.decode import MAX_BEAM, SearchOptions, translate_batches
from attnlab.errors import AttnlabError, first_line
from attnlab.interop.hf import all_finite
from attnlab.io import clear_dir, write_text_atomic, write_with_atomic
from attnlab.metrics import corpus_bleu
from attnlab.models.seq2seq import Transformer
from attnlab.tasks.job import Job, run_job
from attnlab.text.bpe import BpeTokenizer, train_bpe_from_texts
from attnlab.text.parallel import (
    EncodedPairs,
    ParallelText,
    TokenBatches,
    encode_pairs,
    encode_source,
    pad_batch,
    read_parallel,
)
from attnlab.train.checkpoint import MODEL_FILE, complete_checkpoints
from attnlab.train.config import RunOptions
from attnlab.train.optim import planned_warmup
from attnlab.train.trainer import (
    CHECKPOINT_DIR,
    TrainConfig,
    Trainer,
    check_run_out,
    has_checkpoint,
    holds_run,
)

FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names
WARMUP_SHARE = 0.1  # the default warm-up's share of a run's steps (at most the paper's 4,000)
MODEL_TYPE = "attnlab-transformer"  # config.json marker of a translation model directory
CONFIG_FILE = "config.json"
BEST_DIR = "best"
# Defaults of options left unset: a paper-like run on the user's data, or a quick one of a
# 2-layer, d_model-128 model on the bundled sample.
RUN_DEFAULTS: dict[str, Any] = {
    "preset": "transformer-small",
    "steps": 100_000,  # the paper's base model trains for 100k steps
    "max_tokens": 4096,
    "eval_every": 1000,
    "save_every": 1000,
}
SAMPLE_DEFAULTS: dict[str, Any] = {
    "preset": "transformer-small",
    "sample_model": {"d_model": 128, "d_ff": 512, "n_encoder_layers": 2, "n_decoder_layers": 2},
    "steps": 400,
    "max_tokens": 1024,
    "eval_every": 100,
    "save_every": 100,
}


def bundled_pairs() -> Path:
    """The small German -> English sample shipped with attnlab (see attnlab/data/README.md)."""
    return Path(str(resources.files("attnlab").joinpath("data/parallel_sample.tsv")))


# ---------------------------------------------------------------------------- model directory


def save_model_dir(
    out: Path, config: TransformerConfig, tokenizer: BpeTokenizer, model: nn.Module | None = None
) -> None:
    """Write config.json and the tokenizer files (and model.safetensors when a model is given)."""
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(
        out / CONFIG_FILE, json.dumps({"model_type": MODEL_TYPE, **config.to_dict()}, indent=2)
    )
    tokenizer.save(out)
    if model is not None:
        write_with_atomic(out / MODEL_FILE, lambda tmp: save_model(model, str(tmp)))


def read_model_config(model_dir: Path) -> TransformerConfig:
    """The TransformerConfig of a translation model directory, or a one-line reason it is not one."""
    if model_dir.exists() and not model_dir.is_dir():
        raise AttnlabError(f"{model_dir} is a file: pass a translation model directory")
    if not model_dir.is_dir():
        raise AttnlabError(f"model directory {model_dir} not found")
    path = model_dir / CONFIG_FILE
    if not path.is_file():
        raise AttnlabError(f"no {CONFIG_FILE} in {model_dir}: is this a translation model?")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as err:
        raise AttnlabError(f"cannot read {path}: {err}") from None
    kind = data.get("model_type") if isinstance(data, dict) else None
    if kind != MODEL_TYPE:
        raise AttnlabError(
            f"{model_dir} is not an attnlab translation model (config.json model_type is "
            f"{kind!r}, expected {MODEL_TYPE!r}): use a directory written by `attnlab translate train`"
        )
    return TransformerConfig.from_dict({k: v for k, v in data.items() if k != "model_type"})


def load_translation_model(model_dir: str | Path) -> tuple[Transformer, BpeTokenizer]:
    """The Transformer (eval mode) and tokenizer of a translation model directory."""
    root = Path(model_dir)
    config = read_model_config(root)
    tokenizer = BpeTokenizer.from_dir(root)
    if tokenizer.vocab_size > min(config.src_vocab_size, config.tgt_vocab_size):
        raise AttnlabError(
            f"the tokenizer in {root} has {tokenizer.vocab_size} tokens but the model only "
            f"{min(config.src_vocab_size, config.tgt_vocab_size)}: are they from the same run?"
        )
    weights = root / MODEL_FILE
    if not weights.is_file():
        raise AttnlabError(
            f"no {MODEL_FILE} in {root}: the training run has not finished (continue it with "
            "`attnlab translate train --resume`)"
        )
    model = Transformer(config)
    try:
        with safe_open(str(weights), "pt") as stored:  # integers would be cast in silence
            kinds = {name: stored.get_slice(name).get_dtype() for name in stored.keys()}  # noqa: SIM118
        odd = next((name for name, kind in kinds.items() if kind not in FLOAT_DTYPES), None)
        if odd is not None:
            raise AttnlabError(f"weight {odd} in {weights} holds {kinds[odd]}, not floats")
        load_model(model, str(weights), strict=True)
    except AttnlabError:
        raise
    except Exception as err:  # safetensors raises several types; name the file instead
        raise AttnlabError(f"cannot load {weights}: {first_line(err)}") from None
    for name, tensor in model.state_dict().items():  # NaN would make every output garbage
        if tensor.is_floating_point() and not all_finite(tensor):
            raise AttnlabError(f"weight {name} in {weights} holds NaN or infinite values")
    return model.eval(), tokenizer


# ---------------------------------------------------------------------------- translating


def translate_lines(
    model: Transformer,
    tokenizer: BpeTokenizer,
    lines: Sequence[str] | str,
    beam: int = 4,
    length_penalty: float = 0.6,
    batch_size: int = 64,
    max_len_a: float = 1.2,
    max_len_b: float = 10,
    use_cache: bool = True,
    on_truncate: Callable[[int], None] | None = None,
    workers: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """One detokenized translation per line, in input order (an empty line gives "").

    ``workers`` batches decode at once, sharing the torch threads (decode/batches.py: map_batches);
    None: one per thread on CPU, 1 on a GPU. A single string is one line. progress(n) is told
    of each n lines done.
    """
    if isinstance(lines, str):
        lines = [lines]
    if not all(isinstance(line, str) for line in lines):
        bad = next(line for line in lines if not isinstance(line, str))
        raise AttnlabError(f"lines must be strings, got a {type(bad).__name__}")
    if batch_size < 1:
        raise AttnlabError("batch_size must be at least 1", options=("batch_size",))
    if workers is not None and workers < 1:
        raise AttnlabError("workers must be at least 1", options=("workers",))
    options = SearchOptions(beam, length_penalty, max_len_a, max_len_b, use_cache)
    config = model.config
    todo = [i for i, line in enumerate(lines) if line.strip()]
    ids, truncated = [], 0
    for raw in tokenizer.encode_batch([lines[i].strip() for i in todo]):
        source, cut = encode_source(raw, tokenizer.eos_id, config.max_positions)
        ids.append(source)
        truncated += cut
    if truncated and on_truncate is not None:
        on_truncate(truncated)
    device = next(model.parameters()).device
    # Longest first, so batches hold sentences of similar length (little padding) and the
    # first batch shows at once whether the longest sentences fit in memory.
    order = sorted(range(len(ids)), key=lambda j: -len(ids[j]))
    chunks = [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
    batches = [(pad_batch([ids[j] for j in c], tokenizer.pad_id).to(device), None) for c in chunks]
    if workers is None:  # GPU kernels of two batches would only queue behind each other
        workers = torch.get_num_threads() if device.type == "cpu" else 1
    with fast.inference_twins(model):  # CPU attention routes
        hyps = _decode_batches(model, batches, chunks, workers, options, progress)
    if progress is not None:
        progress(len(lines) - len(todo))  # the empty lines
    outputs = [""] * len(lines)
    for chunk, batch_hyps in zip(chunks, hyps, strict=True):
        for j, text in zip(chunk, tokenizer.decode_batch(batch_hyps), strict=True):
            outputs[todo[j]] = text
    return outputs


def _decode_batches(
    model: Transformer,
    batches: list[tuple[Tensor, None]],
    chunks: list[list[int]],
    workers: int,
    options: SearchOptions,
    progress: Callable[[int], None] | None,
) -> list[list[list[int]]]:
    """translate_batches on all batches; with progress, a few rounds of workers at a time."""
    if progress is None:
        return translate_batches(model, batches, workers, options)
    # A round ends when its slowest batch does: several batches per worker keep that wait
    # short, and the batches of a round, sorted by length, take about as long as each other.
    step = 4 * workers
    hyps: list[list[list[int]]] = []
    for start in range(0, len(batches), step):
        hyps += translate_batches(model, batches[start : start + step], workers, options)
        progress(sum(len(chunk) for chunk in chunks[start : start + step]))
    return hyps


# ---------------------------------------------------------------------------- training


@dataclass(kw_only=True)
class TranslateOptions(RunOptions):
    """Settings of a translation run (the shared ones in RunOptions), named as the CLI flags."""

    out: Path
    train: list[Path] = field(default_factory=list)  # [src, tgt] or [tsv]; empty: bundled sample
    valid: list[Path] = field(default_factory=list)  # empty: hold out part of --train
    preset: str | None = None  # None: transformer-small (smaller still on the bundled sample)
    model_config: dict[str, Any] = field(default_factory=dict)  # TransformerConfig overrides
    tokenizer: Path | None = None
    vocab_size: int | None = None  # None: 8000, for a vocabulary learnt on --train
    max_tokens: int | None = None  # None: 4096 (1024 on the bundled sample)
    steps: int | None = None  # None: 100k (the paper's base run), 400 on the bundled sample
    max_minutes: float | None = None
    lr: float = 7e-4  # the peak; the paper's d_model^-0.5 * 4000^-0.5 is 7e-4 for d_model 512
    warmup: int | None = None  # None: 4000 (the paper), at most 10% of steps
    grad_accum: int = 1
    clip_norm: float = 1.0  # gradient-norm clipping, 0: none (the paper does not clip)
    dropout: float | None = None
    label_smoothing: float | None = None
    average_last: int = 1  # > 1: the final model averages the last N checkpoints
    eval_sentences: int = 200  # validation pairs translated for BLEU at each evaluation
    eval_beam: int = 1  # greedy by default: fast enough to run often
    # RunOptions' settings whose defaults differ here
    save_every: int | None = None  # None: 1000 (100 on the bundled sample)
    keep_last: int = 5
    eval_every: int | None = None  # None: 1000 (100 on the bundled sample)
    log_every: int = 50

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        self.train = _paths(self.train, "train")
        self.valid = _paths(self.valid, "valid")
        if self.tokenizer is not None:
            self.tokenizer = Path(self.tokenizer)
        defaults = SAMPLE_DEFAULTS if not self.train else RUN_DEFAULTS
        # Whether the model was asked for (a resumed run keeps its own: see prepare).
        self.model_given = bool(
            self.preset is not None
            or self.model_config
            or self.dropout is not None
            or self.label_smoothing is not None
        )
        if self.preset is None and not self.model_config:
            self.model_config = dict(defaults.get("sample_model", {}))
        for name in ("preset", "steps", "max_tokens", "eval_every", "save_every"):
            if getattr(self, name) is None:
                setattr(self, name, defaults[name])

    def validate(self) -> None:
        """Raise AttnlabError for impossible settings, before anything is written."""
        super().validate()
        if self.preset not in TRANSFORMER_PRESETS:
            raise AttnlabError(
                f"unknown preset {self.preset!r} (choose from {', '.join(TRANSFORMER_PRESETS)})",
                options=("preset",),
            )
        if not isinstance(self.model_config, dict):
            raise AttnlabError("model_config must be a table of TransformerConfig fields")
        fields = {f.name for f in dataclasses.fields(TransformerConfig)}
        unknown = sorted(set(self.model_config) - fields)
        if unknown:  # said as "config: unknown field(s)", after the BPE was learnt
            raise AttnlabError(
                f"model_config: unknown TransformerConfig field(s) {', '.join(unknown)} (in "
                "TOML, every key after the [model_config] line belongs to that table)"
            )
        if self.vocab_size is not None and self.tokenizer is not None:
            raise AttnlabError(  # it would be ignored in silence
                "vocab_size sizes a vocabulary learnt on train; tokenizer brings its own: "
                "drop one of them",
                options=("vocab_size", "train", "tokenizer"),
            )
        for name in ("vocab_size", "max_tokens", "grad_accum", "average_last", "eval_beam"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise AttnlabError(f"{name} must be at least 1", options=(name,))
        if self.eval_beam > MAX_BEAM:
            raise AttnlabError(
                f"eval_beam must be at most {MAX_BEAM}, got {self.eval_beam}",
                options=("eval_beam",),
            )
        if self.steps < 1:
            raise AttnlabError("steps must be at least 1", options=("steps",))
        if self.eval_every < 0 or self.save_every < 0:
            raise AttnlabError(
                "eval_every and save_every must be >= 0", options=("eval_every", "save_every")
            )
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise AttnlabError("max_minutes must be > 0", options=("max_minutes",))
        if self.eval_sentences < 0:
            raise AttnlabError("eval_sentences must be >= 0", options=("eval_sentences",))
        if not 0 <= self.clip_norm < math.inf:
            raise AttnlabError(
                f"clip_norm must be a finite number >= 0, got {self.clip_norm}",
                options=("clip_norm",),
            )


def _paths(value: Any, name: str) -> list[Path]:
    if value is None:
        return []
    items = [value] if isinstance(value, (str, Path)) else list(value)
    if len(items) > 2:
        raise AttnlabError(
            f"{name} takes SRC TGT files or one TSV file, got {len(items)} files", options=(name,)
        )
    return [Path(str(item)) for item in items]


def check_out_dir(opts: TranslateOptions) -> None:
    """Refuse an --out that holds files or another run, unless resuming or overwriting."""
    out = opts.out
    started = (out / CONFIG_FILE).is_file() or holds_run(out)
    inputs = [*opts.train, *opts.valid, opts.tokenizer]
    check_run_out(out, opts.resume, opts.overwrite, started, "translation", inputs)
    if opts.resume and started:
        read_model_config(out)  # a run of another kind cannot be continued


@dataclass
class TranslationData:
    """What a run trains and evaluates on, built and checked before any write."""

    tokenizer: BpeTokenizer
    config: TransformerConfig
    batches: TokenBatches
    valid: EncodedPairs | None
    valid_text: ParallelText | None  # untokenized: BLEU translates sources and scores text
    messages: list[str]


def read_data(opts: TranslateOptions) -> tuple[ParallelText, ParallelText | None, list[str]]:
    """Training and validation pairs (--valid, or pairs held out of --train), with notes."""
    notes = []
    train = read_parallel(opts.train or [bundled_pairs()])
    if not opts.train:
        notes.append(f"training on the bundled German->English sample ({bundled_pairs().name})")
    if train.skipped:
        notes.append(f"skipped {train.skipped} training pair(s) with an empty side")
    if len(train) == 0:
        raise AttnlabError("the training data holds no sentence pair with text on both sides")
    if opts.valid:
        valid = read_parallel(opts.valid)
        if valid.skipped:
            notes.append(f"skipped {valid.skipped} validation pair(s) with an empty side")
        if len(valid) == 0:
            raise AttnlabError(
                "valid holds no sentence pair with text on both sides", options=("valid",)
            )
        return train, valid, notes
    held = min(500, len(train) // 10)
    if held < 1:
        return train, None, [*notes, "no --valid and too few pairs to hold some out: no evaluation"]
    order = list(range(len(train)))
    random.Random(opts.seed).shuffle(order)
    notes.append(f"no --valid: holding out {held} of the {len(train)} training pairs")
    return _subset(train, order[held:]), _subset(train, order[:held]), notes


def _subset(pairs: ParallelText, rows: list[int]) -> ParallelText:
    rows = sorted(rows)
    return ParallelText([pairs.src[i] for i in rows], [pairs.tgt[i] for i in rows])


def prepare(opts: TranslateOptions, from_out: bool = False) -> TranslationData:
    """Read the pairs, get the vocabulary, size the model, tokenize and batch: no writes.

    The vocabulary and model config are the run's own (in --out) when resuming or when
    ``from_out`` (the other ranks, once rank 0 has written them).
    """
    train, valid, notes = read_data(opts)
    if from_out or (opts.resume and has_checkpoint(opts.out)):
        tokenizer = BpeTokenizer.from_dir(opts.out)
        config = read_model_config(opts.out)
        if not from_out and opts.model_given:
            check_same_model(opts, model_config(opts, tokenizer), config)
    else:
        if opts.tokenizer is not None:
            tokenizer = BpeTokenizer.from_dir(opts.tokenizer)
        else:
            vocab_size = 8000 if opts.vocab_size is None else opts.vocab_size
            tokenizer = train_bpe_from_texts([*train.src, *train.tgt], vocab_size)
        config = model_config(opts, tokenizer)
    encoded = encode_pairs(tokenizer, train, config.max_positions)
    if encoded.truncated:
        notes.append(
            f"warning: {encoded.truncated} training pair(s) longer than "
            f"{config.max_positions} tokens were truncated"
        )
    batches = TokenBatches(
        encoded, opts.max_tokens, tokenizer.pad_id, tokenizer.sos_id, tokenizer.eos_id, opts.seed,
        grad_accum=opts.grad_accum,
    )  # fmt: skip
    valid_encoded = encode_pairs(tokenizer, valid, config.max_positions) if valid else None
    return TranslationData(tokenizer, config, batches, valid_encoded, valid, notes)


def check_same_model(
    opts: TranslateOptions, asked: TransformerConfig, run: TransformerConfig
) -> None:
    """Refuse model options on --resume that differ from the run's own model (which it keeps)."""
    differ = [
        f"{name} {value!r} (the run's: {getattr(run, name)!r})"
        for name, value in dataclasses.asdict(asked).items()
        if getattr(run, name) != value
    ]
    if differ:
        raise AttnlabError(
            f"resume keeps the model of the run in {opts.out}, but the options ask for another: "
            f"{', '.join(differ)}; drop preset, dropout, label_smoothing or model_config, or "
            "start again with overwrite",
            options=("resume", "preset", "dropout", "label_smoothing", "overwrite"),
        )


def model_config(opts: TranslateOptions, tokenizer: BpeTokenizer) -> TransformerConfig:
    """The preset with the vocabulary's size and special ids, and the run's overrides."""
    overrides: dict[str, Any] = {
        "src_vocab_size": tokenizer.vocab_size,
        "tgt_vocab_size": tokenizer.vocab_size,
        "pad_id": tokenizer.pad_id,
        "bos_id": tokenizer.sos_id,
        "eos_id": tokenizer.eos_id,
    }
    if opts.dropout is not None:
        overrides["dropout"] = opts.dropout
    if opts.label_smoothing is not None:
        overrides["label_smoothing"] = opts.label_smoothing
    fixed = sorted(set(opts.model_config) & set(overrides))
    if fixed:
        raise AttnlabError(f"model_config: {', '.join(fixed)} come from the vocabulary and flags")
    return TransformerConfig.preset(opts.preset, **overrides, **opts.model_config)


def evaluation(
    data: TranslationData, max_tokens: int, n_bleu: int, beam: int
) -> Callable[[nn.Module], dict[str, float]] | None:
    """Validation loss and perplexity on every held-out pair, and BLEU on the first n_bleu."""
    valid = data.valid
    if valid is None:
        return None
    tok = data.tokenizer
    longest = max(max(len(s), len(t) + 1) for s, t in zip(valid.src, valid.tgt, strict=True))
    batches = TokenBatches(
        valid, max(max_tokens, longest), tok.pad_id, tok.sos_id, tok.eos_id, shuffle=False
    )
    bleu_src = data.valid_text.src[:n_bleu]
    bleu_refs = data.valid_text.tgt[:n_bleu]

    def evaluate(model: nn.Module) -> dict[str, float]:
        device = next(model.parameters()).device
        loss = nll = tokens = 0.0
        # Inference twins, swapped in for this evaluation only.
        with fast.inference_twins(model):
            for batch in batches.once():
                out = model(**{k: v.to(device) for k, v in batch.items()})
                n = float(out["n_tokens"])
                loss, nll, tokens = (
                    loss + float(out["loss"]) * n,
                    nll + float(out["nll_loss"]) * n,
                    tokens + n,
                )
        metrics = {
            "valid_loss": loss / tokens,
            "valid_nll_loss": nll / tokens,
            "valid_ppl": math.exp(min(nll / tokens, 50.0)),
        }
        if bleu_refs:
            hyps = translate_lines(model, tok, bleu_src, beam=beam)
            metrics["valid_bleu"] = corpus_bleu(hyps, bleu_refs)["bleu"]
        return metrics

    return evaluate


def average_checkpoints(paths: Sequence[Path]) -> dict[str, torch.Tensor]:
    """Element-wise mean of the model.safetensors weights of these checkpoint directories."""
    if not paths:
        raise AttnlabError("no checkpoints to average")
    total: dict[str, torch.Tensor] = {}
    for path in paths:
        weights = load_file(str(Path(path) / MODEL_FILE))
        if total and weights.keys() != total.keys():
            raise AttnlabError(f"checkpoint {path} holds other tensors than {paths[0]}")
        for name, tensor in weights.items():
            # Summed in float64: the mean of N float32 tensors is then exact to float32.
            total[name] = total[name] + tensor.double() if name in total else tensor.double()
    first = load_file(str(Path(paths[0]) / MODEL_FILE))
    return {name: (t / len(paths)).to(first[name].dtype) for name, t in total.items()}


def _write_run_files(opts: TranslateOptions, data: TranslationData) -> None:
    """Start --out: clear an overwritten run (as a whole), save config and vocabulary.

    A resumed run keeps its own files once it has a checkpoint; before that (a start killed
    early) they are written again.
    """
    out = opts.out
    if opts.overwrite:
        clear_dir(out)
    if not (opts.resume and has_checkpoint(out)):
        save_model_dir(out, data.config, data.tokenizer)


def _finish(
    opts: TranslateOptions, model: Transformer, data: TranslationData, evaluate: Any
) -> dict[str, Any]:
    """Publish model.safetensors: the average of the last checkpoints, or the final weights."""
    out = opts.out
    result: dict[str, Any] = {}
    if opts.average_last > 1:
        found = complete_checkpoints(out / CHECKPOINT_DIR)[-opts.average_last :]
        averaged = average_checkpoints([path for _, path in found])
        write_with_atomic(out / MODEL_FILE, lambda tmp: save_file(averaged, str(tmp)))
        load_model(model, str(out / MODEL_FILE), strict=True)
        result["averaged_steps"] = [step for step, _ in found]
        if evaluate is not None:  # what the averaging bought, on the same validation set
            was_training = model.training
            model.eval()
            with torch.no_grad():
                result["averaged_eval"] = evaluate(model)
            model.train(was_training)
    else:
        write_with_atomic(out / MODEL_FILE, lambda tmp: save_model(model, str(tmp)))
    return result


def trainer_config(opts: TranslateOptions) -> TrainConfig:
    """The shared trainer's settings for a translation run: Adam, inverse-sqrt schedule.

    The default warm-up is 10% of the steps, at most the paper's 4,000; under max_minutes, 10%
    of the steps the time allows (the trainer plans it once it knows its step rate).
    """
    steps = opts.steps
    default_warmup = opts.warmup is None
    return TrainConfig(
        out_dir=opts.out,
        steps=steps,
        lr=opts.lr,
        warmup=planned_warmup(steps, WARMUP_SHARE, 4000) if default_warmup else opts.warmup,
        warmup_share=WARMUP_SHARE if default_warmup else None,
        schedule="inverse_sqrt",
        optimizer="adam",  # with the paper's betas (0.9, 0.98) and eps 1e-9
        grad_accum=opts.grad_accum,
        clip_norm=opts.clip_norm or None,
        precision=opts.precision,
        seed=opts.seed,
        log_every=opts.log_every,
        eval_every=opts.eval_every,
        save_every=opts.save_every,
        keep_last=max(opts.keep_last, opts.average_last),  # averaging needs them on disk
        resume=opts.resume,
        overwrite=opts.overwrite,
        progress=opts.progress,
        best_metric="valid_bleu" if opts.eval_sentences else None,  # None if nothing to score
        max_seconds=opts.max_minutes * 60 if opts.max_minutes is not None else None,
        job={
            "train": [str(f) for f in opts.train],
            "valid": [str(f) for f in opts.valid],
            "max_tokens": opts.max_tokens,
        },
    )


@dataclass
class TranslationJob(Job):
    """A translation run's steps, in the order ``run_job`` calls them (tasks/job.py)."""

    opts: TranslateOptions
    config: TrainConfig
    say: Callable[[str], None]
    data: TranslationData = field(init=False)
    model: Transformer = field(init=False)
    evaluate: Callable[[nn.Module], dict[str, float]] | None = field(init=False, default=None)

    def check_out(self) -> None:
        """Refuse an --out that holds files or another run, unless resuming or overwriting."""
        check_out_dir(self.opts)

    def prepare(self, world_size: int) -> None:
        """Read the data, learn the vocabulary and check everything (rank 0)."""
        self.data = prepare(self.opts)
        self.data.batches.set_rank(0, world_size)  # refused before --overwrite clears --out

    def start_out(self) -> None:
        """Build the model (one too large for memory fails before any write), start --out."""
        for note in self.data.messages:
            self.say(note)
        self._build_model()
        _write_run_files(self.opts, self.data)

    def follow(self) -> None:
        """The vocabulary and model config rank 0 wrote, the same data and initial model."""
        self.data = prepare(self.opts, from_out=True)
        self._build_model()

    def _build_model(self) -> None:
        torch.manual_seed(self.opts.seed)  # the initial weights are part of the run
        self.model = Transformer(self.data.config)

    def trainer(self) -> Trainer:
        """The shared trainer, scoring loss and BLEU and keeping the best model in best/."""
        opts, data = self.opts, self.data
        evaluate = evaluation(data, opts.max_tokens, opts.eval_sentences, opts.eval_beam)
        config = self.config
        if evaluate is None:
            config = dataclasses.replace(config, best_metric=None)

        def keep_best(best_model: nn.Module, metrics: dict[str, float]) -> None:
            save_model_dir(opts.out / BEST_DIR, data.config, data.tokenizer, best_model)

        on_best = keep_best if config.best_metric is not None else None
        self.evaluate = evaluate
        model, speedups = fast.for_training(self.model), fast.TrainingSpeedups()
        return Trainer(model, data.batches, config, evaluate, on_best=on_best, speedups=speedups)

    def publish(self, trainer: Trainer, summary: dict[str, Any]) -> dict[str, Any]:
        """model.safetensors in --out: the last checkpoints' average, or the final weights."""
        summary.update(_finish(self.opts, self.model, self.data, self.evaluate))
        return summary


def train_translation(
    opts: TranslateOptions, say: Callable[[str], None] = lambda _: None
) -> dict[str, Any]:
    """Run (or resume) a translation training job; returns the trainer's summary."""
    opts.validate()
    config = trainer_config(opts)  # checked before anything is written
    return run_job(TranslationJob(opts, config, say))
