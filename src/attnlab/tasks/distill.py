"""DistilBERT (Sanh et al. 2019): a smaller BERT trained to imitate a frozen teacher.

Section 2 of the paper: the student is the teacher with one layer in two, initialised from
those layers, trained on masked LM alone (no NSP head or pooler; unlike the paper it keeps
the token-type embeddings, so the result stays an ordinary HF BERT checkpoint). The loss
is a linear combination of three terms on pretraining's masked batches:

    L = alpha_ce * L_ce + alpha_mlm * L_mlm + alpha_cos * L_cos

``L_ce``: the distillation loss (Hinton et al. 2015), KL(teacher || student) between the MLM
distributions softened by a temperature T and scaled by T^2; ``L_mlm``: the student's own
masked-LM loss; ``L_cos``: 1 - cos between student and teacher last hidden states. Data,
masking, trainer and checkpoints are pretraining's (``attnlab.tasks.pretrain``) unchanged;
the output directory is an HF-compatible ``BertForMaskedLM`` checkpoint with the tokenizer.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.config import BertConfig
from attnlab.errors import AttnlabError
from attnlab.interop.hf import check_vocabulary, load_bert, read_config
from attnlab.io import check_input_file, check_out_location, clear_dir, resolved_path
from attnlab.models.bert import BertForPreTraining, count_parameters
from attnlab.nn.loss import SummedKLDivergence
from attnlab.tasks.job import run_job
from attnlab.tasks.pretrain import (
    CorpusJob,
    PretrainOptions,
    bundled_corpus,
    check_upper_bounds,
    prepare_data,
    publish_bert,
    trainer_config,
)
from attnlab.text.tokenizer import BertTokenizer
from attnlab.train.config import RunOptions
from attnlab.train.trainer import Evaluate, Trainer

_LAYER = re.compile(r"^bert\.encoder\.layers\.(\d+)\.(.+)$")

# ---------------------------------------------------------------------------- the student


def teacher_layer(index: int, n_student: int, n_teacher: int) -> int:
    """The teacher layer that initialises student layer `index`: 2*index when n_student = n_teacher/2."""
    # DistilBERT keeps one layer in two; spreading evenly extends that to any depth.
    return index * n_teacher // n_student


def student_from_teacher(
    teacher: BertForPreTraining, n_layers: int | None = None, preset: str | None = None
) -> BertForPreTraining:
    """An MLM-only student: the teacher's config with n_layers layers, or a preset size.

    With n_layers every weight is copied from the teacher: the embeddings, the MLM head and,
    for student layer i, teacher layer ``teacher_layer(i, ...)`` (2i for half the depth).
    With preset the model is fresh apart from the embeddings and MLM head, each tensor copied
    when its shape matches the teacher's (same width; a relative-bias table also needs the
    same number of heads). Copies, never shared tensors.
    """
    config = _student_config(teacher.config, n_layers, preset)
    student = BertForPreTraining(config, sentence_head=False)
    source, target = teacher.state_dict(), student.state_dict()
    n_teacher, n_student = len(teacher.bert.encoder.layers), len(student.bert.encoder.layers)
    chosen: dict[str, Tensor] = {}
    for name in target:
        match = _LAYER.match(name)
        if match is None:
            chosen[name] = source[name]
        elif n_layers is not None:
            index, rest = match.groups()
            picked = teacher_layer(int(index), n_student, n_teacher)
            chosen[name] = source[f"bert.encoder.layers.{picked}.{rest}"]
    # Every tensor whose shape fits is copied: all of them with n_layers; with a preset of
    # the teacher's width the embeddings and MLM head (a relative-bias table only if the head
    # count is the same too); with another width nothing but the vocabulary bias.
    fits = {name: tensor for name, tensor in chosen.items() if tensor.shape == target[name].shape}
    student.load_state_dict(fits, strict=False)  # copy_ into the student's own tensors
    return student.train()


def _student_config(base: BertConfig, n_layers: int | None, preset: str | None) -> BertConfig:
    """The student's config: the teacher's (base) with n_layers layers, or a preset's sizes."""
    if (n_layers is None) == (preset is None):
        raise AttnlabError(
            "give exactly one of student_layers and student_preset",
            options=("student_layers", "student_preset"),
        )
    if n_layers is not None:
        if not 1 <= n_layers < base.n_layers:
            raise AttnlabError(
                f"student_layers must be between 1 and {base.n_layers - 1} "
                f"(the teacher has {base.n_layers} layers)",
                options=("student_layers",),
            )
        config = base.replace(n_layers=n_layers)
    else:
        # The preset gives the sizes; the teacher fixes what the inputs and outputs mean.
        config = BertConfig.preset(
            preset,
            vocab_size=base.vocab_size,
            pad_token_id=base.pad_token_id,
            type_vocab_size=base.type_vocab_size,
            max_positions=base.max_positions,
            position_encoding=base.position_encoding,
            relative_buckets=base.relative_buckets,
            relative_max_distance=base.relative_max_distance,
            shaw_max_distance=base.shaw_max_distance,
            shaw_values=base.shaw_values,
            rope_base=base.rope_base,
            activation=base.activation,
            norm_position=base.norm_position,
            layer_norm_eps=base.layer_norm_eps,
        )
    return config


# ---------------------------------------------------------------------------- the loss


def soft_target_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    temperature: float,
    normalizer: Tensor | float | None = None,
    kl_divergence: nn.Module | None = None,
) -> Tensor:
    """T^2 * KL(softmax(teacher/T) || softmax(student/T)), summed over rows / normalizer (default: rows).

    Logits are (n, vocab). The T^2 factor (Hinton et al. 2015, section 2) keeps the soft
    targets' gradients, which shrink as 1/T^2, on the scale of the hard-label loss.
    """
    kl = (kl_divergence or SummedKLDivergence())(student_logits, teacher_logits, temperature)
    divisor = max(student_logits.shape[0], 1) if normalizer is None else normalizer
    # A product, not **2: past T = 1.3e154 Python's ** raises OverflowError, where the product
    # is inf and the loss diverges (a null loss), as it does once T^2 overflows float32.
    return kl * (temperature * temperature) / divisor


def cosine_loss(student_hidden: Tensor, teacher_hidden: Tensor) -> Tensor:
    """Mean over rows of 1 - cos(student, teacher): DistilBERT's hidden-state alignment. (n, d) each."""
    if student_hidden.shape[0] == 0:
        return student_hidden.sum() * 0.0
    cos = F.cosine_similarity(student_hidden.float(), teacher_hidden.float(), dim=-1)
    return (1.0 - cos).mean()


class DistillationModel(nn.Module):
    """Student + frozen teacher; ``forward(**batch)`` returns the DistilBERT loss and its terms.

    The teacher is deliberately not a submodule: ``parameters()``, ``state_dict()``,
    ``train()`` and hence the optimiser and every checkpoint see only the student (a resumed
    run reloads the teacher from its directory). ``to()`` still moves it (``_apply``).
    """

    def __init__(
        self,
        teacher: BertForPreTraining,
        student: BertForPreTraining,
        temperature: float = 2.0,
        alpha_ce: float = 5.0,
        alpha_mlm: float = 2.0,
        alpha_cos: float = 1.0,
    ) -> None:
        super().__init__()
        if teacher.config.vocab_size != student.config.vocab_size:
            raise AttnlabError(
                f"student vocabulary ({student.config.vocab_size}) differs from the teacher's "
                f"({teacher.config.vocab_size}): their MLM distributions cannot be compared"
            )
        self.same_width = teacher.config.d_model == student.config.d_model
        if alpha_cos and not self.same_width:
            raise AttnlabError(
                f"alpha_cos needs equal widths (student d_model {student.config.d_model}, "
                f"teacher {teacher.config.d_model}): pass alpha_cos 0",
                options=("alpha_cos",),
            )
        if temperature <= 0:
            raise AttnlabError(
                f"temperature must be positive, got {temperature}", options=("temperature",)
            )
        self.student = student
        self.kl_divergence = SummedKLDivergence()  # a module: the job swaps in its fast twin
        object.__setattr__(self, "teacher", teacher.eval().requires_grad_(False))
        self.temperature = temperature
        self.alpha_ce, self.alpha_mlm, self.alpha_cos = alpha_ce, alpha_mlm, alpha_cos

    def extra_repr(self) -> str:
        """The frozen teacher's size and the loss weights (the teacher is not printed as a child)."""
        return (
            f"teacher={self.teacher.config.n_layers} layers x {self.teacher.config.d_model}, "
            f"temperature={self.temperature}, alpha_ce={self.alpha_ce}, "
            f"alpha_mlm={self.alpha_mlm}, alpha_cos={self.alpha_cos}"
        )

    def _apply(self, fn: Callable, recurse: bool = True) -> DistillationModel:
        self.teacher._apply(fn)  # not a submodule, so .to(device) would leave it behind
        return super()._apply(fn, recurse)

    def forward(
        self,
        input_ids: Tensor,
        mlm_labels: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        mlm_normalizer: Tensor | None = None,
    ) -> dict[str, Tensor]:
        """Losses on a masked batch (batch, seq); logits (n_masked, vocab) of student and teacher.

        ``mlm_normalizer`` (masked tokens per micro-batch of the step, from
        PretrainingBatches) divides the summed KL and MLM terms, so gradient accumulation and
        DDP give the whole step's mean; the cosine term is a per-micro-batch mean.
        """
        masked = mlm_labels != -100
        divisor = mlm_normalizer if mlm_normalizer is not None else masked.sum().clamp(min=1)
        with torch.no_grad():
            teacher_hidden = self.teacher.bert(
                input_ids, attention_mask, token_type_ids
            ).last_hidden_state
            teacher_logits = self.teacher.mlm(teacher_hidden[masked])
        hidden = self.student.bert(input_ids, attention_mask, token_type_ids).last_hidden_state
        logits = self.student.mlm(hidden[masked])  # (n_masked, vocab): the sparse MLM head
        kl_divergence = self.kl_divergence
        soft = soft_target_loss(logits, teacher_logits, self.temperature, divisor, kl_divergence)
        mlm = self.student.mlm_loss(logits, mlm_labels[masked]) / divisor
        loss = self.alpha_ce * soft + self.alpha_mlm * mlm
        out = {"distill_loss": soft, "mlm_loss": mlm}
        if self.same_width:
            real = attention_mask.bool() if attention_mask is not None else torch.ones_like(masked)
            out["cosine_loss"] = cosine_loss(hidden[real], teacher_hidden[real])
            loss = loss + self.alpha_cos * out["cosine_loss"]
        return {
            "loss": loss,
            **out,
            "mlm_logits": logits,
            "teacher_mlm_logits": teacher_logits,
        }


# ---------------------------------------------------------------------------- evaluation


class _AgreementProbe(nn.Module):
    """Runs the distillation model and compares the student's predictions with the teacher's.

    Counts where the two rank the same token first, and sums KL(teacher || student) of their
    full distributions (temperature 1), which still tells students apart where both pick the
    commonest tokens.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.agree = self.teacher_correct = self.count = 0
        self.kl = 0.0

    def forward(self, **batch: Tensor) -> dict[str, Tensor]:
        """The model's output, unchanged; the counts grow."""
        out = self.model(**batch)
        student_logits, teacher_logits = out["mlm_logits"], out["teacher_mlm_logits"]
        student, teacher = student_logits.argmax(-1), teacher_logits.argmax(-1)
        labels = batch["mlm_labels"][batch["mlm_labels"] != -100]
        self.agree += int((student == teacher).sum())
        self.teacher_correct += int((teacher == labels).sum())
        self.count += labels.numel()
        self.kl += float(soft_target_loss(student_logits, teacher_logits, 1.0, normalizer=1.0))
        return out


def distillation_evaluation(evaluate: Evaluate) -> Evaluate:
    """Pretraining's held-out scores of the student plus its fill-mask agreement with the teacher.

    ``evaluate`` is pretraining's (``attnlab.tasks.pretrain.evaluation``): its fixed examples
    and masks give eval_mlm_loss / eval_mlm_accuracy from the student's logits; the probe
    adds eval_fill_mask_agreement (the fraction of masked positions where student and teacher
    pick the same token), eval_teacher_kl (the mean KL(teacher || student) there, in nats),
    and the teacher's own accuracy for reference.
    """

    def run(model: nn.Module) -> dict[str, float]:
        probe = _AgreementProbe(model)
        metrics = evaluate(probe)
        if probe.count:
            metrics["eval_fill_mask_agreement"] = probe.agree / probe.count
            metrics["eval_teacher_kl"] = probe.kl / probe.count
            metrics["eval_teacher_mlm_accuracy"] = probe.teacher_correct / probe.count
        return metrics

    return run


# ---------------------------------------------------------------------------- the recipe


@dataclass(kw_only=True)
class DistillOptions(RunOptions):
    """Settings of a distillation run (the shared ones in RunOptions), named as the CLI flags."""

    teacher: Path
    out: Path
    corpus: list[Path] = field(default_factory=list)
    student_layers: int | None = None
    student_preset: str | None = None
    steps: int = 1000
    batch_size: int = 32
    grad_accum: int = 1
    seq_len: int = 128
    lr: float = 5e-4  # DistilBERT's
    warmup: int | None = None  # None: 5% of steps (DistilBERT's warmup_prop)
    temperature: float = 2.0
    alpha_ce: float = 5.0
    alpha_mlm: float = 2.0
    alpha_cos: float | None = None  # None: 1.0 when the widths match, else 0 (cannot compare)
    compile: bool = False
    cache_dir: Path | None = None
    whole_word_masking: bool = False
    static_masking: bool = False
    max_predictions: int | None = None  # masked tokens per sequence at most, as pretraining's

    def validate(self) -> None:
        """Raise AttnlabError for impossible settings, before anything is read or written."""
        super().validate()
        if (self.student_layers is None) == (self.student_preset is None):
            raise AttnlabError(
                "give exactly one of student_layers and student_preset",
                options=("student_layers", "student_preset"),
            )
        for name in ("steps", "batch_size", "grad_accum", "seq_len", "max_predictions"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise AttnlabError(f"{name} must be at least 1", options=(name,))
        check_upper_bounds(self.batch_size, self.seq_len)
        if not 0 < self.temperature < math.inf:
            raise AttnlabError(
                f"temperature must be a finite number > 0, got {self.temperature}",
                options=("temperature",),
            )
        for name in ("alpha_ce", "alpha_mlm", "alpha_cos"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < math.inf:
                raise AttnlabError(
                    f"{name} must be a finite number >= 0, got {value}", options=(name,)
                )
        out, teacher = (
            resolved_path(Path(self.out), "out"),
            resolved_path(self.teacher, "teacher"),
        )
        if out == teacher:
            raise AttnlabError("out must differ from teacher", options=("out", "teacher"))

    def pretraining(self) -> PretrainOptions:
        """The pretraining settings of the same data: MLM-only examples."""
        return PretrainOptions(
            out=self.out,
            corpus=self.corpus,
            objective="mlm",
            steps=self.steps,
            batch_size=self.batch_size,
            grad_accum=self.grad_accum,
            seq_len=self.seq_len,
            whole_word_masking=self.whole_word_masking,
            static_masking=self.static_masking,
            max_predictions=self.max_predictions,
            resume=self.resume,
            overwrite=self.overwrite,
            seed=self.seed,
            cache_dir=self.cache_dir,
            progress=self.progress,
        )


def _load_teacher(opts: DistillOptions) -> tuple[BertForPreTraining, BertTokenizer]:
    read_config(opts.teacher)  # a missing or wrong directory is reported as such first
    # An encoder-only checkpoint would get fresh MLM heads: nothing to distil from.
    teacher = load_bert(opts.teacher, heads=True, trained_heads=True)
    tokenizer = BertTokenizer.from_dir(opts.teacher)
    check_vocabulary(opts.teacher, tokenizer.vocab_size, teacher.config)
    if opts.seq_len > teacher.config.max_positions:
        raise AttnlabError(
            f"seq_len {opts.seq_len} is above the teacher's max positions "
            f"({teacher.config.max_positions})",
            options=("seq_len",),
        )
    return teacher, tokenizer


def _distillation_model(opts: DistillOptions) -> tuple[DistillationModel, BertTokenizer]:
    """Teacher and student joined under the loss weights of opts, and the teacher's tokenizer."""
    teacher, tokenizer = _load_teacher(opts)
    torch.manual_seed(opts.seed)  # a preset student's fresh weights are part of the run
    student = student_from_teacher(teacher, opts.student_layers, opts.student_preset)
    same_width = teacher.config.d_model == student.config.d_model
    alpha_cos = opts.alpha_cos if opts.alpha_cos is not None else float(same_width)
    if opts.alpha_ce == opts.alpha_mlm == alpha_cos == 0:
        raise AttnlabError(
            "alpha_ce, alpha_mlm and alpha_cos are all 0: nothing to learn",
            options=("alpha_ce", "alpha_mlm", "alpha_cos"),
        )
    model = DistillationModel(
        teacher, student, opts.temperature, opts.alpha_ce, opts.alpha_mlm, alpha_cos
    )
    return model, tokenizer


@dataclass
class DistillJob(CorpusJob):
    """A distillation run's steps, in the order ``run_job`` calls them (tasks/job.py).

    The data are pretraining's (MLM-only examples); nothing is written before ``fit()`` but
    the clearing of an overwritten run.
    """

    opts: DistillOptions
    model: DistillationModel = field(init=False)
    agreement_before: dict[str, Any] = field(default_factory=dict)  # step 0's eval row

    def pretraining_options(self) -> PretrainOptions:
        """Pretraining's settings of the same data: MLM-only examples."""
        return self.opts.pretraining()

    def prepare(self, world_size: int) -> None:
        """Load the teacher, build the student, tokenize (filling the cache) and check the data."""
        self.follow()
        self.data.batches.set_rank(0, world_size)  # refused before --overwrite clears --out

    def start_out(self) -> None:
        """Clear an overwritten run as a whole, before anything is written."""
        if self.opts.overwrite:
            clear_dir(self.opts.out)

    def follow(self) -> None:
        """The teacher, the student and the data (the cache rank 0 filled)."""
        self.model, self.tokenizer = _distillation_model(self.opts)
        self.data = prepare_data(self.pretraining_options(), self.files, self.tokenizer)

    def trainer(self) -> Trainer:
        """The shared trainer on pretraining's batches, scoring the student's agreement too."""
        held_out = self.data.evaluate
        evaluate = distillation_evaluation(held_out) if held_out is not None else None
        return self._trainer(self.model, evaluate)  # it moves the teacher too (_apply)

    def publish(self, trainer: Trainer, summary: dict[str, Any]) -> dict[str, Any]:
        """The student in --out, an HF BertForMaskedLM checkpoint with the teacher's tokenizer."""
        rows = trainer.log.rows
        self.agreement_before = next(
            (row for row in rows if row.get("eval") and row["step"] == 0), {}
        )
        publish_bert(self.model.student, self.tokenizer, self.opts.out)
        return summary


def distill(opts: DistillOptions) -> dict[str, Any]:
    """Distil (or resume distilling) a student from opts.teacher; the trainer's summary and agreement."""
    opts.validate()
    files = [Path(f) for f in opts.corpus] or [bundled_corpus()]
    for file in files:
        check_input_file(file, "corpus file")
    if opts.overwrite:  # --overwrite replaces --out as a whole: the teacher must not be in it
        check_out_location(opts.out, [opts.teacher])
    # DistilBERT's 5% warm-up; the student as initialised is scored too (step 0's eval row)
    config = replace(trainer_config(opts, warmup_divisor=20), eval_at_start=True)
    job = DistillJob(opts, files, config)
    summary = run_job(job)
    before, teacher, student = job.agreement_before, job.model.teacher, job.model.student
    return {
        **summary,
        "agreement_before": before.get("eval_fill_mask_agreement"),
        "agreement": summary["eval"].get("eval_fill_mask_agreement"),
        "teacher_kl_before": before.get("eval_teacher_kl"),
        "teacher_kl": summary["eval"].get("eval_teacher_kl"),
        "teacher_parameters": count_parameters(teacher),
        "student_parameters": count_parameters(student),
        "student_layers": student.config.n_layers,
        "alpha_cos": job.model.alpha_cos,
    }
