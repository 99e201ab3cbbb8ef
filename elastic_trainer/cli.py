"""``elastic-train``: argv -> the right command -> exit code.

``elastic-train [options] [SCRIPT | -m MODULE] [args...]`` runs the supervisor; a few
sub-commands (``snapshots``, ``report``, ``status``, ``store``) serve ops. Sub-commands are
dispatched on the first word so that a training script's own arguments never collide with ours.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence


def _snapshots(argv: Sequence[str]) -> int:
    from snapshots.cli import main

    return main(argv, prog="elastic-train snapshots")


def _report(argv: Sequence[str]) -> int:
    from elastic_trainer.reporting.cli import main

    return main(argv)


def _status(argv: Sequence[str]) -> int:
    from elastic_trainer.status import main

    return main(argv)


def _store(argv: Sequence[str]) -> int:
    from elastic_trainer.store_server import main

    return main(argv)


def _supervise(argv: Sequence[str]) -> int:
    from elastic_trainer.supervisor.run import main

    return main(argv)


SUBCOMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "snapshots": _snapshots,
    "report": _report,
    "status": _status,
    "store": _store,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    command = SUBCOMMANDS.get(args[0]) if args else None
    if command is not None:
        return command(args[1:])
    return _supervise(args)


if __name__ == "__main__":
    sys.exit(main())
