"""The preflight child: ``python -m elastic_trainer.entrypoints.preflight (SCRIPT | -m MODULE)
[args...]``, run by the supervisor (``supervisor/cli/preflight.py``) before any worker starts.

It imports the entrypoint under a name other than ``__main__`` (training code behind the usual
guard does not run), calls its ``preflight(argv, world_sizes)`` and prints one JSON line: its
warnings, its refusal, or the exit of its argument parser.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
import traceback

from elastic_trainer import proc_title
from elastic_trainer.supervisor.cli.preflight import ENV_WORLD_SIZES, FUNCTION


def _load(argv: list[str]) -> object:
    if argv[0] == "-m":
        return importlib.import_module(argv[1])
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    return runpy.run_path(argv[0], run_name="__elastic_train_preflight__")[FUNCTION]


def main(argv: list[str]) -> int:
    proc_title.set_title(proc_title.preflight(argv))
    world_sizes = [int(w) for w in os.environ.get(ENV_WORLD_SIZES, "1").split(",") if w]
    args = argv[2:] if argv[0] == "-m" else argv[1:]
    try:
        loaded = _load(argv)
        check = getattr(loaded, FUNCTION, loaded)
        warnings = check(list(args), world_sizes) or []
    except SystemExit as exc:  # argparse printed "prog: error: ..." to stderr already
        print(json.dumps({"exit": exc.code}))
        return 2
    except Exception as exc:  # any refusal: one line for the operator
        traceback.print_exc(file=sys.stderr)
        print(json.dumps({"error": " ".join(str(exc).split()) or type(exc).__name__}))
        return 2
    print(json.dumps({"warnings": [str(w) for w in warnings]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
