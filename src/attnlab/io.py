"""Safe file output: atomic writes, and output directories that are never silently overwritten."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from attnlab.errors import AttnlabError


def _temp_name(path: Path) -> Path:
    # A fresh sibling name, created by the caller with open(..., "x") or mkdir: unlike
    # mkstemp/mkdtemp (0600/0700) these honour the umask, so results stay readable by others.
    return path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write bytes to path via a temp file in the same directory and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(path)
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    """Write UTF-8 text to path atomically."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_with_atomic(path: Path, writer: Callable[[Path], None]) -> None:
    """Call writer(tmp_path) and rename the result onto path (for libraries that write files)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(path)
    try:
        writer(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def check_out_dir(out: Path, overwrite: bool = False) -> None:
    """Refuse an output directory that already holds files, unless overwrite is set."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise AttnlabError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise AttnlabError(f"--out {out} already holds files (pass --overwrite to replace them)")


@contextmanager
def staged_dir(out: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temp directory beside out; on success it replaces out as a whole, else it vanishes."""
    out = Path(out)
    check_out_dir(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = _temp_name(out)
    stage.mkdir()
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    if out.exists():
        trash = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".old"))
        os.replace(out, trash / "old")
        os.replace(stage, out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(stage, out)
