"""Training a DFlash drafter on the target's own outputs: `reviewer train` (see README.md in this folder).

    from backend.train import cli
"""

from backend.train.run import cli

__all__ = ["cli"]
