"""`attnlab pretrain` in a subprocess that SIGKILLs itself at a chosen moment (resume tests).

ATTNLAB_KILL_AT_BATCH=K kills the process as it reads its K-th batch (mid optimiser step);
ATTNLAB_KILL_IN_SAVE=N kills it once the checkpoint of step N has written trainer.pt into its
temporary directory, before the rename that publishes it (tests/_kill.py). Other arguments
go to the CLI.
"""

from __future__ import annotations

import os
import sys

import torch
from _kill import kill_at_batch, kill_in_save

from attnlab.cli import main


def install_hooks() -> None:
    """Kill the job where the environment asks."""
    for variable, hook in (("ATTNLAB_KILL_AT_BATCH", kill_at_batch),
                           ("ATTNLAB_KILL_IN_SAVE", kill_in_save)):  # fmt: skip
        at = int(os.environ.get(variable, "0"))
        if at:
            hook(at)


if __name__ == "__main__":
    torch.set_num_threads(1)  # bit-identical runs need the same reduction order
    install_hooks()
    sys.exit(main(sys.argv[1:]))
