"""``elastic-train snapshots``: list, show, verify and prune snapshots for operators.

Exit codes: 0 ok; 1 a snapshot failed verification (the bad file is named); 2 bad usage, bad
URL, unreachable storage, or no snapshots at the URL. Messages are one line on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

import structlog

from snapshots.errors import NoValidSnapshotError, SnapshotError
from snapshots.store import SnapshotStore

EXIT_OK, EXIT_CORRUPT, EXIT_USAGE = 0, 1, 2


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Inspect and manage snapshots.")
    sub = parser.add_subparsers(dest="command", required=True)
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("url", help="snapshot URL: /path, file://, memory://, s3://, gs://...")
    options.add_argument(
        "--storage-options",
        default=None,
        metavar="JSON",
        help='fsspec options, e.g. \'{"client_kwargs": {"endpoint_url": "http://..."}}\'',
    )
    p = sub.add_parser("list", parents=[options], help="committed snapshots, oldest first")
    p.add_argument("--json", action="store_true", help="one JSON array on stdout")
    p = sub.add_parser("show", parents=[options], help="one snapshot's manifest")
    p.add_argument("--step", type=int, default=None, help="default: the newest verified one")
    p = sub.add_parser("verify", parents=[options], help="check sizes and checksums")
    p.add_argument("--step", type=int, default=None, help="default: every committed snapshot")
    p = sub.add_parser("prune", parents=[options], help="delete all but the newest K")
    p.add_argument("--keep", type=int, required=True)
    p.add_argument("--keep-every", type=int, default=None, help="also keep every M-th step")
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "elastic-train snapshots") -> int:
    try:
        args = _parser(prog).parse_args(argv)
    except SystemExit as exc:  # argparse already printed the usage line
        return int(exc.code or 0)
    _log_to_stderr()
    try:
        store = SnapshotStore(
            args.url,
            async_save=False,
            keep=None,
            keep_every=getattr(args, "keep_every", None),
            storage_options=_storage_options(args.storage_options),
            create=False,
        )
        return COMMANDS[args.command](store, args)
    except NoValidSnapshotError as exc:
        return _fail(prog, exc, EXIT_CORRUPT)
    except (SnapshotError, ValueError) as exc:
        return _fail(prog, exc, EXIT_USAGE)


def _fail(prog: str, exc: BaseException, code: int) -> int:
    print(f"{prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
    return code


def _log_to_stderr() -> None:
    # stdout carries the answer (maybe JSON); events go to stderr unless already configured.
    if not structlog.is_configured():
        # Resolve sys.stderr per logger, not once: it may be swapped (tests, redirects).
        structlog.configure(logger_factory=lambda *_: structlog.PrintLogger(sys.stderr))


def _storage_options(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--storage-options is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError("--storage-options must be a JSON object")
    return value


def _require_some(store: SnapshotStore) -> list[int]:
    steps = store.committed_steps()
    if not steps:
        raise SnapshotError(f"no snapshots at {store.url}")
    return steps


def _cmd_list(store: SnapshotStore, args: argparse.Namespace) -> int:
    _require_some(store)
    infos = store.list()
    if args.json:
        print(json.dumps([dataclasses.asdict(i) for i in infos], indent=1))
        return EXIT_OK
    print(f"{'step':>12}  {'epoch':>5}  {'world':>5}  {'MB':>9}  created_at")
    for i in infos:
        mb = i.bytes / 1e6
        print(f"{i.step:>12}  {i.epoch:>5}  {i.world_size:>5}  {mb:>9.2f}  {i.created_at}")
    return EXIT_OK


def _cmd_show(store: SnapshotStore, args: argparse.Namespace) -> int:
    _require_some(store)
    step = args.step
    if step is None:
        latest = store.latest()
        step = latest.step if latest is not None else None
    result = store.verify(step)  # type: ignore[arg-type]
    if result.info is None:
        raise SnapshotError(
            f"no readable snapshot of step {step} at {store.url}: {result.problems}"
        )
    body = dataclasses.asdict(result.info)
    body["verified"] = result.ok
    body["problems"] = result.problems
    print(json.dumps(body, indent=1))
    return EXIT_OK if result.ok else EXIT_CORRUPT


def _cmd_verify(store: SnapshotStore, args: argparse.Namespace) -> int:
    steps = [args.step] if args.step is not None else _require_some(store)
    failed = 0
    for step in steps:
        result = store.verify(step)
        if result.ok:
            print(f"ok      step {step}")
        else:
            failed += 1
            print(f"FAILED  step {step}: {'; '.join(result.problems)}")
    return EXIT_CORRUPT if failed else EXIT_OK


def _cmd_prune(store: SnapshotStore, args: argparse.Namespace) -> int:
    _require_some(store)
    deleted = store.prune(args.keep)
    print(f"deleted {len(deleted)} snapshot(s): {deleted}" if deleted else "nothing to delete")
    return EXIT_OK


COMMANDS = {"list": _cmd_list, "show": _cmd_show, "verify": _cmd_verify, "prune": _cmd_prune}

if __name__ == "__main__":
    sys.exit(main())
