"""`attnlab ablate positions`: every positional scheme trained on one budget, scored past it.

The library does the work (tasks/ablate.py); this reads the flags and prints the summary's
table path and the per-scheme perplexities as JSON.
"""

from __future__ import annotations

import argparse

from attnlab.cli import _command, _given, _print_json, _say

_OPTIONS = "attnlab.tasks.ablate.AblateOptions"


def add_commands(commands: argparse._SubParsersAction) -> None:
    """Register `ablate positions`."""
    from attnlab.cli import _Parser

    group = commands.add_parser("ablate", help="ablation studies: `ablate positions ...`")
    actions = group.add_subparsers(dest="ablate_command", required=True, parser_class=_Parser)
    sub = _command(actions, "positions", cmd_ablate_positions,
                   "train one model per positional scheme on the same budget and score "
                   "held-out perplexity at multiples of the training length (resumable)",
                   _OPTIONS)  # fmt: skip
    sub.add_argument("--corpus", nargs="+", metavar="FILE", required=True, help="training text")
    sub.add_argument("--valid", nargs="+", metavar="FILE",
                     help="held-out text (default: the task's own held-out split)")  # fmt: skip
    sub.add_argument("--out", required=True, help="output directory (resumed when rerun)")
    sub.add_argument("--task", choices=("lm", "mlm"), help="next-token GPT or masked-LM BERT")
    sub.add_argument("--preset", help="model size (default gpt-char for lm, bert-mini for mlm)")
    budget = sub.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, help="optimiser steps per model")
    budget.add_argument("--minutes", type=float,
                        help="training minutes per model (the steps come from a timed probe)")  # fmt: skip
    sub.add_argument("--schemes", help="all, or names separated by commas")
    sub.add_argument("--train-length", type=int, help="tokens per training window")
    sub.add_argument("--eval-lengths", help="multiples of --train-length scored, e.g. 1,2,4,8")
    sub.add_argument("--seeds", type=int, help="seeds per scheme (mean ± sd over them)")
    sub.add_argument("--seed", type=int, help="the first seed")
    sub.add_argument("--batch-size", type=int, help="windows per optimiser step")
    sub.add_argument("--lr", type=float, help="peak learning rate (default 1e-3 lm, 5e-4 mlm)")
    sub.add_argument("--eval-tokens", type=int, help="held-out tokens scored at each length")
    sub.add_argument("--cache-dir", help="where tokenized corpora are cached")
    sub.add_argument("--overwrite", action="store_true", help="discard --out's ablation")
    sub.add_argument("--no-progress", action="store_true", help="no progress bars")


def cmd_ablate_positions(args: argparse.Namespace) -> None:
    """Run (or continue) the ablation; print where the table is and each cell as JSON."""
    from attnlab.tasks.ablate import AblateOptions, ablate_positions, parse_lengths, parse_schemes

    given = _given(args, "valid", "task", "preset", "steps", "minutes", "train_length")
    given |= _given(args, "seeds", "seed", "batch_size", "lr", "eval_tokens", "cache_dir")
    if args.schemes is not None:
        given["schemes"] = parse_schemes(args.schemes)
    if args.eval_lengths is not None:
        given["eval_lengths"] = parse_lengths(args.eval_lengths)
    options = AblateOptions(
        out=args.out, corpus=args.corpus, overwrite=args.overwrite,
        progress=not args.no_progress, **given,
    )  # fmt: skip
    summary = ablate_positions(options, say=_say)
    cells = {
        scheme: {n: cell.get("perplexity", cell.get("note")) for n, cell in row["cells"].items()}
        for scheme, row in summary["schemes"].items()
    }
    _print_json({"steps": summary["steps"], "perplexity": cells})
    _say(f"results in {options.out}/results.md, results.json and results.png")
