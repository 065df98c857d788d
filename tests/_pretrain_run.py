"""`attnlab pretrain` in a subprocess that SIGKILLs itself at a chosen moment (resume tests).

ATTNLAB_KILL_AT_BATCH=K kills the process as it reads its K-th batch (mid optimiser step);
ATTNLAB_KILL_IN_SAVE=N kills it once the checkpoint of step N has written trainer.pt into its
temporary directory, before the rename that publishes it. Other arguments go to the CLI.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

from attnlab.cli import main
from attnlab.tasks import pretrain


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install_hooks() -> None:
    """Wrap the batch stream and torch.save as the environment asks."""
    kill_at = int(os.environ.get("ATTNLAB_KILL_AT_BATCH", "0"))
    kill_in_save = int(os.environ.get("ATTNLAB_KILL_IN_SAVE", "0"))
    if kill_at:
        real_iter = pretrain.PretrainingBatches.__iter__

        def killing_iter(self):
            for count, batch in enumerate(real_iter(self), start=1):
                if count == kill_at:
                    _kill()
                yield batch

        pretrain.PretrainingBatches.__iter__ = killing_iter
    if kill_in_save:
        real_save = torch.save

        def save(obj, f, *args, **kwargs):
            real_save(obj, f, *args, **kwargs)
            path = Path(f)
            if path.name == "trainer.pt" and path.parent.name.startswith(f".step-{kill_in_save}."):
                _kill()

        torch.save = save


if __name__ == "__main__":
    torch.set_num_threads(1)  # bit-identical runs need the same reduction order
    install_hooks()
    sys.exit(main(sys.argv[1:]))
