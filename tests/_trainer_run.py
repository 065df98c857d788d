"""A tiny training job for the trainer tests, run in-process or as a (torchrun) subprocess.

Subprocess-only options kill the process with SIGKILL at chosen moments (tests/_kill.py), to
prove that a resumed run loses nothing: ``--kill-at-batch K`` as this process reads its K-th
batch (in the middle of an optimiser step), ``--kill-in-save N`` once the checkpoint of step
N has written trainer.pt into its temp directory but before that directory is renamed into
place; ``--kill-launcher-at-batch K`` SIGKILLs torchrun's launcher instead (rank 0, at its K-th
batch), each worker having left its pid in OUT.rank<R>.pid.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from _kill import kill_at_batch, kill_in_save, kill_launcher_at_batch
from torch import Tensor, nn

from attnlab.train import TensorBatches, TrainConfig, Trainer, seed_everything
from attnlab.train.distributed import shutdown_distributed

VOCAB, SEQ = 16, 8


class TinyClassifier(nn.Module):
    """Mean-pooled token embeddings -> LayerNorm -> dropout -> MLP -> 2 classes."""

    def __init__(self, d_model: int = 16, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.norm = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)
        self.hidden = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, 2)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, labels: Tensor) -> dict:
        """input_ids, attention_mask (batch, seq), labels (batch,) -> loss and accuracy."""
        mask = attention_mask.unsqueeze(-1).float()
        pooled = (self.embed(input_ids) * mask).sum(1) / mask.sum(1)  # (batch, d_model)
        h = self.dropout(F.gelu(self.hidden(self.norm(pooled))))
        self.seen_dtype = h.dtype  # lets a test see that autocast was on
        logits = self.out(h)
        loss = F.cross_entropy(logits.float(), labels)
        accuracy = (logits.argmax(-1) == labels).float().mean()
        return {"loss": loss, "accuracy": accuracy, "logits": logits}


def make_data(n: int = 64, seed: int = 0) -> dict[str, Tensor]:
    """Random sequences with padding; label 1 when most real tokens are >= VOCAB / 2."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (n,), generator=g)
    attention_mask = (torch.arange(SEQ) < lengths.unsqueeze(1)).long()
    input_ids = input_ids * attention_mask
    high = ((input_ids >= VOCAB // 2) & attention_mask.bool()).sum(1)
    labels = (2 * high > lengths).long()
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def make_evaluate(data: dict[str, Tensor]):
    """An evaluate(model) over a fixed set: loss and accuracy."""

    def evaluate(model: nn.Module) -> dict[str, float]:
        out = model(**data)
        return {"loss": out["loss"].item(), "accuracy": out["accuracy"].item()}

    return evaluate


def train(
    out: Path,
    steps: int = 12,
    batch_size: int = 8,
    grad_accum: int = 1,
    dropout: float = 0.1,
    on_best=None,
    speedups=None,
    **config: object,
) -> tuple[Trainer, dict]:
    """Build the tiny job and fit it; config overrides TrainConfig fields."""
    seed_everything(0)
    model = TinyClassifier(dropout=dropout)
    batches = TensorBatches(make_data(), batch_size, seed=1)
    settings: dict = {
        "lr": 1e-2,
        "warmup": 2,
        "log_every": 1,
        "eval_every": 3,
        "save_every": 4,
        "keep_last": 2,
        "progress": False,
        "device": "cpu",
    }
    settings.update(config)
    train_config = TrainConfig(out_dir=out, steps=steps, grad_accum=grad_accum, **settings)
    evaluate = make_evaluate(make_data(32, seed=2))
    trainer = Trainer(
        model, batches, train_config, evaluate=evaluate, on_best=on_best, speedups=speedups
    )
    return trainer, trainer.fit()


def main() -> None:
    """Parse options and train."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--log-every", type=int, default=1)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--kill-at-batch", type=int)
    parser.add_argument("--kill-in-save", type=int)
    parser.add_argument("--kill-launcher-at-batch", type=int)
    args = parser.parse_args()

    torch.set_num_threads(1)  # bit-identical results need the same reduction order
    if args.kill_in_save is not None:
        kill_in_save(args.kill_in_save)
    if args.kill_at_batch is not None:
        kill_at_batch(args.kill_at_batch)
    if args.kill_launcher_at_batch is not None:  # rank 0 kills it; each worker leaves its pid
        rank = os.environ["RANK"]
        args.out.with_name(f"{args.out.name}.rank{rank}.pid").write_text(f"{os.getpid()}\n")
        if rank == "0":
            kill_launcher_at_batch(args.kill_launcher_at_batch)
    trainer, summary = train(
        args.out,
        steps=args.steps,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        dropout=args.dropout,
        resume=args.resume,
        log_every=args.log_every,
        save_every=args.save_every,
    )
    if trainer.is_main:
        print(json.dumps(summary))
    trainer.release_network()
    shutdown_distributed()


if __name__ == "__main__":
    main()
