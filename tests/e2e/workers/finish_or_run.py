"""Exits 0 at once where FINISH_AT_ONCE=1 (its node's job is done); else runs until stopped.
No process group: each node's end is its own."""

import os
import sys
import time

if os.environ.get("FINISH_AT_ONCE") == "1":
    sys.exit(0)
deadline = time.monotonic() + 300
while time.monotonic() < deadline:
    time.sleep(0.1)
