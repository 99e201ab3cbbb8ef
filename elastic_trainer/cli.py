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
    from elastic_trainer.tools.report.cli import main

    return main(argv)


def _status(argv: Sequence[str]) -> int:
    from elastic_trainer.tools.status import main

    return main(argv)


def _store(argv: Sequence[str]) -> int:
    from elastic_trainer.tools.store_server import main

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
    code = _supervise(args)
    if argv is None:  # the process's own command line: it ends here
        _exit_without_finalizing(code)
    return code


def _exit_without_finalizing(code: int) -> None:
    """End the supervisor's process as ``bootstrap`` ends a worker's: the interpreter's exit
    up to finalization, then ``os._exit``. torch's threads (the rendezvous keep-alive inside
    a store call, the hosted store's server) may still be in C++ when it finalizes; one that
    then asks for the GIL is ended with ``pthread_exit``, whose unwind through ``noexcept``
    frames aborts the process (SIGABRT, "terminate called without an active exception")
    after the job's own exit code was decided: seen once in four runs of a failing job."""
    from elastic_trainer.entrypoints.worker import exit_without_finalizing

    exit_without_finalizing(code)


if __name__ == "__main__":
    sys.exit(main())
