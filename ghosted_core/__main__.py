"""`python -m ghosted_core`: the command line."""

import sys

from ghosted_core.cli import main

sys.exit(main())
