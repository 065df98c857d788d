"""`attnlab pretrain` in a subprocess that SIGKILLs itself at a chosen moment (resume tests).

ATTNLAB_KILL_AT_BATCH=K kills the process as it reads its K-th batch (mid optimiser step);
ATTNLAB_KILL_IN_SAVE=N kills it once the checkpoint of step N has written trainer.pt into its
temporary directory, before the rename that publishes it (tests/_kill.py);
ATTNLAB_PAUSE_AT_BATCH=K with ATTNLAB_PAUSE_FILE=F pauses it there instead: it makes F and
trains on once F is deleted (a run caught in the middle of training). Other arguments go to
the CLI.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from _kill import kill_at_batch, kill_in_save

from attnlab.cli import main


def install_hooks() -> None:
    """Kill or pause the job where the environment asks."""
    for variable, hook in (("ATTNLAB_KILL_AT_BATCH", kill_at_batch),
                           ("ATTNLAB_KILL_IN_SAVE", kill_in_save)):  # fmt: skip
        at = int(os.environ.get(variable, "0"))
        if at:
            hook(at)
    pause_at = int(os.environ.get("ATTNLAB_PAUSE_AT_BATCH", "0"))
    if pause_at:
        kill_at_batch(pause_at, lambda: pause(Path(os.environ["ATTNLAB_PAUSE_FILE"])))


def pause(flag: Path) -> None:
    """Make flag, then wait until it is deleted."""
    flag.touch(exist_ok=False)
    while flag.exists():
        time.sleep(0.02)


if __name__ == "__main__":
    torch.set_num_threads(1)  # bit-identical runs need the same reduction order
    install_hooks()
    sys.exit(main(sys.argv[1:]))
