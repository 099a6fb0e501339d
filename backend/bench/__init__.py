"""`reviewer bench`: plain and speculative decoding side by side, end to end through the engine (see README.md in
this folder).

    from backend.bench import main
"""

from backend.bench.run import main

__all__ = ["main"]
