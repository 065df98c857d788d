"""`attnlab serve`: an HTTP inference server for every kind of model folder.

models.py picks the folder's kind and runs the library's functions on a batch; batching.py
gathers concurrent requests into batches run in one worker thread; app.py builds the FastAPI
app from the endpoint families (routes_*.py); limits.py the API key, request bounds and error
shape; metrics.py Prometheus; server.py runs it all under uvicorn. The names below are
imported on first use, so the CLI reads ``attnlab.serve.limits`` without loading FastAPI.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "BatchSettings": "batching",
    "Limits": "limits",
    "create_app": "app",
    "load_served": "models",
    "serve": "server",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    """The public names, each from its module."""
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
