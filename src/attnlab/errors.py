"""The one user-facing error type: the CLI prints its message on one line and exits 2."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any


class AttnlabError(Exception):
    """A problem the user can fix (bad input, missing file, wrong option), stated in one line.

    ``options`` names the settings the message is about as the Python API spells them
    (``beam_size``), so that a front end with its own spelling can say them its way: the CLI
    prints ``--beam-size`` (see ``worded``). The message itself never names a CLI flag.
    """

    def __init__(self, message: str = "", *, options: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.options = tuple(options)

    def worded(self, spell: Callable[[str], str]) -> str:
        """The message with each mention of its options spelled by ``spell``.

        A word right after a spelled mention is that option's value, never a mention: the
        relative path in "out out holds a run" stays as given.
        """
        message = str(self)
        if not self.options:
            return message
        names = "|".join(re.escape(name) for name in sorted(self.options, key=len, reverse=True))
        # A whole word only: not inside a path (out/model), a longer name or a flag.
        mention = re.compile(rf"(?<![\w./\\-])(?:{names})(?![\w/\\-]|\.\w)")
        parts, end, value_at = [], 0, -1
        for match in mention.finditer(message):
            parts.append(message[end : match.start()])
            if match.start() == value_at:
                parts.append(match.group())
            else:
                parts.append(spell(match.group()))
                value_at = match.end() + 1
            end = match.end()
        return "".join(parts) + message[end:]


def first_line(error: BaseException) -> str:
    """The first line of a library error's message, or its type's name when the message is empty."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def check_token_batch(ids: Any, name: str, **same_shape: Any) -> None:
    """Refuse ids that are not a (batch, seq) integer tensor, or companions shaped otherwise.

    ``same_shape`` names tensors (or None) that must be shaped like ids: masks, segment ids.
    """
    import torch  # here, so that importing the error type stays cheap

    if not isinstance(ids, torch.Tensor):
        raise AttnlabError(f"{name} must be a tensor of token ids, got {type(ids).__name__}")
    if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype.is_complex:
        raise AttnlabError(
            f"{name} must be a (batch, seq) tensor of integer token ids, got {ids.dtype} "
            f"{tuple(ids.shape)}"
        )
    for other, tensor in same_shape.items():
        if tensor is not None and (
            not isinstance(tensor, torch.Tensor) or tensor.shape != ids.shape
        ):
            shape = (
                tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            )
            raise AttnlabError(
                f"{other} must be a tensor shaped like {name} {tuple(ids.shape)}, got {shape}"
            )


def check_id_range(ids: Any, name: str, size: int, field: str) -> None:
    """Refuse ids (a tensor checked by check_token_batch) outside 0..size-1 of an embedding table.

    The lookup would fail with a bare "index out of range in self" (a device-side assert on a
    GPU); field names the config setting of the table's size.
    """
    if ids is None or ids.numel() == 0:
        return
    import torch

    low, high = torch.stack(torch.aminmax(ids)).tolist()  # one pass, one read-back
    if low < 0 or high >= size:
        bad = low if low < 0 else high
        raise AttnlabError(
            f"{name} holds id {bad}, outside the model's {field} {size} (ids 0..{size - 1}): "
            "are the inputs from this model's tokenizer?"
        )
