"""Progress bars of long inference (embed, translate, evaluate, predict): tqdm, on stderr only.

A bar shows when it is asked for, or, when nobody said (``wanted`` None), when stderr is a
terminal or the input is long enough for a run to take a while. Results stay on stdout, so a
bar never mixes into what a pipe reads.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from tqdm import tqdm

LONG_INPUT = 300  # items: a longer input shows a bar even when stderr is a file (a log)


def shows_progress(total: int, wanted: bool | None = None) -> bool:
    """Whether a bar is shown: wanted if given (False: --no-progress), else a terminal or a long input."""
    if wanted is not None:
        return wanted
    stderr = sys.stderr
    terminal = stderr is not None and hasattr(stderr, "isatty") and stderr.isatty()
    return terminal or total > LONG_INPUT


@contextmanager
def progress_bar(
    total: int, unit: str = "line", wanted: bool | None = None, desc: str | None = None
) -> Iterator[Callable[[int], None] | None]:
    """Yield progress(n), which moves a tqdm bar on stderr on by n of total; None without a bar.

    The library's long loops take such a callback (``progress``) and call it as items finish.
    """
    if sys.stderr is None or not shows_progress(total, wanted):
        yield None
        return
    terminal = sys.stderr.isatty()
    # A log file gets a line every few seconds, not the terminal's ten redraws a second.
    with tqdm(
        total=total,
        unit=f" {unit}",
        desc=desc,
        file=sys.stderr,
        dynamic_ncols=terminal,
        mininterval=0.1 if terminal else 5.0,
    ) as bar:
        yield bar.update
