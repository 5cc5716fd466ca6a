"""`python -m ghosted_core`: the command line (the package sets OMP_WAIT_POLICY before torch loads)."""

import sys

from ghosted_core.cli import main

sys.exit(main())
