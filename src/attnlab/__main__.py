"""`python -m attnlab` runs the command-line tool (also under torchrun)."""

import sys

from attnlab.cli import main

sys.exit(main())
