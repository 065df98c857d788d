"""`attnlab serve`: an HTTP inference server for a model folder (attnlab.serve)."""

from __future__ import annotations

import argparse
import os

# Each request limit (attnlab.serve.limits.Limits) and its flag's help; past one: 413 naming it.
LIMIT_FLAGS = {
    "max_body_bytes": "bytes of one request's JSON body at most",
    "max_items": "texts (or questions) in one request at most",
    "max_text_chars": "characters of one text at most",
    "max_top_k": "fill-mask top_k at most",
    "max_beam": "translation beam size at most",
    "max_new_tokens": "completions' max_tokens at most",
    "max_samples": "completions' n at most",
    "max_attention_values": "attention weights in one /v1/attention answer at most",
}


def add_commands(commands: argparse._SubParsersAction) -> None:
    """Register `attnlab serve`."""
    from attnlab.cli import _command
    from attnlab.serve.limits import Limits

    text = "serve a model folder over HTTP (embeddings, fill-mask, predictions, translation)"
    sub = _command(commands, "serve", cmd_serve, text, "attnlab.serve.batching.BatchSettings")
    sub.add_argument("--model", required=True, help="model folder (BERT, fine-tuned, translation)")
    sub.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    sub.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free one)")
    sub.add_argument("--max-batch-tokens", type=int, help="tokens gathered into one batch at most")
    sub.add_argument("--max-wait-ms", type=float, help="how long a batch may wait to fill, in "
                     "milliseconds (0: it starts as soon as the worker is free)")  # fmt: skip
    sub.add_argument("--max-queue", type=int, help="requests waiting at most (then 503)")
    sub.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: "
                     "$ATTNLAB_API_KEY, else none)")  # fmt: skip
    sub.add_argument("--pooling", choices=("mean", "cls"), default="mean",
                     help="embedding pooling (default mean)")  # fmt: skip
    limits = sub.add_argument_group("request limits (past one: 413 naming it)")
    for name, help_text in LIMIT_FLAGS.items():
        limits.add_argument("--" + name.replace("_", "-"), type=int,
                            help=f"{help_text} (default {getattr(Limits, name)})")  # fmt: skip


def cmd_serve(args: argparse.Namespace) -> None:
    """Serve --model until SIGTERM (drains, exit 0) or Ctrl-C."""
    import logging

    import torch

    from attnlab.cli import _given
    from attnlab.serve import BatchSettings, Limits, serve

    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    settings = BatchSettings(**_given(args, "max_batch_tokens", "max_wait_ms", "max_queue"))
    limits = Limits(**_given(args, *LIMIT_FLAGS))
    api_key = args.api_key if args.api_key is not None else os.environ.get("ATTNLAB_API_KEY")
    serve(args.model, args.host, args.port, settings, limits, api_key=api_key or None,
          pooling=args.pooling, threads=torch.get_num_threads())  # fmt: skip
