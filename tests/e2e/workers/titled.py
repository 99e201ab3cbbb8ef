"""A plain script with a child of its own (as a DataLoader worker is), both waiting at a gate.

It writes its pid and its child's to ``ARGV1/waiting.json``, then both wait until the test
creates ``ARGV1/go`` (the test reads what ``ps`` shows for the live tree meanwhile).
"""

import json
import os
import sys
import time


def wait_for_go(folder: str) -> None:
    while not os.path.exists(os.path.join(folder, "go")):
        time.sleep(0.1)  # a file the test writes: no timing assumed


def main() -> None:
    folder = sys.argv[1]
    child = os.fork()
    if child == 0:
        wait_for_go(folder)
        os._exit(0)
    with open(os.path.join(folder, "waiting.tmp"), "w") as f:
        json.dump({"worker": os.getpid(), "child": child}, f)
    os.rename(os.path.join(folder, "waiting.tmp"), os.path.join(folder, "waiting.json"))
    wait_for_go(folder)
    os.waitpid(child, 0)


if __name__ == "__main__":
    main()
