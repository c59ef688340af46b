"""The offline engine benchmark: `python bench/engine.py [options]` is
`platform bench offline [options]` (see docs/benchmarks.md)."""

import sys

from plinth.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "offline", *sys.argv[1:]]))
