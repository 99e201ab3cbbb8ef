"""bench/scale.py's worker: no torch, no work. It only lives (the control plane is what is
measured) and exits on SIGTERM."""

from __future__ import annotations

import signal
import sys
import time


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
