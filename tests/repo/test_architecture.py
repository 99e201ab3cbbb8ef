"""The layout's rules, read from the source (no imports run): which code may import which.

- ``snapshots`` is a library of its own: it never imports ``elastic_trainer``.
- A module named ``_x`` is private to its package: nothing outside that package imports it.
- ``supervisor.core`` is pure: no processes, sockets, threads, files or torch, and within the
  project only the contract, the errors and the core itself.
- Code that runs inside every worker (``worker``, ``jobs``) never imports the supervisor's or
  the operator tools' modules: a worker must not load them.
- Every package has an ``__init__`` whose docstring says what it is and where it runs.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import ROOT

PACKAGES = ("elastic_trainer", "snapshots")
IMPURE = {
    "os", "io", "socket", "subprocess", "threading", "multiprocessing", "shutil", "select",
    "pathlib", "tempfile", "logging", "structlog", "torch", "psutil", "fsspec", "numpy",
}  # fmt: skip
CORE_MAY_IMPORT = (
    "elastic_trainer.contract",
    "elastic_trainer.errors",
    "elastic_trainer.supervisor.core",
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> Iterator[tuple[str, Path]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield _module_name(path), path


def _imports(path: Path, module: str) -> Iterator[tuple[str, int]]:
    """Every module an import statement names (``from a import b`` names ``a`` and ``a.b``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            yield base, node.lineno
            for alias in node.names:
                yield f"{base}.{alias.name}", node.lineno


MODULES = dict(_modules())
IMPORTS = {name: list(_imports(path, name)) for name, path in MODULES.items()}


def _violations(rule) -> list[str]:
    return [
        f"{MODULES[name].relative_to(ROOT)}:{line}: {target}"
        for name, imports in IMPORTS.items()
        for target, line in imports
        if rule(name, target)
    ]


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_snapshots_never_imports_elastic_trainer() -> None:
    assert _violations(lambda m, t: _within(m, "snapshots") and _within(t, "elastic_trainer")) == []


def _private_owner(target: str) -> str | None:
    """The package a private module belongs to, if ``target`` is (inside) one."""
    parts = target.split(".")
    for i, part in enumerate(parts):
        private_module = ".".join(parts[: i + 1]) in MODULES
        if part.startswith("_") and not part.startswith("__") and private_module:
            return ".".join(parts[:i])
    return None


def test_no_module_imports_another_packages_private_module() -> None:
    def rule(module: str, target: str) -> bool:
        owner = _private_owner(target)
        return owner is not None and not _within(module, owner)

    assert _violations(rule) == []


def test_the_supervisor_core_is_pure() -> None:
    def rule(module: str, target: str) -> bool:
        if not _within(module, "elastic_trainer.supervisor.core"):
            return False
        if target.split(".")[0] in IMPURE:
            return True
        project = target.split(".")[0] in PACKAGES
        return project and not any(_within(target, allowed) for allowed in CORE_MAY_IMPORT)

    assert _violations(rule) == []


@pytest.mark.parametrize("runs_in_workers", ["elastic_trainer.worker", "elastic_trainer.jobs"])
def test_worker_code_never_imports_the_supervisor(runs_in_workers: str) -> None:
    def rule(module: str, target: str) -> bool:
        return _within(module, runs_in_workers) and (
            _within(target, "elastic_trainer.supervisor")
            or _within(target, "elastic_trainer.tools")
        )

    assert _violations(rule) == []


def test_every_package_says_what_it_is() -> None:
    silent = [
        str(path.relative_to(ROOT))
        for name, path in MODULES.items()
        if path.name == "__init__.py" and not ast.get_docstring(ast.parse(path.read_text()))
    ]
    assert silent == []


def test_the_rules_can_fail() -> None:
    """The checks see a violation when there is one (so an empty list above means something)."""
    assert _private_owner("snapshots.write._x") is None  # no such module: nothing to own
    some_package = next(n for n, p in MODULES.items() if p.name == "__init__.py" and "." in n)
    sibling = next(n for n in MODULES if n.startswith(some_package + "."))
    fake = f"{some_package}._fake"
    MODULES[fake] = MODULES[sibling]
    try:
        assert _private_owner(f"{fake}.thing") == some_package
    finally:
        del MODULES[fake]
    assert "os" in IMPURE and _within("elastic_trainer.supervisor.core.policy", CORE_MAY_IMPORT[2])
