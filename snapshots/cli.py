"""``elastic-train snapshots``: list, show, verify and prune snapshots for operators.

Exit codes: 0 ok; 1 damage found (a snapshot failed verification; the bad file is named);
2 bad usage, bad URL, unreachable storage, no snapshot folder, or no such snapshot. Every
error is one line on stderr: ``elastic-train: error: <what, and the fix>``.

What a snapshot holds is whatever its folder's writer put there: every text from it reaches
the terminal through ``snapshots.display.printable`` (control characters shown as escapes,
length bounded), or as JSON, which escapes them itself.

Only ``verify --deep`` (and ``prune`` when it is about to delete something: it must prove the
snapshot it keeps loads) imports torch; everything else reads manifests and checksums.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import structlog
import structlog.stdlib

from snapshots import retention
from snapshots.display import printable
from snapshots.errors import NoValidSnapshotError, SnapshotError, SnapshotNotFoundError
from snapshots.info import VerifyResult
from snapshots.read.catalog import Catalog
from snapshots.storage import RetryingStorage, backend_fix, open_storage, redact_url
from snapshots.write import housekeeping

EXIT_OK, EXIT_DAMAGED, EXIT_USAGE = 0, 1, 2
ERROR_PREFIX = "elastic-train: error:"
# Longest line of problems or error printed (a snapshot of many damaged files names each).
LINE_LIMIT = 4000


class UsageError(Exception):
    """Bad arguments: exit 2 with one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse's own usage errors: our one line
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = _Parser(
        prog=prog,
        description="Inspect and manage snapshots (exit 0 ok, 1 damage "
        "found, 2 usage error, not found or unreachable).",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    url = _Parser(add_help=False)
    url.add_argument("url", help="snapshot URL: /path, file://, memory://, s3://, gs://...")
    url.add_argument(
        "--storage-options",
        default=None,
        metavar="JSON",
        help='fsspec options, e.g. \'{"client_kwargs": {"endpoint_url": "http://..."}}\'',
    )
    p = sub.add_parser("list", parents=[url], help="committed snapshots, oldest first")
    p.add_argument("--json", action="store_true", help="one JSON array on stdout")
    p.add_argument("--no-verify", action="store_true", help="skip checksums (no data reads)")
    p = sub.add_parser("show", parents=[url], help="one snapshot's manifest, verified")
    p.add_argument("--step", type=int, default=None, help="default: the newest verified one")
    p = sub.add_parser("verify", parents=[url], help="check sizes and checksums")
    p.add_argument("--step", type=int, default=None, help="default: every committed snapshot")
    p.add_argument("--deep", action="store_true", help="also deserialise (weights_only)")
    p = sub.add_parser("export", parents=[url], help="one plain state dict of full tensors")
    p.add_argument("--step", type=int, default=None, help="default: the newest verified one")
    p.add_argument("-o", "--output", required=True, help="file to write (torch.save format)")
    p = sub.add_parser("prune", parents=[url], help="delete all but the newest K")
    p.add_argument("--keep", type=_positive, required=True, help="newest snapshots to keep")
    p.add_argument("--keep-every", type=_positive, default=None, help="also keep every M-th step")
    p.add_argument("--dry-run", action="store_true", help="print what would go; delete nothing")
    return parser


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def main(argv: Sequence[str] | None = None, prog: str = "elastic-train snapshots") -> int:
    try:
        args = _parser(prog).parse_args(argv)
        _log_to_stderr()
        catalog = _open(args.url, args.storage_options, write=args.command == "prune")
        return COMMANDS[args.command](catalog, args)
    except SystemExit as exc:  # --help printed
        return int(exc.code or 0)
    except NoValidSnapshotError as exc:
        return _fail(exc, EXIT_DAMAGED)
    except (UsageError, SnapshotError, ValueError) as exc:
        return _fail(exc, EXIT_USAGE)


def _fail(exc: BaseException, code: int) -> int:
    print(f"{ERROR_PREFIX} {printable(' '.join(str(exc).split()), LINE_LIMIT)}", file=sys.stderr)
    return code


def _log_to_stderr() -> None:
    """stdout carries the answer (maybe JSON): events go to stderr. Only the logger factory
    changes, and not when events already go through stdlib logging (a program that set that
    up chose its streams). "Configured" is not enough to skip: structlog's own default
    factory, which a configuration may keep (capture_logs restores it), prints to stdout.
    (Its console renderer shows a value with a space, as every problem has, as its repr:
    control characters escaped.)"""
    factory = structlog.get_config().get("logger_factory")
    if isinstance(factory, structlog.stdlib.LoggerFactory):
        return
    # Resolve sys.stderr per logger, not once: it may be swapped (tests, redirects).
    structlog.configure(logger_factory=lambda *_: structlog.PrintLogger(sys.stderr))


def _open(url: str, options_text: str | None, *, write: bool) -> Catalog:
    options = _storage_options(options_text)
    try:
        storage = open_storage(url, storage_options=options)
    except SnapshotError as exc:
        raise SnapshotError(_open_problem(url, exc)) from exc
    _check_folder(storage, url, write=write)
    return Catalog(storage, storage.url)


def _open_problem(url: str, exc: SnapshotError) -> str:
    if not isinstance(exc.__cause__, ImportError):
        return str(exc)
    scheme = url.split("://", 1)[0].lower()
    fix = backend_fix(scheme)
    return f"cannot open {redact_url(url)}: {scheme}:// needs a package that is missing; {fix}"


def _check_folder(storage: RetryingStorage, url: str, *, write: bool) -> None:
    try:
        storage.check(create=False)
    except FileNotFoundError as exc:
        raise SnapshotNotFoundError(
            f"there is no snapshot folder at {redact_url(url)} ({exc.strerror}); check the URL"
        ) from exc
    except SnapshotError as exc:
        if write or not isinstance(exc.__cause__, PermissionError):
            raise  # a read-only folder is fine for reading
    # The check may pass on an object store whatever the prefix: listing answers the rest.


def _storage_options(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--storage-options is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise UsageError("--storage-options must be a JSON object")
    return value


def _require_some(catalog: Catalog) -> list[int]:
    """Committed steps, oldest first; none is 'not found' (exit 2)."""
    steps = sorted(catalog.committed()[0])
    if not steps:
        raise SnapshotNotFoundError(f"no committed snapshots at {catalog.url}")
    return steps


def _require_step(catalog: Catalog, step: int) -> int:
    if step not in catalog.committed()[0]:
        raise SnapshotNotFoundError(
            f"no committed snapshot of step {step} at {catalog.url}; "
            f"'elastic-train snapshots list {catalog.url}' shows the steps there"
        )
    return step


def _row(result: VerifyResult, url: str, checked: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"step": result.step, "url": url}
    if result.info is not None:
        body = dataclasses.asdict(result.info)
    body["verified"] = result.ok if checked else None
    body["problems"] = result.problems
    return body


def _cmd_list(catalog: Catalog, args: argparse.Namespace) -> int:
    checked = not args.no_verify
    rows = [
        _row(_describe(catalog, step, checked), catalog.step_url(step), checked)
        for step in _require_some(catalog)
    ]
    if args.json:
        print(_json(rows))
    else:
        print(_table(rows))
    return EXIT_OK


def _describe(catalog: Catalog, step: int, checked: bool) -> VerifyResult:
    return catalog.verify(step) if checked else catalog.describe(step)


def _json(value: Any) -> str:
    """JSON escapes every control character but DEL, which only a string can hold."""
    return json.dumps(value, indent=1).replace("\x7f", "\\u007f")


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'step':>12}  {'epoch':>5}  {'world':>5}  {'MB':>9}  {'verified':<8}  created_at"]
    for r in rows:
        state = {True: "ok", False: "FAILED", None: "-"}[r["verified"]]
        if r.get("bytes") is None:
            lines.append(f"{r['step']:>12}  {'?':>5}  {'?':>5}  {'?':>9}  {state:<8}  ?")
            continue
        mb = r["bytes"] / 1e6
        epoch, world = printable(r["epoch"], 12), printable(r["world_size"], 12)
        lines.append(
            f"{r['step']:>12}  {epoch:>5}  {world:>5}  {mb:>9.2f}  "
            f"{state:<8}  {printable(r['created_at'], 64)}"
        )
    return "\n".join(lines)


def _cmd_show(catalog: Catalog, args: argparse.Namespace) -> int:
    _require_some(catalog)
    step = _newest_verified(catalog) if args.step is None else _require_step(catalog, args.step)
    result = catalog.verify(step)
    body = _row(result, catalog.step_url(step), True)
    if result.ok and result.info is not None and result.info.format_version >= 2:
        body["sharded"] = catalog.shard_summary(step)  # verified: the table is intact
    print(_json(body))
    return EXIT_OK if result.ok else EXIT_DAMAGED


def _newest_verified(catalog: Catalog) -> int:
    latest = catalog.latest()  # NoValidSnapshotError (exit 1) when every one is damaged
    if latest is None:
        raise SnapshotNotFoundError(f"no committed snapshots at {catalog.url}")
    return latest.step


def _cmd_verify(catalog: Catalog, args: argparse.Namespace) -> int:
    steps = _require_some(catalog) if args.step is None else [_require_step(catalog, args.step)]
    failed = 0
    for step in steps:
        result = catalog.verify(step, deep=args.deep)
        if result.ok:
            print(f"ok      step {step}" + (" (loads)" if args.deep else ""))
        else:
            failed += 1
            print(f"FAILED  step {step}: {printable('; '.join(result.problems), LINE_LIMIT)}")
    return EXIT_DAMAGED if failed else EXIT_OK


def _cmd_prune(catalog: Catalog, args: argparse.Namespace) -> int:
    committed = _require_some(catalog)
    anchor = _newest_loadable(catalog, committed, args.keep, args.keep_every)
    if args.dry_run:
        doomed = retention.steps_to_prune(
            committed, newest_verified=anchor, keep=args.keep, keep_every=args.keep_every
        )
        partial = retention.orphans_to_clean(
            catalog.committed()[1], newest_committed=committed[-1], in_flight=()
        )
        print(
            f"would delete {len(doomed)} snapshot(s): {doomed}; {len(partial)} partial "
            f"write(s): {partial}"
        )
        return EXIT_OK
    deleted = housekeeping.prune(
        catalog.storage,
        catalog,
        keep=args.keep,
        keep_every=args.keep_every,
        newest_verified=anchor,
        in_flight=(),
        stray_grace_s=housekeeping.DEFAULT_STRAY_GRACE_S,
    )
    print(f"deleted {len(deleted)} snapshot(s): {deleted}" if deleted else "nothing to delete")
    return EXIT_OK


def _newest_loadable(
    catalog: Catalog, committed: list[int], keep: int, keep_every: int | None
) -> int | None:
    """The snapshot retention anchors on: the newest one that loads, not merely verifies.

    Nothing older than the anchor survives unless kept by ``keep``; a lower anchor only
    deletes less. So when the newest *verified* one would delete nothing, torch (the deep
    check) is never needed.
    """
    latest = catalog.latest()
    if latest is None:
        return None
    shallow = retention.steps_to_prune(
        committed, newest_verified=latest.step, keep=keep, keep_every=keep_every
    )
    if not shallow:
        return latest.step
    deep = catalog.latest(deep=True)
    return deep.step if deep is not None else None


def _cmd_export(catalog: Catalog, args: argparse.Namespace) -> int:
    from snapshots.read import export

    _require_some(catalog)
    step = _newest_verified(catalog) if args.step is None else _require_step(catalog, args.step)
    count = export.export(catalog, step, args.output)
    print(f"exported step {step} ({count} tensors, full) to {args.output}")
    return EXIT_OK


COMMANDS = {
    "list": _cmd_list,
    "show": _cmd_show,
    "verify": _cmd_verify,
    "prune": _cmd_prune,
    "export": _cmd_export,
}

if __name__ == "__main__":
    sys.exit(main())
