"""`tinystats FILE --stat NAME`: one number per line in FILE."""

from __future__ import annotations

import argparse
import sys

from tinystats import core

STATS = {"mean": core.mean, "median": core.median, "variance": core.variance}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tinystats", description=__doc__)
    parser.add_argument("file")
    parser.add_argument("--stat", choices=sorted(STATS), default="mean")
    args = parser.parse_args(argv)
    with open(args.file) as f:
        values = [float(line) for line in f if line.strip()]
    print(STATS[args.stat](values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
