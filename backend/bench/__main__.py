"""python -m backend.bench: `reviewer bench`."""

import sys

from backend.bench.run import cli

sys.exit(cli())
