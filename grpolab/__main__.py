"""`python -m grpolab ...` (and `torchrun -m grpolab train ...`): the CLI."""

import os
import sys

from .cli import main

code = main()
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    # A rank leaves without running C++ destructors: gloo's and the store's threads torn down at
    # interpreter exit can abort the process ('terminate called without an active exception'),
    # which the launcher would report as a failed rank after a clean run. Files are closed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
