"""The manifests in deploy/ validate offline (core kinds against Kubernetes 1.37's schemas, KServe's kinds in the
kserve SDK's models, what layerserve reads of the RayService), agree with the code's ports, routes, settings, flags,
image and grace period, and every check fails on a broken copy."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from layerserve import __version__
from tests.deploy.agreement import agreement_problems, image_problems, images
from tests.deploy.manifest_checks import (
    KSERVE_KINDS,
    KSERVE_PYTHON,
    KUBERAY_KINDS,
    Document,
    kserve_problems,
    kuberay_problems,
    manifest_files,
    pod_specs,
    read_documents,
    schema_problems,
)

DOCUMENTS = read_documents(manifest_files())
IMAGE = f"localhost/layerserve:{__version__}"  # the one image the manifests name
EXPECTED = {
    "kubernetes/deployment.yaml": ["Deployment"],
    "kubernetes/service.yaml": ["Service"],
    "kubernetes/pvc.yaml": ["PersistentVolumeClaim"],
    "kserve/clusterservingruntime.yaml": ["ClusterServingRuntime"],
    "kserve/inferenceservice.yaml": ["InferenceService"],
    "kserve/inferenceservice-grpc.yaml": ["InferenceService"],
    "kuberay/rayservice.yaml": ["RayService", "Service"],
}


def test_deploy_holds_each_manifest() -> None:
    found: dict[str, list[str]] = {}
    for document in DOCUMENTS:
        found.setdefault(f"{document.path.parent.name}/{document.path.name}", []).append(document.kind)
    assert found == EXPECTED


@pytest.mark.parametrize("document", DOCUMENTS, ids=str)
def test_manifest_matches_the_kubernetes_schemas(document: Document) -> None:
    assert schema_problems(document) == []


def test_manifests_agree_with_the_code() -> None:
    assert agreement_problems(DOCUMENTS) == []
    assert images(DOCUMENTS) == {IMAGE}


@pytest.mark.slow
def test_rayservice_gives_layerserve_what_it_reads() -> None:
    assert kuberay_problems(DOCUMENTS) == []


@pytest.fixture(scope="module")
def kserve_sdk() -> Path:
    """The kserve SDK's venv (scripts/install --dev makes it)."""
    if not KSERVE_PYTHON.exists():
        if os.environ.get("CI") == "true":
            pytest.fail(f"{KSERVE_PYTHON} is missing: scripts/install --dev creates it")
        pytest.skip(f"{KSERVE_PYTHON} is missing (scripts/install --dev creates it)")
    return KSERVE_PYTHON


@pytest.mark.slow
def test_kserve_kinds_build_into_the_kserve_sdk_models(kserve_sdk: Path, tmp_path: Path) -> None:
    broken = _write(tmp_path, "kserve/clusterservingruntime.yaml", [
        ("spec.protocolVersion", ["v2"]),  # protocolVersions misspelt
        ("spec.supportedModelFormats.0.version", 3),  # a number, not a string
        ("spec.containers.0.readinessProbe.httpGet.pth", "/v2/health/ready"),
    ])  # fmt: skip
    broken_service = _write(tmp_path, "kserve/inferenceservice.yaml", [("spec.predictor.model.storageURI", "pvc://x")])
    files = manifest_files()
    checked, errors = kserve_problems([*files, broken, broken_service])
    assert len(checked) == sum(d.kind in KSERVE_KINDS for d in DOCUMENTS) + 2
    assert [e for e in errors if not e.startswith(str(tmp_path))] == []
    assert sorted(e.split(" ", 1)[0].rsplit(".", 1)[1] for e in errors) == [
        "protocolVersion:", "pth:", "storageURI:", "version:",
    ]  # fmt: skip


Edit = tuple[str, Any]
DELETE = object()


def _set(body: Any, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        body = body[int(part)] if isinstance(body, list) else body[part]
    if value is DELETE:
        del body[int(last) if isinstance(body, list) else last]
    else:
        body[int(last) if isinstance(body, list) else last] = value


def _broken(name: str, edits: list[Edit]) -> list[Document]:
    """A copy of every document, with `edits` (dotted path, value) made to the first document of file `name`."""
    documents = [Document(d.path, d.index, copy.deepcopy(d.body)) for d in DOCUMENTS]
    target = next(d for d in documents if f"{d.path.parent.name}/{d.path.name}" == name)
    for dotted, value in edits:
        _set(target.body, dotted, value)
    return documents


def _write(folder: Path, name: str, edits: list[Edit]) -> Path:
    documents = [d for d in _broken(name, edits) if f"{d.path.parent.name}/{d.path.name}" == name]
    path = folder / name.replace("/", "-")
    path.write_text(yaml.safe_dump_all([d.body for d in documents]), encoding="utf-8")
    return path


POD = "spec.template.spec"
CONTAINER = f"{POD}.containers.0"
RUNTIME = "spec.containers.0"
HEAD = "spec.rayClusterConfig.headGroupSpec.template.spec"
MODEL = "spec.predictor.model"
DEPLOYMENT, RUNTIME_FILE = "kubernetes/deployment.yaml", "kserve/clusterservingruntime.yaml"
HTTP_SERVICE, GRPC_SERVICE = "kserve/inferenceservice.yaml", "kserve/inferenceservice-grpc.yaml"
PROMETHEUS_PORT = "prometheus.kserve.io/port"


def _schema(documents: list[Document]) -> list[str]:
    return [problem for document in documents for problem in schema_problems(document)]


SCHEMA_BREAKS = {
    "'imagePullPolcy' was unexpected": (DEPLOYMENT, [(f"{CONTAINER}.imagePullPolcy", "Always")]),
    "'eight thousand' is not of type 'integer'": ("kubernetes/service.yaml", [("spec.ports.0.port", "eight thousand")]),
    "'ReadWriteMany' is not of type 'array'": ("kubernetes/pvc.yaml", [("spec.accessModes", "ReadWriteMany")]),
    "'mem' was unexpected": (RUNTIME_FILE, [(f"{RUNTIME}.mem", "2Gi")]),
    "mounts 'cache', no volume": (RUNTIME_FILE, [("spec.volumes", DELETE)]),
    "is not of type 'array'": ("kuberay/rayservice.yaml", [(f"{HEAD}.containers.0.ports", 8000)]),
    "mounts 'models', no volume": ("kuberay/rayservice.yaml", [(f"{HEAD}.volumes", DELETE)]),
}
AGREEMENT_BREAKS = {
    "no such setting": (DEPLOYMENT, [(f"{CONTAINER}.env.2.name", "LAYERSERVE_GRPC_PROT")]),
    "setting 'port'": (DEPLOYMENT, [(f"{CONTAINER}.env.1.value", "80x")]),
    "unrecognized arguments": (DEPLOYMENT, [(f"{CONTAINER}.args", ["serve", "/models", "--wrkers"])]),
    "invalid choice": (DEPLOYMENT, [(f"{CONTAINER}.args", ["serv", "/models"])]),
    "unreachable": (DEPLOYMENT, [(f"{CONTAINER}.env.0.value", "127.0.0.1")]),
    "expected /v2/health/ready": (DEPLOYMENT, [(f"{CONTAINER}.readinessProbe.httpGet.path", "/v2/ready")]),
    "not on the HTTP port": (DEPLOYMENT, [(f"{CONTAINER}.livenessProbe.httpGet.port", "grpc")]),
    "is not a door": (DEPLOYMENT, [(f"{CONTAINER}.ports.1.containerPort", 8002)]),
    "terminationGracePeriodSeconds": (DEPLOYMENT, [(f"{POD}.terminationGracePeriodSeconds", 30)]),
    "not a read-only volume mount": (DEPLOYMENT, [(f"{CONTAINER}.volumeMounts.0.readOnly", False)]),
    "engine_cache_dir": (DEPLOYMENT, [(f"{CONTAINER}.env.4.value", "/models/.onnx")]),
    "expected one": (DEPLOYMENT, [(f"{CONTAINER}.image", "localhost/layerserve:0.0.9")]),
    "invalid choice: 'exprt'": (DEPLOYMENT, [(f"{POD}.initContainers", [
        {"name": "export", "image": IMAGE, "command": ["layerserve"], "args": ["exprt", "/models"]},
    ])]),
    "no named port": ("kubernetes/service.yaml", [("spec.ports.1.targetPort", "grpcc")]),
    "no port named grpc": ("kubernetes/service.yaml", [("spec.ports.1.name", "h2c")]),
    "KServe's storage initializer": (RUNTIME_FILE, [(f"{RUNTIME}.args", ["serve", "/models"])]),
    "metrics annotated": (RUNTIME_FILE, [("spec.annotations", {PROMETHEUS_PORT: "80"})]),
    "protocolVersions": (RUNTIME_FILE, [("spec.protocolVersions", ["v2"])]),
    "not the runtime's grpc door": (GRPC_SERVICE, [(f"{MODEL}.ports.0.containerPort", 8001)]),
    "not on the gRPC port": (GRPC_SERVICE, [(f"{MODEL}.readinessProbe.grpc.port", 8080)]),
    "is not in the manifests": (HTTP_SERVICE, [(f"{MODEL}.runtime", "layerserv")]),
    "modelFormat": (HTTP_SERVICE, [(f"{MODEL}.modelFormat.name", "onnx")]),
}  # fmt: skip


@pytest.mark.parametrize(("expected", "check", "name", "edits"), [
    *((expected, _schema, name, edits) for expected, (name, edits) in SCHEMA_BREAKS.items()),
    *((expected, agreement_problems, name, edits) for expected, (name, edits) in AGREEMENT_BREAKS.items()),
], ids=[*SCHEMA_BREAKS, *AGREEMENT_BREAKS])  # fmt: skip
def test_checks_fail_on_a_broken_copy(
    expected: str, check: Callable[[list[Document]], list[str]], name: str, edits: list[Edit]
) -> None:
    problems = check(_broken(name, edits))
    assert problems, f"no problem found in {name} after {edits}"
    assert any(expected in problem for problem in problems), problems


def test_image_check_fails_on_a_tag_other_than_the_package_version() -> None:
    documents = _broken("kubernetes/deployment.yaml", [])
    for document in documents:
        for _, pod in pod_specs(document):
            for container in pod["containers"]:
                container["image"] = "localhost/layerserve:latest"
    assert image_problems(documents) == [
        f"image localhost/layerserve:latest is not tagged with the package's version {__version__}"
    ]


@pytest.mark.slow
@pytest.mark.parametrize(("expected", "edit"), [
    ("'replicas'", lambda config: config.replace("replicas: 4", "replicas: four")),
    ("unknown key", lambda config: config.replace("replica_cpus", "replica_cpu")),
    ("grpc_ingress.add_servicer", lambda config: config.replace("add_servicer_to_server", "add_servicers")),
    ("not layerserve's builder", lambda config: config.replace("app:build", "deployment:build_app")),
])  # fmt: skip
def test_rayservice_check_fails_on_a_broken_copy(expected: str, edit: Callable[[str], str]) -> None:
    documents = _broken("kuberay/rayservice.yaml", [])
    ray_service = next(d for d in documents if d.kind in KUBERAY_KINDS)
    ray_service.body["spec"]["serveConfigV2"] = edit(ray_service.body["spec"]["serveConfigV2"])
    problems = kuberay_problems(documents)
    assert any(expected in problem for problem in problems), problems


@pytest.mark.slow
def test_rayservice_check_fails_without_the_repository_or_the_direct_port() -> None:
    documents = _broken("kuberay/rayservice.yaml", [
        (f"{HEAD}.containers.0.volumeMounts", []),
        ("spec.rayClusterConfig.workerGroupSpecs.0.template.spec.containers.0.ports.0.containerPort", 8081),
    ])  # fmt: skip
    problems = kuberay_problems(documents)
    assert any("does not mount /models" in problem for problem in problems), problems
    assert any("no containerPort 8080" in problem for problem in problems), problems
