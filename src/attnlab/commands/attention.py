"""`attnlab attention` (a model's attention on one input as an HTML page, PNG or JSON),
`attnlab plot positions` (pictures of a positional encoding) and `attnlab plot contextual` (one
word in two contexts, layer by layer).

The library does the work (attnlab.inspect); this reads the flags and prints a JSON summary.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from attnlab.cli import _command, _print_json, _say

SCHEMES = (
    "sinusoidal", "learned", "rope", "alibi", "relative_bias", "normalized", "integer", "shaw",
)  # fmt: skip


def add_commands(commands: argparse._SubParsersAction) -> None:
    """Register `attention`, `plot positions` and `plot contextual`."""
    from attnlab.cli import _Parser

    sub = _command(commands, "attention", cmd_attention,
                   "draw a model's attention on one input: FILE.html (head and model views), "
                   "FILE.png (a heatmap) or FILE.json, by --out's suffix")  # fmt: skip
    sub.add_argument("--model", required=True, help="BERT, BERT task or translation model dir")
    sub.add_argument("text", help="the input (a translation model's source sentence)")
    sub.add_argument("--pair", help="BERT: the second segment (sentence B)")
    sub.add_argument("--target", help="translation: the target (default: its own translation)")
    sub.add_argument(
        "--out",
        dest="output",
        required=True,
        metavar="FILE",
        help="FILE.html, FILE.png or FILE.json",
    )
    sub.add_argument("--layer", type=int, help="one layer: a PNG of it, where the page opens")
    sub.add_argument("--head", type=int, help="one head (with --layer: a single heatmap)")
    sub.add_argument("--layers", help="layers kept, e.g. 0,5 or 0-3 (default: all)")
    sub.add_argument("--heads", help="heads kept, e.g. 0-3 (default: all)")
    sub.add_argument("--kind", choices=("encoder", "decoder", "cross"),
                     help="the attention a PNG shows (default: cross for translation models)")  # fmt: skip
    sub.add_argument("--truncate", action="store_true",
                     help="cut input longer than the model takes (default: refuse it)")  # fmt: skip
    sub.add_argument("--overwrite", action="store_true", help="replace an existing --out")

    group = commands.add_parser("plot", help="pictures: `plot positions|contextual ...`")
    actions = group.add_subparsers(dest="plot_command", required=True, parser_class=_Parser)
    plot = _command(actions, "positions", cmd_plot_positions,
                    "draw a positional encoding: its table, dot product against distance, "
                    "RoPE's rotation, ALiBi's bias or Shaw's offset vectors")  # fmt: skip
    plot.add_argument("--scheme", choices=SCHEMES, help="the scheme (default: the model's)")
    plot.add_argument("--model", help="a model directory: draw its (learned) table")
    plot.add_argument("--out", dest="output", required=True, metavar="FILE", help="FILE.png")
    plot.add_argument("--positions", type=int, help="positions drawn (default 128)")
    plot.add_argument("--dim", type=int, help="d_model of the drawn table (default 128)")
    plot.add_argument(
        "--layer", type=int, help="shaw: the layer whose tables are drawn (default 0)"
    )
    plot.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    ctx = _command(actions, "contextual", cmd_plot_contextual,
                   "one word in two contexts: the cosine of its BERT vectors after each layer "
                   "(default: 苹果 in 吃苹果 / 苹果手机, bank in river bank / bank loan)")  # fmt: skip
    ctx.add_argument("--model", required=True, help="a BERT checkpoint directory")
    ctx.add_argument("--example", nargs=3, action="append", metavar=("WORD", "CONTEXT_A", "CONTEXT_B"),
                     help="a word and two sentences holding it (repeatable)")  # fmt: skip
    ctx.add_argument("--out", dest="output", required=True, metavar="FILE", help="FILE.png")
    ctx.add_argument("--overwrite", action="store_true", help="replace an existing --out")


def cmd_attention(args: argparse.Namespace) -> None:
    """Run the model on the input, write the page, heatmap or JSON; print a summary."""
    from attnlab.inspect.maps import attention_maps, load_attention_model
    from attnlab.inspect.output import Selection, check_suffix, parse_indices, write_attention
    from attnlab.io import check_output_file

    out = Path(args.output)
    check_suffix(out)
    out = check_output_file(out, args.overwrite, inputs=[args.model])
    selection = Selection(
        layer=args.layer,
        head=args.head,
        layers=None if args.layers is None else parse_indices(args.layers, "layers"),
        heads=None if args.heads is None else parse_indices(args.heads, "heads"),
        kind=args.kind,
    )
    model, tokenizer = load_attention_model(args.model)
    maps = attention_maps(model, tokenizer, args.text, args.pair, args.target, args.truncate)
    summary = write_attention(
        maps, out, selection, title=Path(args.model).name or Path(args.model).resolve().name
    )
    if summary.get("top_k"):
        _say(
            f"attnlab: the page keeps each query's {summary['top_k']} strongest keys "
            f"({summary['kept_share']:.1%} of the weight): pass --layers/--heads for all of it"
        )
    _print_json(summary)


def cmd_plot_positions(args: argparse.Namespace) -> None:
    """Draw the positional-encoding figure; print a summary."""
    from attnlab.inspect.positions_plot import PositionsPlot, plot_positions
    from attnlab.io import check_output_file

    out = check_output_file(
        Path(args.output), args.overwrite, inputs=[args.model] if args.model else []
    )
    request = PositionsPlot(scheme=args.scheme, model=args.model, layer=args.layer)
    if args.positions is not None:
        request.positions = args.positions
    if args.dim is not None:
        request.dim = args.dim
    _print_json(plot_positions(request, out))


def cmd_plot_contextual(args: argparse.Namespace) -> None:
    """Measure and draw each example; print the cosines as JSON."""
    from attnlab.errors import AttnlabError
    from attnlab.inspect.contextual import contextual_plot
    from attnlab.io import check_output_file

    out = Path(args.output)
    if out.suffix.lower() != ".png":
        raise AttnlabError(f"output {out} must end in .png", options=("output",))
    out = check_output_file(out, args.overwrite, inputs=[args.model])
    summary = contextual_plot(args.model, [tuple(e) for e in args.example or []], out)
    for reason in summary["skipped"]:
        _say(f"attnlab: skipped {reason}")
    _print_json(summary)
