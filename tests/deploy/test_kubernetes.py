"""deploy/kubernetes/*.yaml, validated offline.

Core resources are checked against the Kubernetes OpenAPI schemas bundled in the
``kubernetes-validate`` package (strict: unknown fields are errors), for the oldest
Kubernetes the manifests support and the newest the package knows. The PyTorchJob is checked
against the training operator's own API models from the ``kubeflow-training`` SDK: every
key must be a field of the model (recursively, down into the pod template's core types) and
required fields must be present. Then our own rules: grace periods, the store's exposure,
credentials only from Secrets.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="pip install kubernetes-validate"
)

ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = ROOT / "deploy" / "kubernetes"
OLDEST_SUPPORTED = "1.29.0"  # podFailurePolicy with DisruptionTarget is on by default here
SUPERVISOR_GRACE_S = 25  # elastic-train's default --grace-period
STORE_PORT = 29400


def documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def core_documents() -> list[tuple[str, dict[str, Any]]]:
    return [(f, d) for f, d in documents() if not d["apiVersion"].startswith("kubeflow.org/")]


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [d for _, d in documents() if d["kind"] == kind]


def worker_templates() -> list[dict[str, Any]]:
    """The pod templates of the training workers (plain Job, PyTorchJob replicas)."""
    templates = [d["spec"]["template"] for d in by_kind("Job")]
    for job in by_kind("PyTorchJob"):
        templates += [r["template"] for r in job["spec"]["pytorchReplicaSpecs"].values()]
    return templates


def pod_specs() -> list[dict[str, Any]]:
    """Every pod spec in the manifests: the store's and the workers'."""
    store = [d["spec"]["template"]["spec"] for d in by_kind("Deployment")]
    return store + [t["spec"] for t in worker_templates()]


def test_the_expected_manifests_exist() -> None:
    kinds = sorted(d["kind"] for _, d in documents())
    store = ["Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"]
    assert kinds == sorted([*store, "Job", "Secret", "PyTorchJob"])


# --- schemas ---------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [OLDEST_SUPPORTED, kubernetes_validate.latest_version()])
@pytest.mark.parametrize(
    "doc", [d for _, d in core_documents()], ids=[f"{f}:{d['kind']}" for f, d in core_documents()]
)
def test_core_manifest_matches_the_kubernetes_schema(doc: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(doc, version, strict=True)


def test_the_schema_check_rejects_a_misspelt_field() -> None:
    job = copy.deepcopy(by_kind("Job")[0])
    job["spec"]["template"]["spec"]["terminationGracePeriod"] = 60
    with pytest.raises(kubernetes_validate.ValidationError, match="terminationGracePeriod"):
        kubernetes_validate.validate(job, OLDEST_SUPPORTED, strict=True)


# --- the PyTorchJob against the operator's models --------------------------------------------


def _model_class(type_name: str) -> type | None:
    from kubeflow.training import models as kf_models
    from kubernetes.client import models as k8s_models

    for module in (kf_models, k8s_models):
        if hasattr(module, type_name):
            return getattr(module, type_name)
    return None


_LIST = re.compile(r"list\[(.+)\]$")
_DICT = re.compile(r"dict\(str, (.+)\)$")


def check_model(data: Any, type_name: str, path: str = "") -> list[str]:
    """Problems with ``data`` as an instance of the OpenAPI model ``type_name``."""
    if m := _LIST.match(type_name):
        if not isinstance(data, list):
            return [f"{path}: expected a list"]
        return [p for i, item in enumerate(data) for p in check_model(item, m[1], f"{path}[{i}]")]
    if m := _DICT.match(type_name):
        if not isinstance(data, dict):
            return [f"{path}: expected a mapping"]
        return [p for k, v in data.items() for p in check_model(v, m[1], f"{path}.{k}")]
    scalars = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object}
    if type_name in scalars:
        ok = isinstance(data, scalars[type_name]) and not (
            type_name == "int" and isinstance(data, bool)
        )
        return [] if ok else [f"{path}: expected {type_name}, got {data!r}"]
    cls = _model_class(type_name)
    if cls is None:
        return [f"{path}: unknown model {type_name}"]
    if not isinstance(data, dict):
        return [f"{path}: expected a {type_name} mapping"]
    return _check_fields(data, cls, path)


def _check_fields(data: dict[str, Any], cls: type, path: str) -> list[str]:
    json_to_attr = {json: attr for attr, json in cls.attribute_map.items()}
    problems = [
        f"{path}.{key}: not a field of {cls.__name__}" for key in data if key not in json_to_attr
    ]
    for key, value in data.items():
        if key in json_to_attr:
            problems += check_model(value, cls.openapi_types[json_to_attr[key]], f"{path}.{key}")
    try:  # the generated constructors reject missing required fields
        cls(**{json_to_attr[k]: v for k, v in data.items() if k in json_to_attr})
    except ValueError as exc:
        problems.append(f"{path}: {exc}")
    return problems


def test_pytorchjob_matches_the_operator_models() -> None:
    pytest.importorskip("kubeflow.training", reason="pip install kubeflow-training")
    (job,) = by_kind("PyTorchJob")
    assert job["apiVersion"] == "kubeflow.org/v1"
    assert check_model(job, "KubeflowOrgV1PyTorchJob") == []


def test_the_model_check_rejects_a_misspelt_field() -> None:
    pytest.importorskip("kubeflow.training", reason="pip install kubeflow-training")
    job = copy.deepcopy(by_kind("PyTorchJob")[0])
    job["spec"]["elasticPolicy"]["minReplica"] = 1
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    worker["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    del worker["template"]["spec"]["containers"][0]["name"]
    problems = check_model(job, "KubeflowOrgV1PyTorchJob")
    assert any("elasticPolicy.minReplica: not a field" in p for p in problems)
    assert any("imagePullPolicyy: not a field" in p for p in problems)
    assert any("`name`, must not be `None`" in p for p in problems)


def test_pytorchjob_follows_the_operator_rules() -> None:
    (job,) = by_kind("PyTorchJob")
    policy = job["spec"]["elasticPolicy"]
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert set(replicas) == {"Worker"}  # elastic jobs have no Master
    assert policy["rdzvBackend"] == "c10d"
    assert 1 <= policy["minReplicas"] <= replicas["Worker"]["replicas"] <= policy["maxReplicas"]
    # Rendezvous through the standalone store, not worker 0.
    service = by_kind("Service")[0]
    assert policy["rdzvHost"] == service["metadata"]["name"]
    assert policy["rdzvPort"] == STORE_PORT
    assert {"key": "is_host", "value": "false"} in policy["rdzvConf"]
    containers = replicas["Worker"]["template"]["spec"]["containers"]
    assert "pytorch" in [c["name"] for c in containers]  # the operator's default container


# --- our own rules ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "template", worker_templates(), ids=lambda t: t["spec"]["containers"][0]["name"]
)
def test_workers_get_more_time_to_stop_than_the_supervisor_needs(
    template: dict[str, Any],
) -> None:
    assert template["spec"]["terminationGracePeriodSeconds"] > SUPERVISOR_GRACE_S


def _containers() -> list[dict[str, Any]]:
    return [c for spec in pod_specs() for c in spec["containers"]]


def test_credentials_come_only_from_secrets() -> None:
    secret_names = {d["metadata"]["name"] for d in by_kind("Secret")}
    for container in _containers():
        for var in container.get("env", []):
            if re.search(r"KEY|SECRET|TOKEN|PASSWORD|CREDENTIAL", var["name"]):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                assert ref and ref["name"] in secret_names, var["name"]


def test_store_is_private_and_bound_to_its_pod_ip() -> None:
    (service,) = by_kind("Service")
    assert service["spec"]["type"] == "ClusterIP"
    (store,) = [c for c in _containers() if c["name"] == "store"]
    args = store["args"]
    assert args[0] == "store" and args[args.index("--host") + 1] == "$(POD_IP)"
    (policy,) = by_kind("NetworkPolicy")
    admitted = policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    for template in worker_templates():
        labels = template["metadata"]["labels"]
        assert admitted.items() <= labels.items(), "workers must be admitted by the NetworkPolicy"


def test_plain_workers_join_the_store_as_clients() -> None:
    (job,) = by_kind("Job")
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    service = by_kind("Service")[0]["metadata"]["name"]
    assert f"--rdzv-endpoint={service}:{STORE_PORT}" in args
    assert "--rdzv-conf=is_host=false" in args
    rules = job["spec"]["podFailurePolicy"]["rules"]
    actions = {r["action"]: r.get("onExitCodes", {}).get("values") for r in rules}
    assert actions["FailJob"] == [2]  # config errors: retrying cannot help
    assert [143] in [r["onExitCodes"]["values"] for r in rules if "onExitCodes" in r]


# --- workers: allocation, addresses, exit codes ----------------------------------------------


def _worker_containers() -> list[dict[str, Any]]:
    return [t["spec"]["containers"][0] for t in worker_templates()]


def _cpus(quantity: str) -> float:
    """A Kubernetes CPU quantity ("2", "1500m", 0.5) in CPUs."""
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def _flag(args: list[str], name: str) -> str | None:
    return next((a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")), None)


@pytest.mark.parametrize("container", _worker_containers(), ids=lambda c: c["name"])
def test_auto_workers_follow_the_pods_cpu_limit(container: dict[str, Any]) -> None:
    """`auto` counts the cgroup quota, which only a CPU *limit* sets: without one it would
    count every CPU of the node (one worker each, out of memory)."""
    nproc = _flag(container["args"], "--nproc-per-node")
    limits = container["resources"].get("limits", {})
    if nproc == "auto" and "nvidia.com/gpu" not in limits:
        assert "cpu" in limits, "set resources.limits.cpu: it is what --nproc-per-node=auto counts"
        assert _cpus(limits["cpu"]) >= 1
        assert container["resources"]["requests"]["cpu"] == limits["cpu"]
    else:
        assert nproc and nproc.isdigit(), "give --nproc-per-node a number or auto"


@pytest.mark.parametrize("container", _worker_containers(), ids=lambda c: c["name"])
def test_workers_advertise_their_pod_ip(container: dict[str, Any]) -> None:
    """Peers connect to each other's address for the rendezvous and MASTER_ADDR: a pod IP
    always routes, while a non-indexed pod's name has no DNS record."""
    assert _flag(container["args"], "--local-addr") == "$(POD_IP)"
    env = {v["name"]: v for v in container["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_plain_job_fails_only_on_configuration_errors() -> None:
    (job,) = by_kind("Job")
    rules = job["spec"]["podFailurePolicy"]["rules"]
    fail = [r for r in rules if r["action"] == "FailJob"]
    assert [r["onExitCodes"] for r in fail] == [
        {"containerName": "trainer", "operator": "In", "values": [2]}
    ]


def operator_restarts(exit_code: int) -> bool:
    """The training operator's ExitCode policy (kubeflow.org/v1 RestartPolicyExitCode):
    1-127 are permanent and fail the job, 128-255 recreate the pod."""
    return exit_code >= 128


def test_pytorchjob_restarts_by_our_exit_codes() -> None:
    (job,) = by_kind("PyTorchJob")
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["restartPolicy"] == "ExitCode"  # OnFailure would retry configuration errors
    assert operator_restarts(143)  # preempted after its final snapshot: resumable
    assert not operator_restarts(2)  # configuration
