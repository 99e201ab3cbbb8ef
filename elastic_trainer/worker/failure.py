"""How a worker tells its supervisor why it failed: torch's per-worker error file.

torch's agent gives each worker ``TORCHELASTIC_ERROR_FILE`` and reads it back when the worker
dies (``ProcessFailure.message``); the supervisor's ``worker.failed`` (error_summary) and
``job.finished`` (error) carry its first line. Without a launcher this does nothing.
"""

from __future__ import annotations

import os
import sys

from elastic_trainer.errors import ElasticTrainError


def record_error(exc: BaseException) -> None:
    """Write ``exc`` to this worker's error file, if the launcher gave it one."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    get_error_handler().record_exception(exc)


def is_config_error(exc: BaseException) -> bool:
    """Our own refusal of a flag or setting: a restart would fail the same way (exit 2)."""
    return isinstance(exc, ElasticTrainError) and exc.exit_code == 2


def refuse(exc: ElasticTrainError) -> int:
    """One line on stderr, the error file, and the exit code: what a worker does with a
    configuration error instead of a traceback."""
    print(f"error: {' '.join(str(exc).split())}", file=sys.stderr, flush=True)
    record_error(exc)
    return exc.exit_code
