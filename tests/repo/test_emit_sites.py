"""Every ``emit(...)`` call names a catalogued event and passes its fields, read from the source.

``emit`` (``elastic_trainer.contract.events`` and ``snapshots.events``) checks the name and the
required fields only when it runs: a missing field raises KeyError inside the supervisor loop or
a worker, on a path a test may never take. This reads every call instead, the way each ``emit``
reads it: the first argument names an event of its catalogue (and not one it refuses), and the
keyword arguments that are fields (not ``emit``'s own parameters, such as ``level``) cover that
event's fields. A call that passes ``**mapping`` is checked through the mapping when the same
function builds it as a dict literal with literal keys; otherwise, and where the name is not a
literal (nor a module constant), the call must be in ``UNCHECKED`` with the reason, and with the
function that returns the mapping as a dict literal, whose keys are then checked in its stead.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import pytest

import snapshots.events
from elastic_trainer.contract import events
from tests import ROOT

PACKAGES = ("elastic_trainer", "snapshots")
LEVELS = frozenset({"debug", "info", "warning", "error", "critical"})


class Excuse(NamedTuple):
    """Why a call cannot be read; ``built_by`` (file, function) returns the call's mapping as a
    dict literal, which ``test_excused_mappings_are_built_with_the_fields`` reads instead."""

    reason: str
    built_by: tuple[str, str] | None = None


# (file, function, event name or source of the name expression) -> why it cannot be read
UNCHECKED: Mapping[tuple[str, str, str], Excuse] = {
    (
        "elastic_trainer/supervisor/processes/observer.py",
        "GroupObserver.observe",
        "recovery.completed",
    ): Excuse(
        "the fields come from the ledger, computed at the end of a recovery",
        ("elastic_trainer/supervisor/core/ledger.py", "Ledger.observe"),
    ),
    (
        "elastic_trainer/supervisor/processes/observer.py",
        "GroupObserver.observe",
        "recovery.unmeasured",
    ): Excuse(
        "the fields come from the ledger, computed as a plain script's workers restart",
        ("elastic_trainer/supervisor/core/ledger.py", "Ledger.unmeasured_restart"),
    ),
    ("elastic_trainer/supervisor/run.py", "Supervisor._supervise", "supervisor.started"): Excuse(
        "the fields are the run configuration's summary",
        ("elastic_trainer/contract/config.py", "RunConfig.summary"),
    ),
    ("elastic_trainer/jobs/display.py", "Progress.step", "train.progress"): Excuse(
        "the fields are the progress meter's report",
        ("elastic_trainer/jobs/recipe.py", "ProgressMeter.update"),
    ),
    ("elastic_trainer/worker/session.py", "TrainingSession.log_metrics", "train.progress"): Excuse(
        "the fields are the script's figures, rate-limited by the metrics reporter",
        ("elastic_trainer/worker/progress.py", "MetricsReporter.report"),
    ),
}


@dataclass(frozen=True)
class Emitter:
    """One ``emit`` function and what it accepts, read from its module."""

    module: str
    catalogue: Mapping[str, tuple[str, ...]]
    refused: frozenset[str]  # catalogued names this emit raises on
    params: frozenset[str]  # emit's own keyword parameters: not event fields


def _emitter(
    module: str,
    fn: Callable[..., Any],
    catalogue: Mapping[str, tuple[str, ...]],
    refused: frozenset[str] = frozenset(),
) -> Emitter:
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = [p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds]
    return Emitter(module, catalogue, refused, frozenset(params[1:]))  # params[0]: the name


EMITTERS = (
    _emitter(events.__name__, events.emit, events.CATALOGUE, events._LOGGING_ONLY),
    _emitter(snapshots.events.__name__, snapshots.events.emit, snapshots.events.EVENTS),
)


@dataclass(frozen=True)
class Site:
    """One call of an ``emit``."""

    line: int
    function: str
    emitter: Emitter
    name: str | None  # None: not a literal
    name_source: str
    fields: frozenset[str]
    opaque: bool  # passes a ``**mapping`` that may hold keys beyond ``fields``
    positional: int
    levels: tuple[str, ...]

    @property
    def key(self) -> str:
        return self.name if self.name is not None else self.name_source

    def missing(self) -> list[str]:
        wanted = self.emitter.catalogue.get(self.name, ()) if self.name is not None else ()
        return [f for f in wanted if f not in self.fields]

    @property
    def unreadable(self) -> bool:
        """Only the run can tell: the name is not a literal, or a field it lacks in the source
        may come from a ``**mapping`` whose keys cannot be read."""
        return self.name is None or (self.opaque and bool(self.missing()))


def _module_of(path: str) -> str:
    parts = Path(path).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _bindings(tree: ast.Module, path: str) -> tuple[dict[str, Emitter], dict[str, Emitter]]:
    """Local names bound to an emit function, and to a module holding one."""
    by_module = {e.module: e for e in EMITTERS}
    module = _module_of(path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    functions: dict[str, Emitter] = {}
    modules: dict[str, Emitter] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                local = alias.asname or alias.name
                if alias.name == "emit" and base in by_module:
                    functions[local] = by_module[base]
                elif f"{base}.{alias.name}" in by_module:
                    modules[local] = by_module[f"{base}.{alias.name}"]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in by_module:
                    modules[alias.asname or alias.name] = by_module[alias.name]
    return functions, modules


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level names assigned once, to a string literal."""
    seen: dict[str, list[ast.expr]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    seen.setdefault(target.id, []).append(node.value)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
            seen.setdefault(node.target.id, []).append(node.value)
    return {
        name: values[0].value
        for name, values in seen.items()
        if len(values) == 1
        and isinstance(values[0], ast.Constant)
        and isinstance(values[0].value, str)
    }


Keys = tuple[frozenset[str], bool]  # keys a mapping surely has; whether it may have others


def _mapping_keys(expr: ast.expr, scope: ast.AST | None) -> Keys:
    """The keys of a ``**`` argument: a dict literal (``{"k": v, **more}``), ``dict(k=v)``,
    or a name that ``scope`` binds once to one of those (plus ``name["k"] = v``)."""
    if isinstance(expr, ast.Dict):
        keys: set[str] = set()
        more = False
        for key, value in zip(expr.keys, expr.values, strict=True):
            if key is None:  # {**inner}
                inner, inner_more = _mapping_keys(value, scope)
                keys |= inner
                more = more or inner_more
            elif isinstance(key, ast.Constant) and isinstance(key.value, str):
                keys.add(key.value)
            else:
                more = True
        return frozenset(keys), more
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "dict":
        named = frozenset(k.arg for k in expr.keywords if k.arg is not None)
        return named, bool(expr.args) or any(k.arg is None for k in expr.keywords)
    if isinstance(expr, ast.Name) and scope is not None:
        return _bound_keys(scope, expr.id)
    return frozenset(), True


def _bound_keys(scope: ast.AST, name: str) -> Keys:
    """The keys of a dict ``scope`` binds to ``name`` once and never deletes from."""
    built: list[ast.expr] = []
    added: set[str] = set()
    more = False
    for node in ast.walk(scope):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and target.id == name:
                    built.append(node.value)
                elif _is_item_of(target, name):
                    if isinstance(target.slice, ast.Constant):
                        added.add(target.slice.value)
                    else:
                        more = True
        elif _removes_from(node, name):
            return frozenset(), True
    if len(built) != 1:
        return frozenset(), True
    keys, built_more = _mapping_keys(built[0], None)
    return keys | added, more or built_more


def _removes_from(node: ast.AST, name: str) -> bool:
    """``del name[...]`` or ``name.pop`` / ``popitem`` / ``clear``."""
    if isinstance(node, ast.Delete):
        return any(_is_item_of(t, name) for t in node.targets)
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == name
        and node.attr in ("pop", "popitem", "clear")
    )


def _is_item_of(target: ast.expr, name: str) -> bool:
    return (
        isinstance(target, ast.Subscript)
        and isinstance(target.value, ast.Name)
        and target.value.id == name
    )


def _levels(expr: ast.expr | None) -> tuple[str, ...]:
    """The literal strings a ``level=`` expression can take (both arms of ``a if c else b``)."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return (expr.value,)
    if isinstance(expr, ast.IfExp):
        return _levels(expr.body) + _levels(expr.orelse)
    return ()


class _Finder(ast.NodeVisitor):
    def __init__(self, tree: ast.Module, path: str) -> None:
        self.functions, self.modules = _bindings(tree, path)
        self.constants = _constants(tree)
        self.stack: list[ast.AST] = []
        self.names: list[str] = []
        self.sites: list[Site] = []
        self.called: set[int] = set()  # ids of the ``emit`` expressions that are called
        self.passed: list[int] = []  # lines where an ``emit`` is used other than called

    def _scoped(self, node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.stack.append(node)
        self.names.append(node.name)
        self.generic_visit(node)
        self.names.pop()
        self.stack.pop()

    visit_ClassDef = visit_FunctionDef = visit_AsyncFunctionDef = _scoped

    def _emitter_of(self, func: ast.expr) -> Emitter | None:
        if isinstance(func, ast.Name):
            return self.functions.get(func.id)
        if isinstance(func, ast.Attribute) and func.attr == "emit":
            return self.modules.get(ast.unparse(func.value))
        return None

    def visit_Call(self, node: ast.Call) -> None:
        emitter = self._emitter_of(node.func)
        if emitter is not None:
            self.called.add(id(node.func))
            self.sites.append(self._site(node, emitter))
        self.generic_visit(node)

    def _reference(self, node: ast.Name | ast.Attribute) -> None:
        # emit handed on (a callback, a partial) hides its calls from this check
        handed_on = isinstance(node.ctx, ast.Load) and id(node) not in self.called
        if handed_on and self._emitter_of(node) is not None:
            self.passed.append(node.lineno)
        self.generic_visit(node)

    visit_Name = visit_Attribute = _reference

    def _site(self, node: ast.Call, emitter: Emitter) -> Site:
        first = node.args[0] if node.args else None
        name: str | None = None
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            name = first.value
        elif isinstance(first, ast.Name):
            name = self.constants.get(first.id)
        fields: set[str] = set()
        opaque = False
        scope = self.stack[-1] if self.stack else None
        for keyword in node.keywords:
            if keyword.arg is not None:
                fields.add(keyword.arg)
            else:
                keys, more = _mapping_keys(keyword.value, scope)
                fields |= keys
                opaque = opaque or more
        level = next((k.value for k in node.keywords if k.arg == "level"), None)
        return Site(
            line=node.lineno,
            function=".".join(self.names) or "<module>",
            emitter=emitter,
            name=name,
            name_source=ast.unparse(first) if first is not None else "",
            fields=frozenset(fields - emitter.params),
            opaque=opaque,
            positional=len(node.args),
            levels=_levels(level) if "level" in emitter.params else (),
        )


def _scan(source: str, path: str) -> _Finder:
    tree = ast.parse(source, path)
    finder = _Finder(tree, path)
    finder.visit(tree)
    return finder


def find_sites(source: str, path: str) -> list[Site]:
    """Every call of an ``emit`` in one module's source (``path`` relative to the root)."""
    return _scan(source, path).sites


def problems(
    source: str, path: str, unchecked: Mapping[tuple[str, str, str], object] = UNCHECKED
) -> Iterator[str]:
    """One line per call that would raise in ``emit`` (or cannot be read and is not excused)."""
    finder = _scan(source, path)
    for line in finder.passed:
        yield f"{path}:{line}: emit is passed on, not called; call it where the event happens"
    for site in finder.sites:
        where = f"{path}:{site.line} ({site.function})"
        excused = (path, site.function, site.key) in unchecked
        if site.positional != 1:
            yield f"{where}: emit takes the event name as its one positional argument"
            continue
        if site.name is None:
            if not excused:
                yield (
                    f"{where}: event name {site.name_source} is not a string literal; "
                    "pass the name literally, or add the call to UNCHECKED with the reason"
                )
            continue
        catalogue = site.emitter.catalogue
        if site.name not in catalogue or site.name in site.emitter.refused:
            yield (
                f"{where}: {site.name!r} is not an event {site.emitter.module}.emit logs; "
                "use a name of its catalogue"
            )
            continue
        bad_levels = sorted(set(site.levels) - LEVELS)
        if bad_levels:
            yield f"{where}: {site.name!r} with level {bad_levels}; use one of {sorted(LEVELS)}"
        missing = site.missing()
        if missing and site.opaque:
            if not excused:
                yield (
                    f"{where}: {site.name!r} gets its fields {missing} only from a **mapping "
                    "whose keys cannot be read; pass them as keywords, or add the call to "
                    "UNCHECKED with the reason"
                )
        elif missing:
            yield f"{where}: {site.name!r} is missing its fields {missing}; pass them as keywords"


def _sources() -> Iterator[tuple[str, str]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), path.read_text()


def test_every_emit_call_names_a_catalogued_event_with_its_fields() -> None:
    found = [line for path, source in _sources() for line in problems(source, path)]
    assert not found, "\n".join(found)


def test_unchecked_lists_only_calls_that_exist_and_cannot_be_read() -> None:
    unreadable = {
        (path, site.function, site.key)
        for path, source in _sources()
        for site in find_sites(source, path)
        if site.unreadable
    }
    stale = sorted(set(UNCHECKED) - unreadable)
    assert not stale, f"UNCHECKED entries that match no unreadable emit call; remove: {stale}"


def test_the_scan_finds_the_calls() -> None:
    """Guards the scan itself: an import form it missed would make the check pass vacuously."""
    sites = [site for path, source in _sources() for site in find_sites(source, path)]
    modules = {site.emitter.module for site in sites}
    assert modules == {e.module for e in EMITTERS}
    assert len(sites) >= 50


def _function(tree: ast.Module, qualname: str) -> ast.FunctionDef | None:
    scope: ast.AST = tree
    for part in qualname.split("."):
        scope = next(
            (
                node
                for node in getattr(scope, "body", [])
                if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == part
            ),
            None,
        )
        if scope is None:
            return None
    return scope if isinstance(scope, ast.FunctionDef) else None


def _returned_keys(function: ast.FunctionDef) -> list[frozenset[str]]:
    """The keys each ``return`` of a mapping surely has (``return None`` skipped)."""
    returns = [
        node.value
        for node in ast.walk(function)
        if isinstance(node, ast.Return)
        and node.value is not None
        and not (isinstance(node.value, ast.Constant) and node.value.value is None)
    ]
    return [_mapping_keys(value, function)[0] for value in returns]


@pytest.mark.parametrize("site", sorted(k for k, e in UNCHECKED.items() if e.built_by), ids=str)
def test_excused_mappings_are_built_with_the_fields(site: tuple[str, str, str]) -> None:
    path, qualname = UNCHECKED[site].built_by  # type: ignore[misc]
    function = _function(ast.parse((ROOT / path).read_text(), path), qualname)
    assert function is not None, f"{path} has no function {qualname}; fix UNCHECKED[{site}]"
    built = _returned_keys(function)
    assert built, f"{path}:{qualname} returns no dict literal; fix UNCHECKED[{site}]"
    wanted = events.CATALOGUE[site[2]]
    for keys in built:
        missing = [f for f in wanted if f not in keys]
        assert not missing, f"{path}:{qualname} builds {site[2]!r} without its fields {missing}"


SYNTHETIC = """
from elastic_trainer.contract.events import emit
from elastic_trainer.contract import events as ev
from snapshots.events import emit as snap_emit

NAME = "store.lingering"

def run(name):
    emit("store.stopped", level="warning")
    emit("store.startd", host="h", port=1, endpoint="h:1")
    ev.emit("preflight.warning", level="loud", warning="w")
    emit("log.record", logger="x", level="info", message="m")
    snap_emit("snapshot.pruned", steps=[1])
    emit(NAME)
    emit(name, linger_s=1)
    fields = {"host": "h", "port": 1}
    emit("store.exposed", **fields)
    emit("store.started", **other())
    good = {"host": "h", "port": 1}
    good["endpoint"] = "h:1"
    emit("store.started", **good)
    emit("store.lingering", linger_s=1)
    emit("store.lingering", **{"linger_s": 1, **other()})
    emit("store.exposed", host="h", port=1, hint="x", **other())
    later(emit)
"""


def test_the_checker_reports_each_kind_of_bad_call() -> None:
    found = list(problems(SYNTHETIC, "pkg/mod.py", unchecked={}))
    expected = [
        ":25: emit is passed on, not called",
        ":9 (run): 'store.stopped' is missing its fields ['signal']",
        ":10 (run): 'store.startd' is not an event",
        ":11 (run): 'preflight.warning' with level ['loud']",
        ":12 (run): 'log.record' is not an event",
        ":13 (run): 'snapshot.pruned' is missing its fields ['url']",
        ":14 (run): 'store.lingering' is missing its fields ['linger_s']",
        ":15 (run): event name name is not a string literal",
        ":17 (run): 'store.exposed' is missing its fields ['hint']",
        ":18 (run): 'store.started' gets its fields ['host', 'port', 'endpoint'] only from a **",
    ]
    assert len(found) == len(expected), "\n".join(found)
    for line, fragment in zip(found, expected, strict=True):
        assert fragment in line


@pytest.mark.parametrize(
    ("excused", "fragment"),
    [("name", "event name name"), ("store.started", "'store.started' gets")],
)
def test_unchecked_excuses_only_its_own_call(excused: str, fragment: str) -> None:
    found = list(problems(SYNTHETIC, "pkg/mod.py", unchecked={("pkg/mod.py", "run", excused): ""}))
    assert len(found) == 9, "\n".join(found)
    assert not any(fragment in line for line in found)
