"""Prints one line per stream with its rank; no process group."""

import os
import sys

rank = os.environ["RANK"]
print(f"hello out {rank}")
print(f"hello err {rank}", file=sys.stderr)
