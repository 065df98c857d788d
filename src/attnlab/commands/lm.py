"""`attnlab lm train`, `attnlab lm eval` and `attnlab generate`: decoder-only language models.

The library does the work (tasks/lm.py, decode/sampling.py); these functions read flags, print
results (JSON on stdout, notes on stderr) and stream a prompt's continuation as it is made.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from attnlab.cli import _add_run_flags, _command, _given, _main_process, _print_json, _say
from attnlab.errors import AttnlabError

_LM_OPTIONS = "attnlab.tasks.lm.LMOptions"
_GENERATE = "attnlab.tasks.lm.generate_texts"


def add_commands(commands: argparse._SubParsersAction) -> None:
    """Register `lm train`, `lm eval` and `generate`."""
    from attnlab.cli import _Parser

    group = commands.add_parser("lm", help="decoder-only language models: `lm train|eval ...`")
    actions = group.add_subparsers(dest="lm_command", required=True, parser_class=_Parser)
    _add_train(actions)
    _add_eval(actions)
    _add_generate(commands)


def _add_train(actions: argparse._SubParsersAction) -> None:
    sub = _command(actions, "train", cmd_lm_train,
                   "train a GPT on text files (resumable)", _LM_OPTIONS)  # fmt: skip
    _add_run_flags(sub, "output directory (a GPT model folder)")
    lr = next(action for action in sub._actions if action.dest == "lr")
    lr.help += " (default: by the model's width, printed at the start; docs/lm.md)"
    sub.add_argument("--corpus", nargs="+", metavar="FILE", help="UTF-8 training text files")
    sub.add_argument("--valid", nargs="+", metavar="FILE",
                     help="held-out text (default: the corpus's last 10%%)")  # fmt: skip
    sub.add_argument("--preset", help="model size: gpt-char, gpt2, gpt2-medium")
    sub.add_argument("--tokenizer", help="char, byte-bpe (learnt on --corpus) or a folder")
    sub.add_argument("--vocab-size", type=int, help="byte-bpe vocabulary size (default 8000)")
    sub.add_argument("--init", help="start from this GPT folder's weights (attnlab or HF)")
    sub.add_argument("--seq-len", type=int, help="tokens per training window")
    sub.add_argument("--batch-size", type=int, help="windows per optimiser step")
    sub.add_argument("--grad-accum", type=int, help="micro-batches per step")
    sub.add_argument("--steps", type=int,
                     help="optimiser steps (default 5000; with --max-minutes: as many as fit)")  # fmt: skip
    sub.add_argument("--max-minutes", type=float,
                     help="stop after this long; the schedule is planned to end there")  # fmt: skip
    sub.add_argument("--warmup", type=int, help="warm-up steps (default 10%% of the run's)")
    sub.add_argument("--weight-decay", type=float, help="AdamW weight decay")
    sub.add_argument("--clip-norm", type=float, help="gradient-norm clipping (0: none)")
    sub.add_argument("--dropout", type=float, help="dropout (default: the preset's)")
    sub.add_argument("--position-encoding", help="(default: the preset's, learned as GPT-2)")
    sub.add_argument("--eval-every", type=int, help="steps between held-out scores (0: end)")
    sub.add_argument("--eval-tokens", type=int, help="held-out tokens scored (0: all)")
    sub.add_argument("--cache-dir", help="where tokenized corpora are cached")
    sub.add_argument("--compile", action="store_true", default=None,
                     help="torch.compile the forward pass")  # fmt: skip
    sub.add_argument("--strategy", choices=("ddp", "fsdp"),
                     help="under torchrun: ddp replicates the model on each process (default), "
                          "fsdp shards weights, gradients and optimiser state over them")  # fmt: skip


def _add_eval(actions: argparse._SubParsersAction) -> None:
    sub = _command(actions, "eval", cmd_lm_eval,
                   "print a GPT's loss and perplexity on a text file as JSON",
                   "attnlab.tasks.lm.evaluate_lm")  # fmt: skip
    sub.add_argument("--model", required=True, help="GPT model folder (attnlab or HF GPT-2)")
    sub.add_argument("--data", required=True, help="UTF-8 text: each line scored on its own")
    sub.add_argument("--stride", type=int,
                     help="score the file as one stream by sliding windows moved this far")  # fmt: skip
    sub.add_argument("--seq-len", type=int, help="--stride's window (default: the context)")
    sub.add_argument("--batch-size", type=int, help="lines or windows per forward pass")


def _add_generate(commands: argparse._SubParsersAction) -> None:
    sub = _command(commands, "generate", cmd_generate,
                   "continue prompts with a GPT (a prompt given here streams to stdout)",
                   _GENERATE)  # fmt: skip
    sub.add_argument("--model", required=True, help="GPT model folder (attnlab or HF GPT-2)")
    sub.add_argument("prompt", nargs="*", help="prompt text (default: start from nothing)")
    sub.add_argument("--input", help="prompts, one a line: one JSON line out per prompt and sample")
    sub.add_argument("--max-new-tokens", type=int, help="tokens generated per sample")
    sub.add_argument("--greedy", action="store_true", help="the most likely token each step")
    sub.add_argument("--temperature", type=float, help="sampling temperature (> 0)")
    sub.add_argument("--top-k", type=int, help="sample among the k most likely tokens")
    sub.add_argument("--top-p", type=float, help="nucleus sampling: the smallest set of mass p")
    sub.add_argument("--seed", type=int, help="seed of the sampling (reproducible)")
    sub.add_argument("--num-samples", type=int, help="samples per prompt")
    sub.add_argument("--stop", help="end a sample where this text appears (not printed)")
    sub.add_argument("--truncate-left", action="store_true",
                     help="keep a too-long prompt's end instead of refusing it")  # fmt: skip
    sub.add_argument("--batch-size", type=int, help="--input prompts generated together")


# ------------------------------------------------------------------------------- commands


def cmd_lm_train(args: argparse.Namespace) -> None:
    """Train (or resume) a GPT on text files."""
    from attnlab.cli import options_from
    from attnlab.tasks.lm import LMOptions, train_lm

    options = options_from(LMOptions, args, ("out", "corpus"), ("out", "init", "cache_dir"))
    summary = train_lm(options, say=_say)
    if _main_process():
        _print_json({k: v for k, v in summary.items() if k != "checkpoint"})
        _say(f"language model written to {options.out}")


def cmd_lm_eval(args: argparse.Namespace) -> None:
    """Score a GPT on a file: one JSON line {"loss", "perplexity", "tokens"}."""
    from attnlab.tasks.lm import evaluate_lm

    _print_json(
        evaluate_lm(args.model, args.data, **_given(args, "stride", "seq_len", "batch_size"))
    )


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    """generate_texts' sampling settings from the flags given (its defaults: the rest)."""
    settings = _given(args, "max_new_tokens", "temperature", "top_k", "top_p", "seed")
    settings |= _given(args, "num_samples", "stop", "batch_size")
    if args.greedy:
        given = [flag for flag in ("temperature", "top_k", "top_p") if flag in settings]
        if given:
            raise AttnlabError(
                f"--greedy takes the most likely token: drop {', '.join(given)}",
                options=tuple(given),
            )
        settings["greedy"] = True
    settings["truncate_left"] = args.truncate_left
    return settings


def cmd_generate(args: argparse.Namespace) -> None:
    """Stream each command-line prompt's continuation, or write JSON lines for --input."""
    from attnlab.tasks.lm import check_sampling, generate_texts, load_lm

    settings = _sampling(args)
    check_sampling(**{k: v for k, v in settings.items() if k != "batch_size"})
    if args.input is not None and args.prompt:
        raise AttnlabError("give prompts on the command line or in --input, not both")
    model, tokenizer = load_lm(args.model)  # before stdin: a bad --model fails fast
    if args.input is not None:
        from attnlab.cli import read_lines

        prompts = read_lines(args.input)
        results = generate_texts(model, tokenizer, prompts, **settings)
        for prompt, completion in results:
            print(json.dumps({"prompt": prompt, "completion": completion}, ensure_ascii=False))
        return
    settings.pop("batch_size", None)
    prompt = " ".join(args.prompt)
    seed = settings.pop("seed", None)
    for sample in range(settings.pop("num_samples", 1)):  # one after another, each streamed
        writer = _StreamWriter(prompt, settings.get("stop"))
        sample_seed = None if seed is None else seed + sample
        [(_, completion)] = generate_texts(model, tokenizer, [prompt], **settings,
                                           seed=sample_seed, on_text=writer.write)  # fmt: skip
        writer.close(completion)


class _StreamWriter:
    """Writes streamed text to stdout as it comes, ending at a stop text (never printed)."""

    def __init__(self, prompt: str, stop: str | None) -> None:
        # The prompt is printed with the first text: a prompt refused prints nothing.
        self.prompt: str | None = prompt
        self.stop, self.held, self.shown, self.done = stop or None, "", "", False

    def _show(self, text: str) -> None:
        if self.prompt is not None:
            sys.stdout.write(self.prompt)
            self.prompt = None
        sys.stdout.write(text)
        sys.stdout.flush()
        self.shown += text

    def write(self, text: str) -> None:
        """Print what is certainly before the stop text; hold what may begin it."""
        if self.done:
            return
        self.held += text
        if self.stop is not None and self.stop in self.held:
            self._show(self.held[: self.held.index(self.stop)])
            self.held, self.done = "", True
            return
        keep = 0
        if self.stop is not None:
            keep = next((n for n in range(len(self.stop) - 1, 0, -1)
                         if self.held.endswith(self.stop[:n])), 0)  # fmt: skip
        self._show(self.held[: len(self.held) - keep])
        self.held = self.held[len(self.held) - keep :]

    def close(self, completion: str) -> None:
        """Print the rest of the sample's whole completion and end its line.

        The rest: text held back, and bytes of a character the sample never completed
        (shown as U+FFFD, as the whole decoding shows them).
        """
        rest = completion[len(self.shown) :] if completion.startswith(self.shown) else ""
        self._show(rest)
        sys.stdout.write("\n")
        sys.stdout.flush()
