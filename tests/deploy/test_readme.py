"""What docs/deploying.md and README.md's "How it compares" claim, checked against the files
and against torch where a claim can be checked.

Not checked here: that torch's agent does not count new nodes waiting against
``--max-restarts``; that lives in ``SimpleElasticAgent._invoke_run`` (torch 2.15,
``agent/server/api.py``) and only its private hooks could drive it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
DEPLOYING = (ROOT / "docs" / "deploying.md").read_text()
DEPLOY = ROOT / "deploy"


def section(title: str) -> str:
    """docs/deploying.md's text under a heading that starts with ``title``, up to the next one."""
    match = re.search(rf"^#+ {re.escape(title)}.*?\n(.*?)(?=^#+ )", DEPLOYING, re.S | re.M)
    assert match, f"docs/deploying.md has no section {title!r}"
    return match[1]


def test_the_slurm_knobs_the_readme_lists_are_the_scripts() -> None:
    text = section("Slurm")
    script = (DEPLOY / "slurm" / "elastic-train.sbatch").read_text()
    listed = text.split("Knobs are environment variables:")[1].split("\n\n")[0]
    knobs = set(re.findall(r"`([A-Z_]+)`", listed))
    assert knobs >= {"SNAPSHOT_DIR", "NPROC_PER_NODE", "STORE_HOST"}
    for knob in knobs:
        assert re.search(rf"^#   {knob}\s", script, re.M), f"{knob}: not a knob of the script"
        assert f"${{{knob}:-" in script, f"{knob}: the script does not read it"
    readme_default = re.search(r"`SNAPSHOT_DIR` \(default `([^`]+)`", text)[1]
    assert f"(default: {readme_default};" in script  # the script's knob comment
    for directive in re.findall(r"`(##SBATCH [^`]+)`", text):
        assert re.search(rf"^{re.escape(directive)}$", script, re.M), directive


def test_the_systemd_commands_name_the_shipped_units() -> None:
    text = section("VMs with systemd")
    units = {p.name for p in (DEPLOY / "systemd").glob("*.service")}
    commands = re.findall(r"(?:systemctl enable --now|journalctl -u) ([\w@-]+)", text)
    assert commands
    for instance in commands:
        assert re.sub(r"@\w+$", "@", instance) + ".service" in units, instance
    for name in re.findall(r"`([\w@.-]+\.service)`", text):
        assert name in units, name


def test_the_install_options_the_readme_lists_exist_with_those_defaults() -> None:
    text = section("VMs with systemd")
    install = (DEPLOY / "systemd" / "install.sh").read_text()
    assert "deploy/systemd/install.sh" in text
    for option in re.findall(r"`(--[a-z-]+)(?: [A-Z]+)?`", text):
        assert re.search(rf"^#   {option} ", install, re.M), f"{option}: not an install.sh option"
    assert "default `/opt/elastic-train`" in text and "prefix=/opt/elastic-train\n" in install
    default_package = re.search(r'^package="([^"]+)"$', install, re.M)[1]
    assert f"default `{default_package}`" in text


def test_the_container_pins_the_readme_states_are_the_dockerfiles() -> None:
    text = section("Container")
    dockerfile = (DEPLOY / "container" / "Dockerfile").read_text()
    torch_pin, vision_pin = re.search(r"VERSION` \(default ([\d.]+) / ([\d.]+)", text).groups()
    assert f"ARG TORCH_VERSION={torch_pin}\n" in dockerfile
    assert f"ARG TORCHVISION_VERSION={vision_pin}\n" in dockerfile
    readme_index = set(re.findall(r"download\.pytorch\.org/whl/(cu\d+)", text))
    assert readme_index == set(re.findall(r"download\.pytorch\.org/whl/(cu\d+)", dockerfile))


def test_the_worker_resources_the_readme_states_are_the_manifests() -> None:
    yaml = pytest.importorskip("yaml")
    text = section("Kubernetes")
    cpu = re.search(r'`limits: \{cpu: "(\d+)"\}` \(so (\d+) workers', text)
    assert cpu and cpu[1] == cpu[2]
    for name in ("workers.yaml", "pytorchjob.yaml"):
        manifest = (DEPLOY / "kubernetes" / name).read_text()
        (doc,) = [d for d in yaml.safe_load_all(manifest) if d["kind"] in ("Job", "PyTorchJob")]
        if doc["kind"] == "PyTorchJob":
            worker = doc["spec"]["pytorchReplicaSpecs"]["Worker"]
            assert f"`restartPolicy: {worker['restartPolicy']}`" in text
        else:
            worker = doc["spec"]
        (container,) = worker["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["cpu"] == cpu[1], name
        assert "--local-addr=$(POD_IP)" in container["args"] and "--local-addr=$(POD_IP)" in text


def test_torchruns_shutdown_timeout_is_what_the_comparison_says() -> None:
    """torchrun has --shutdown-timeout (default 30 s, or TORCH_ELASTIC_SHUTDOWN_TIMEOUT)."""
    pytest.importorskip("torch")
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig
    from torch.distributed.run import get_args_parser

    def launch_config() -> LaunchConfig:  # its default logs make a folder in /tmp: none here
        logs = DefaultLogsSpecs(log_dir=os.devnull)
        return LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, logs_specs=logs)

    row = next(line for line in README.splitlines() if line.startswith("| preemption (SIGTERM)"))
    assert "`--shutdown-timeout` (default 30 s, or `TORCH_ELASTIC_SHUTDOWN_TIMEOUT`)" in row
    args = get_args_parser().parse_args(["--shutdown-timeout", "7", "train.py"])
    assert args.shutdown_timeout == 7
    with pytest.MonkeyPatch.context() as env:
        env.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
        assert launch_config().shutdown_timeout == 30
        env.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "45")
        assert launch_config().shutdown_timeout == 45


def test_the_comparison_no_longer_says_torchrun_counts_membership_changes() -> None:
    row = next(line for line in README.splitlines() if line.startswith("| restart budget"))
    torchrun = row.split("|")[2]
    assert "membership included" not in torchrun
    assert "new nodes waiting to join do not" in torchrun
