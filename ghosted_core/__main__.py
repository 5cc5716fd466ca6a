"""`python -m ghosted_core`: the command line."""

import os
import sys

# Spinning OpenMP workers steal the only cores from each other on a small shared machine;
# passive waiting costs little when idle and a lot less when busy. Must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from ghosted_core.cli import main  # noqa: E402

sys.exit(main())
