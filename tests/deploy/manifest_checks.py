"""The checks of the manifests in deploy/: each returns the problems it finds (none: an empty list), so that the
tests run it on the manifests and on broken copies of them.

- `schema_problems`: core kinds against Kubernetes 1.37's OpenAPI schemas (kubernetes-validate, strict, offline),
  and the pod templates inside custom resources as `PodTemplate`s;
- `kserve_problems`: KServe's kinds built strictly into the kserve SDK's models, in the SDK's own venv;
- `kuberay_problems`: no schema of RayService ships in a package, so the fields layerserve reads;
- `agreement_problems` (tests/deploy/agreement.py): ports, paths, settings, flags, image and grace period against
  the code's.
"""

from __future__ import annotations

import importlib
import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

from layerserve.errors import LayerserveError

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERNETES_VERSION = "1.37"
KSERVE_PYTHON = ROOT / ".venv-kserve" / "bin" / "python"
KSERVE_CHECK = Path(__file__).with_name("kserve_models.py")
KSERVE_KINDS = {"ClusterServingRuntime", "ServingRuntime", "InferenceService"}
KUBERAY_KINDS = {"RayService"}


@dataclass(frozen=True)
class Document:
    """One YAML document of a manifest file."""

    path: Path
    index: int
    body: dict[str, Any]

    @property
    def kind(self) -> str:
        """The document's `kind`."""
        return str(self.body.get("kind"))

    def __str__(self) -> str:
        return f"{self.path.parent.name}/{self.path.name}#{self.index} {self.kind}"


def manifest_files(folder: Path = DEPLOY) -> list[Path]:
    """Every manifest under `folder`."""
    return sorted(folder.rglob("*.yaml"))


def read_documents(paths: list[Path]) -> list[Document]:
    """The documents of the files at `paths`, in order."""
    documents = []
    for path in paths:
        for index, body in enumerate(yaml.safe_load_all(path.read_text(encoding="utf-8"))):
            if body is not None:
                documents.append(Document(path, index, body))
    return documents


def pod_specs(document: Document) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, pod spec) of each pod the document makes: a Deployment's template, a serving runtime's containers
    and volumes, a RayService's head and worker templates."""
    spec = document.body.get("spec") or {}
    if document.kind == "Deployment":
        yield f"{document}", spec["template"]["spec"]
    elif document.kind in ("ClusterServingRuntime", "ServingRuntime"):
        yield f"{document}", {key: spec[key] for key in ("containers", "volumes") if key in spec}
    elif document.kind == "RayService":
        cluster = spec.get("rayClusterConfig") or {}
        head = (cluster.get("headGroupSpec") or {}).get("template") or {}
        yield f"{document} head", head.get("spec") or {}
        for group in cluster.get("workerGroupSpecs") or []:
            yield f"{document} {group.get('groupName')}", (group.get("template") or {}).get("spec") or {}


def _validate(body: dict[str, Any]) -> str | None:
    try:
        kubernetes_validate.validate(body, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        return f"{'.'.join(str(part) for part in error.absolute_path)}: {error.message}"
    return None


def schema_problems(document: Document) -> list[str]:
    """A core kind against its schema; a custom resource's pod specs as PodTemplates (their containers, volumes,
    probes and security contexts are core types)."""
    problems = []
    if document.kind not in KSERVE_KINDS | KUBERAY_KINDS:
        try:
            problem = _validate(document.body)
        except kubernetes_validate.SchemaNotFoundError:
            problem = f"no Kubernetes {KUBERNETES_VERSION} schema of {document.body.get('apiVersion')} {document.kind}"
        if problem:
            problems.append(f"{document}: {problem}")
    for where, spec in pod_specs(document):
        if document.kind in KSERVE_KINDS | KUBERAY_KINDS:
            template = {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": "t"},
                "template": {"spec": spec},
            }
            if problem := _validate(template):
                problems.append(f"{where}: {problem}")
        volumes = {volume.get("name") for volume in spec.get("volumes") or []}
        for container in spec.get("containers") or []:
            for mount in container.get("volumeMounts") or []:
                if mount.get("name") not in volumes:
                    problems.append(
                        f"{where}: container {container.get('name')} mounts {mount.get('name')!r}, no volume"
                    )
    return problems


def kserve_problems(paths: list[Path]) -> tuple[list[str], list[str]]:
    """(documents checked, problems): the KServe documents of `paths` built by tests/deploy/kserve_models.py in the
    kserve SDK's venv."""
    command = [str(KSERVE_PYTHON), str(KSERVE_CHECK), *map(str, paths)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    if result.returncode != 0:
        return [], [f"{KSERVE_CHECK.name} failed ({result.returncode}): {result.stderr[-2000:]}"]
    report = json.loads(result.stdout)
    return report["checked"], report["errors"]


def resolve(import_path: str) -> object:
    """The object named `module:attribute` or `module.attribute` (Ray Serve's import paths).

    Raises:
        ImportError, AttributeError: it does not exist.
    """
    module, separator, attribute = import_path.partition(":")
    if not separator:
        module, _, attribute = import_path.rpartition(".")
    return getattr(importlib.import_module(module), attribute)


def kuberay_problems(documents: list[Document]) -> list[str]:
    """What layerserve reads of each RayService: the Serve config's import paths and arguments (built with the
    application builder itself), the proxy middleware, the repository's mount, the direct port and its Service."""
    from layerserve.transports.ray.app import build

    problems = []
    for document in (d for d in documents if d.kind in KUBERAY_KINDS):
        if document.body.get("apiVersion") != "ray.io/v1":
            problems.append(f"{document}: apiVersion {document.body.get('apiVersion')}, expected ray.io/v1")
        config = yaml.safe_load(document.body["spec"]["serveConfigV2"])
        for application in config["applications"]:
            if application.get("import_path") != "layerserve.transports.ray.app:build":
                problems.append(
                    f"{document}: import_path {application.get('import_path')!r} is not layerserve's builder"
                )
            try:
                build(application.get("args") or {})
            except (LayerserveError, ImportError, AttributeError) as error:
                problems.append(f"{document}: application {application.get('name')}: {error}")
        for function in (config.get("grpc_options") or {}).get("grpc_servicer_functions") or []:
            problems += _import_problems(document, function)
        problems += _pod_problems(document, config, documents)
    return problems


def _import_problems(document: Document, import_path: str) -> list[str]:
    try:
        resolve(import_path)
    except (ImportError, AttributeError) as error:
        return [f"{document}: {import_path}: {error}"]
    return []


def _pod_problems(document: Document, config: dict[str, Any], documents: list[Document]) -> list[str]:
    problems = []
    args = config["applications"][0].get("args") or {}
    direct_port = args.get("direct_port")
    workers = {g.get("groupName"): g for g in document.body["spec"]["rayClusterConfig"].get("workerGroupSpecs", [])}
    for where, spec in pod_specs(document):
        for container in spec.get("containers") or []:
            for env in container.get("env") or []:
                if env.get("name") == "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH":
                    problems += _import_problems(document, env.get("value", ""))
            if args.get("model_repository") not in {m.get("mountPath") for m in container.get("volumeMounts") or []}:
                problems.append(f"{where}: {container.get('name')} does not mount {args.get('model_repository')}")
            ports = {p.get("containerPort") for p in container.get("ports") or []}
            if direct_port and where.endswith(tuple(workers)) and direct_port not in ports:
                problems.append(f"{where}: {container.get('name')} has no containerPort {direct_port} (direct_port)")
    for service in (d for d in documents if d.kind == "Service" and "ray.io/group" in d.body["spec"]["selector"]):
        group = workers.get(service.body["spec"]["selector"]["ray.io/group"])
        if group is None:
            problems.append(f"{service}: selects ray.io/group {service.body['spec']['selector']['ray.io/group']}, none")
            continue
        names = {p.get("name") for c in group["template"]["spec"]["containers"] for p in c.get("ports") or []}
        problems += [
            f"{service}: targetPort {p['targetPort']!r} is no port of group {group['groupName']}"
            for p in service.body["spec"]["ports"]
            if p.get("targetPort") not in names
        ]
    return problems
