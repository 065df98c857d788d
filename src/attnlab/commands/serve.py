"""`attnlab serve`: an HTTP inference server for a model folder (attnlab.serve)."""

from __future__ import annotations

import argparse
import os


def add_commands(commands: argparse._SubParsersAction) -> None:
    """Register `attnlab serve`."""
    from attnlab.cli import _command

    text = "serve a model folder over HTTP (embeddings, fill-mask, predictions, translation)"
    sub = _command(commands, "serve", cmd_serve, text, "attnlab.serve.app.BatchSettings")
    sub.add_argument("--model", required=True, help="model folder (BERT, fine-tuned, translation)")
    sub.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    sub.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free one)")
    sub.add_argument("--max-batch-tokens", type=int, help="tokens gathered into one batch at most")
    sub.add_argument("--max-wait-ms", type=float,
                     help="longest wait for a batch to fill, in milliseconds")  # fmt: skip
    sub.add_argument("--max-queue", type=int, help="requests waiting at most (then 503)")
    sub.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: "
                     "$ATTNLAB_API_KEY, else none)")  # fmt: skip
    sub.add_argument("--pooling", choices=("mean", "cls"), default="mean",
                     help="embedding pooling (default mean)")  # fmt: skip


def cmd_serve(args: argparse.Namespace) -> None:
    """Serve --model until SIGTERM (drains, exit 0) or Ctrl-C."""
    import logging

    import torch

    from attnlab.cli import _given
    from attnlab.serve import BatchSettings, serve

    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    settings = BatchSettings(**_given(args, "max_batch_tokens", "max_wait_ms", "max_queue"))
    api_key = args.api_key if args.api_key is not None else os.environ.get("ATTNLAB_API_KEY")
    serve(args.model, args.host, args.port, settings, api_key=api_key or None,
          pooling=args.pooling, threads=torch.get_num_threads())  # fmt: skip
