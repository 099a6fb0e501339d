"""python -m backend.train: `reviewer train`."""

import sys

from backend.train.run import cli

sys.exit(cli())
