"""Atomic training checkpoints: ``checkpoints/step-<N>/`` holds everything a resume needs.

Layout of one checkpoint::

    model.safetensors   model weights (tied tensors stored once, re-tied on load)
    trainer.pt          optimiser, schedule, data position, RNG states, step, config
    COMPLETE            written last

A checkpoint is written into a hidden ``.step-<N>.<id>.tmp`` directory and renamed into
place, so a kill at any moment leaves either the whole checkpoint or none of it; a
directory without COMPLETE (a copy cut short) is never resumed from. ``trainer.pt`` holds
only tensors and primitive containers, so it loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_model, save_file, save_model
from torch import Tensor, nn

from attnlab.errors import AttnlabError
from attnlab.io import raise_for_target, raise_library_write_error

MODEL_FILE = "model.safetensors"
STATE_FILE = "trainer.pt"
COMPLETE_MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"step-(\d+)")
LoadWeights = Callable[[nn.Module, Path], list[str]]  # (model, model.safetensors) -> missing names


def capture_rng(device: torch.device) -> dict[str, Any]:
    """This process's RNG states (python, numpy, torch CPU, and CUDA when on a GPU) as tensors."""
    version, internal, gauss = random.getstate()
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {"version": version, "internal": torch.tensor(internal), "gauss": gauss},
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    """Put back RNG states captured by capture_rng."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"].tolist()), py["gauss"]))
    np_state = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under root, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.fullmatch(path.name)
        if match and (path / COMPLETE_MARKER).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under root, or None."""
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def _fsync(path: Path) -> None:
    # Flush to disk before the rename publishes the directory: after a power cut a renamed
    # checkpoint must not hold empty files.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _discard(path: Path) -> None:
    # Rename first (atomic), then delete: a kill mid-delete leaves a hidden .old directory,
    # never a half-deleted step-<N> that looks resumable.
    trash = path.with_name(f".{path.name}.{uuid.uuid4().hex}.old")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def save_checkpoint(
    root: Path,
    step: int,
    model: nn.Module,
    state: dict[str, Any],
    weights: dict[str, Tensor] | None = None,
) -> Path:
    """Write model and trainer state as root/step-<step>, atomically; returns its path.

    ``weights``: the model's state dict of full tensors where the model itself holds shards
    (train/sharding.py), written as save_model writes the model's own.
    """
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step}"
    tmp = root / f".step-{step}.{uuid.uuid4().hex}.tmp"
    tmp.mkdir()
    try:
        # save_model (not save_file) drops the duplicate names of tied tensors, e.g. BERT's
        # MLM decoder sharing the word embeddings, and load_model re-ties them.
        if weights is None:
            save_model(model, str(tmp / MODEL_FILE))
        else:
            tied = tied_names(model)
            kept = {k: v.contiguous() for k, v in weights.items() if k not in tied}
            save_file(kept, str(tmp / MODEL_FILE), metadata=tied or None)
        # safetensors creates the file 0600; give it the umask's mode, as the directory has.
        os.chmod(tmp / MODEL_FILE, tmp.stat().st_mode & 0o666)
        torch.save(state, tmp / STATE_FILE)
        (tmp / COMPLETE_MARKER).write_text(f"step {step}\n")
        for name in (MODEL_FILE, STATE_FILE, COMPLETE_MARKER):
            _fsync(tmp / name)
        if final.exists():  # left by an attempt abandoned before it was complete
            _discard(final)
        os.replace(tmp, final)
        _fsync(root)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise_for_target(err, tmp, final)
        raise_library_write_error(final, err)
        raise
    return final


def tied_names(model: nn.Module) -> dict[str, str]:
    """{name: the name stored in its place} for each state-dict name that shares another's tensor.

    As safetensors' save_model chooses: of the names of one tensor, the first in sorted order.
    """
    names: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), []).append(name)
    tied = {}
    for group in names.values():
        first, *others = sorted(group)
        tied.update(dict.fromkeys(others, first))
    return tied


def prune_checkpoints(root: Path, keep_last: int) -> None:
    """Delete all but the keep_last newest complete checkpoints (keep_last 0 keeps all)."""
    if keep_last > 0:
        for _, path in complete_checkpoints(root)[:-keep_last]:
            _discard(path)


def remove_partial(root: Path) -> None:
    """Delete hidden temp and trash directories that a killed run left under root."""
    if root.is_dir():
        for path in root.iterdir():
            if path.name.startswith(".step-") and path.name.endswith((".tmp", ".old")):
                shutil.rmtree(path, ignore_errors=True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def read_checkpoint(
    path: Path, model: nn.Module, load_weights: LoadWeights | None = None
) -> dict[str, Any]:
    """Load the weights of checkpoint path into model and return its trainer state.

    A damaged checkpoint and one of another model (a run resumed with other settings) get
    different errors: the first is deleted to fall back to the one before, the second is fine.
    ``load_weights(model, file)`` loads model.safetensors and returns the names it lacked
    (default: safetensors' load_model; a sharded model has its own, train/sharding.py).
    """
    try:
        state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or "step" not in state:
            raise ValueError(f"{STATE_FILE} holds no trainer state")
        with safe_open(str(path / MODEL_FILE), framework="pt") as file:
            names = file.keys()  # a safe_open handle is not iterable itself
            saved = {name: tuple(file.get_slice(name).get_shape()) for name in names}
    except Exception as exc:
        raise _unreadable(path, exc) from exc
    ours = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    other = [name for name, shape in saved.items() if ours.get(name, shape) != shape]
    other += [name for name in saved if name not in ours]
    if not other:
        try:
            other = sorted((load_weights or _load_model)(model, path / MODEL_FILE))
        except Exception as exc:
            raise _unreadable(path, exc) from exc
    if other:
        raise AttnlabError(
            f"checkpoint {path} holds another model ({len(other)} weights differ, e.g. "
            f"{other[0]}): resume with the settings the run began with (preset, objective, "
            "teacher...), or start afresh with overwrite",
            options=("overwrite",),
        )
    return state


def _load_model(model: nn.Module, file: Path) -> list[str]:
    # strict=False: tied weights are stored once, and load_model reports what is missing
    missing, _ = load_model(model, str(file), strict=False, device=str(_device_of(model)))
    return list(missing)


def _unreadable(path: Path, exc: BaseException) -> AttnlabError:
    return AttnlabError(
        f"checkpoint {path} is unreadable ({_first_line(exc)}): delete it to resume "
        "from the one before"
    )


def _device_of(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")
