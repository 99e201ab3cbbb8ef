"""A worker that starts a child of its own (a grandchild of the supervisor), then runs until
killed, or until ``--exit-after`` seconds when given. No torch: it starts in milliseconds.

Each worker writes ``<pid>.json`` (its pid and its child's) into ``$ORPHAN_DIR``.
"""

import argparse
import json
import os
import subprocess
import sys
import time

FOREVER = "import time\nwhile True:\n    time.sleep(1)\n"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--exit-after", type=float, default=None)
    args = p.parse_args()
    child = subprocess.Popen([sys.executable, "-c", FOREVER])
    out = os.path.join(os.environ["ORPHAN_DIR"], f"{os.getpid()}.json")
    with open(out + ".tmp", "w") as f:
        json.dump({"worker": os.getpid(), "grandchild": child.pid}, f)
    os.replace(out + ".tmp", out)
    deadline = None if args.exit_after is None else time.monotonic() + args.exit_after
    while deadline is None or time.monotonic() < deadline:
        time.sleep(0.1)
    child.kill()
    child.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
