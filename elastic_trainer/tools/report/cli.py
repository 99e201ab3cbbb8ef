"""``elastic-train report RUN``: one PNG and a short summary of what happened in a run.

RUN is the run's JSON event log (the supervisor's ``--log-file``, which the workers append
to as well) or a run folder holding ``events*.jsonl`` files (one per node, merged by time).
The PNG goes to ``-o/--output`` (default: ``<log name>.png`` next to the log, or
``events.png`` in the folder); ``--json`` prints the summary as JSON. The summary needs
nothing optional: without matplotlib the PNG is skipped with a line saying how to get it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence

from elastic_trainer.cliparse import OneLineParser
from elastic_trainer.errors import ConfigError
from elastic_trainer.tools.report.events import load_event_log
from elastic_trainer.tools.report.runs import split_stray
from elastic_trainer.tools.report.summary import format_summary, summarize
from snapshots.display import printable

PROG = "elastic-train report"
PLOT_SKIPPED = "skipped: matplotlib is not installed (pip install 'elastic-train[report]')"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument(
        "run", metavar="RUN", help="event log file, or a run folder of events*.jsonl (one per node)"
    )
    p.add_argument("-o", "--output", help="PNG path (default: next to the log)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-plot", action="store_true", help="summary only, no PNG")
    return p


def default_output(log_path: str) -> str:
    if os.path.isdir(log_path):  # a run folder: the picture lands beside its logs
        return os.path.join(log_path, "events.png")
    return os.path.splitext(log_path)[0] + ".png"


def has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def run(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    log = load_event_log(args.run)
    summary = summarize(log.events)
    output = None
    skipped = not args.no_plot and not has_matplotlib()
    if not args.no_plot and not skipped:
        from elastic_trainer.tools.report.plot import draw_report

        output = args.output or default_output(log.path)
        draw_report(split_stray(log.events)[0], output, title=f"elastic-train run: {log.path}")
    if args.json:
        print(json.dumps({**summary.to_dict(), "log": log.path, "png": output}, indent=2))
        if skipped:  # stdout stays one JSON document
            print(f"plot: {PLOT_SKIPPED}", file=sys.stderr)
    else:
        print_text(format_summary(summary, source=log.path))
        if output or skipped:
            print(f"plot:        {output or PLOT_SKIPPED}")
    return 0


def one_line_errors(command: Callable[[Sequence[str]], int], argv: Sequence[str] | None) -> int:
    """Run an ops command: bad input is one ``elastic-train: error:`` line and its exit code.
    An event log is read from a folder others may write: an event whose fields have types
    no event of ours has is bad input too, not a traceback."""
    try:
        return command(sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        print(f"elastic-train: error: {printable(str(exc), limit=2000)}", file=sys.stderr)
        return exc.exit_code
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as exc:
        line = f"an event in the log holds a value of an unexpected type ({type(exc).__name__})"
        print(f"elastic-train: error: {line}: was it written by elastic-train?", file=sys.stderr)
        return 2


def print_text(text: str) -> None:
    """``text`` to stdout with every line safe for a terminal (``snapshots.display``): node
    names, errors and reasons come from the event log, which is read, not trusted."""
    print("\n".join(printable(line, limit=10_000) for line in text.split("\n")))


def main(argv: Sequence[str] | None = None) -> int:
    return one_line_errors(run, argv)


if __name__ == "__main__":
    sys.exit(main())
