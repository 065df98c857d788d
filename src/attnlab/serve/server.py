"""Run the app under uvicorn: load the model, bind (127.0.0.1 by default), drain on SIGTERM.

On SIGTERM uvicorn stops accepting connections, lets the requests in flight finish (the
batcher answers every queued job before it stops), and returns; the process then exits 0.
"""

from __future__ import annotations

import ipaddress
import logging
import signal
import sys
from pathlib import Path

from attnlab.errors import AttnlabError

from .app import BatchSettings, create_app
from .limits import Limits
from .models import load_served

DRAIN_TIMEOUT_S = 60  # requests still running after this long are cancelled


def is_loopback(host: str) -> bool:
    """Whether host is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to a public address


def serve(
    model_dir: str | Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    settings: BatchSettings | None = None,
    limits: Limits | None = None,
    api_key: str | None = None,
    pooling: str = "mean",
    threads: int | None = None,
) -> None:
    """Serve the model in model_dir over HTTP until SIGTERM or Ctrl-C."""
    import uvicorn

    if not 0 <= port <= 65535:
        raise AttnlabError(f"port must be from 0 to 65535, got {port}", options=("port",))
    if pooling not in ("mean", "cls"):
        raise AttnlabError(f"unknown pooling {pooling!r} (choose from mean, cls)",
                           options=("pooling",))  # fmt: skip
    if api_key is not None and (not api_key or not api_key.isprintable() or " " in api_key):
        raise AttnlabError("api_key must be printable text without spaces", options=("api_key",))
    settings = settings or BatchSettings()
    served = load_served(model_dir, pooling)
    app = create_app(served, Path(model_dir).resolve().name, settings, limits, api_key, threads)
    if not is_loopback(host) and api_key is None:
        logging.getLogger("attnlab.serve").warning(
            "serving on %s without an API key: anyone who can reach it can use the model "
            "(set --api-key or ATTNLAB_API_KEY)", host)  # fmt: skip
    config = uvicorn.Config(app, host=host, port=port, log_level="info",
                            timeout_graceful_shutdown=DRAIN_TIMEOUT_S)  # fmt: skip
    # uvicorn raises the signal again after its graceful shutdown; a no-op handler for SIGTERM
    # makes a drained shutdown exit 0 (Ctrl-C still ends as an interrupt).
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        uvicorn.Server(config).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    sys.stderr.flush()
