"""`python -m grpolab ...` (and `torchrun -m grpolab train ...`): the CLI."""

import sys

from .cli import main

sys.exit(main())
