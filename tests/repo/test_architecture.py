"""The layout's rules, read from the source (no imports run): which code may import which.

- ``snapshots`` is a library of its own: it never imports ``elastic_trainer``.
- A module named ``_x`` is private to its package: nothing outside that package imports it.
- ``supervisor.core`` is pure: no processes, sockets, threads, files or torch, and within the
  project only the contract, the errors and the core itself.
- Code that runs inside every worker (``worker``, ``jobs``) never imports the supervisor's or
  the operator tools' modules: a worker must not load them.
- Every package has an ``__init__`` whose docstring says what it is and where it runs.
- Layers (``LAYERS``): a module imports only its own layer's modules and those below. The
  base (the contract, errors, logging, the small shared helpers, and the ``snapshots``
  library) is below ``worker`` and ``supervisor``, which never import each other; the
  built-in job sits on the worker side, the operator tools on the supervisor side (they read
  what a supervisor runs: its store, its state); the process entry points (``entrypoints``,
  ``cli``) are on top and alone wire the two sides together.
- A private *name* (``_x``) is imported only within its own package; torch's private names
  only in the compatibility modules (``TORCH_COMPAT``).
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
BASE = (
    "snapshots",
    "elastic_trainer.contract",
    "elastic_trainer.errors",
    "elastic_trainer.cliparse",
    "elastic_trainer.logging",
    "elastic_trainer.listeners",
    "elastic_trainer.private_files",
    "elastic_trainer.proc_title",
    "elastic_trainer.proc_tree",
)
# (the layer, what it may import besides its own modules); anything not named is the top
LAYERS = (
    ("base", BASE),
    ("elastic_trainer.worker", BASE),
    ("elastic_trainer.supervisor", BASE),
    # the built-in job is written as any user's script: against the public face
    ("elastic_trainer.jobs", (*BASE, "elastic_trainer.worker", "elastic_trainer.PUBLIC")),
    ("elastic_trainer.tools", (*BASE, "elastic_trainer.supervisor")),
)
TORCH_COMPAT = (
    "elastic_trainer.supervisor.torch_compat",
    "elastic_trainer.worker.torch_compat",
    "snapshots.sharded.torch_compat",
)
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


def _layer(module: str) -> tuple[str, tuple[str, ...]] | None:
    if any(_within(module, base) for base in BASE):
        return LAYERS[0]
    return next((layer for layer in LAYERS[1:] if _within(module, layer[0])), None)


def _breaks_layers(module: str, target: str) -> bool:
    layer = _layer(module)
    if layer is None or target.split(".")[0] not in PACKAGES or target == "elastic_trainer":
        return False  # the top imports anything; outside the project is not ours to order
    if target == "elastic_trainer.__version__":
        return False
    if target.rpartition(".")[0] == "elastic_trainer" and target not in MODULES:
        target = "elastic_trainer.PUBLIC"  # a name the package's __init__ exports
    name, below = layer
    own = name != "base" and _within(target, name)
    return not own and not any(_within(target, allowed) for allowed in below)


def test_imports_run_down_the_layers_never_up_or_sideways() -> None:
    assert _violations(_breaks_layers) == []


def _private_name_imports() -> list[str]:
    found = []
    for name, path in MODULES.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            private = [a.name for a in node.names if a.name.startswith("_")]
            private = [n for n in private if not n.startswith("__")]
            if node.module.split(".")[0] == "torch":
                allowed = name in TORCH_COMPAT
            else:
                allowed = node.module.rpartition(".")[0] == package or node.module == package
            if private and not allowed:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.module} {private}")
    return found


def test_private_names_stay_in_their_package() -> None:
    assert _private_name_imports() == []


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
    # the breaks this rule was written against
    assert _breaks_layers("elastic_trainer.contract.config", "elastic_trainer.tools.store_server")
    assert _breaks_layers("elastic_trainer.supervisor.warm.pool", "elastic_trainer.worker.x")
    assert _breaks_layers("elastic_trainer.worker.session", "elastic_trainer.supervisor.run")
    assert not _breaks_layers("elastic_trainer.tools.status", "elastic_trainer.supervisor.run")
    assert not _breaks_layers("elastic_trainer.entrypoints.warm_pool", "elastic_trainer.worker")
    assert not _breaks_layers("elastic_trainer.worker.session", "snapshots.store")
