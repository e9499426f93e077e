"""`python -m loom.train_eagle`: train an EAGLE / EAGLE-3 head (or, with --medusa, Medusa heads)
for a loom-supported target. The trainer lives with speculation, in
runtime/spec/train_eagle.py; this entry keeps the command's name."""

import sys

from loom.runtime.spec.train_eagle import main, parse_args

__all__ = ["main", "parse_args"]

if __name__ == "__main__":
    sys.exit(main())
