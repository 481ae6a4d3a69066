"""The manifests against the code: every container that runs `layerserve` parses with the CLI's own parser and
builds its settings from its flags and LAYERSERVE_* variables as the server does; its ports, probes' routes,
repository mount, writable paths and grace period agree with those settings; the Services, the KServe runtime and
its InferenceServices agree with the containers; one image, tagged with the package's version, everywhere."""

from __future__ import annotations

import argparse
import contextlib
import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from layerserve import __version__
from layerserve.cli import build_parser
from layerserve.errors import LayerserveError
from layerserve.settings import ENV_PREFIX, Settings, load_settings
from layerserve.transports.http import metrics_routes, v2_routes
from tests.deploy.manifest_checks import Document, pod_specs

KSERVE_MODEL_DIR = PurePosixPath("/mnt/models")  # where KServe's storage initializer puts the storageUri
KSERVE_CONTAINER = "kserve-container"
PROMETHEUS_PORT = "prometheus.kserve.io/port"  # the runtime container KServe fills in
DEFAULT_GRACE_S = 30  # Kubernetes' terminationGracePeriodSeconds when a pod sets none
GRACE_MARGIN_S = 5  # past shutdown_timeout_s, for the runtime to close
HEALTH_PATHS = {
    "startupProbe": "/v2/health/live",
    "livenessProbe": "/v2/health/live",
    "readinessProbe": "/v2/health/ready",
}
GET_PATHS = {route.path for route in [*v2_routes.routes, *metrics_routes.routes] if "GET" in (route.methods or ())}


@dataclass(frozen=True)
class Served:
    """A container running `layerserve`, its pod and the settings it serves with."""

    where: str
    container: dict[str, Any]
    pod: dict[str, Any]
    settings: Settings


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*(pod.get("initContainers") or []), *(pod.get("containers") or [])]


def images(documents: list[Document]) -> set[str]:
    """Every container image the manifests name (init containers' too)."""
    return {c.get("image", "") for d in documents for _, pod in pod_specs(d) for c in _containers(pod)}


def image_problems(documents: list[Document]) -> list[str]:
    """One image everywhere, tagged with the package's version."""
    found = images(documents)
    if len(found) != 1:
        return [f"the manifests name {len(found)} images, expected one: {sorted(found)}"]
    image = found.pop()
    if image.rpartition(":")[2] != __version__:
        return [f"image {image} is not tagged with the package's version {__version__}"]
    return []


def serve_settings(container: dict[str, Any]) -> Settings:
    """The settings `layerserve` runs with in `container`: its arguments through the CLI's parser, its LAYERSERVE_*
    variables as the server reads them.

    Raises:
        LayerserveError: an unknown command, flag, variable or a bad value, named.
    """
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = build_parser().parse_args(container.get("args") or [])
    except SystemExit:
        raise LayerserveError(f"arguments {container.get('args')}: {stderr.getvalue().strip()}") from None
    environ = {e["name"]: str(e.get("value", "")) for e in container.get("env") or []}
    unknown = [name for name in environ if name.startswith(ENV_PREFIX) and name not in _variables()]
    if unknown:
        raise LayerserveError(f"{', '.join(unknown)}: no such setting")
    return load_settings(_flags(args), environ=environ)


def _variables() -> set[str]:
    return {f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields}


def _flags(args: argparse.Namespace) -> dict[str, Any]:
    flags = {name: getattr(args, name, None) for name in Settings.model_fields}
    flags["model_repository"] = getattr(args, "repository", None)
    return flags


def served(documents: list[Document]) -> tuple[list[Served], list[str]]:
    """Each container running `layerserve`, with its settings; the problems of those (init containers' too, e.g.
    an export ahead of the server) whose arguments or variables do not parse."""
    found, problems = [], []
    for document in documents:
        for where, pod in pod_specs(document):
            for container in _containers(pod):
                if (container.get("command") or [""])[0] != "layerserve":
                    continue
                try:
                    settings = serve_settings(container)
                except LayerserveError as error:
                    problems.append(f"{where} {container['name']}: {error.message}")
                    continue
                if container in (pod.get("containers") or []):
                    found.append(Served(f"{where} {container['name']}", container, pod, settings))
    return found, problems


def _port(container: dict[str, Any], port: int | str) -> int | str:
    named = {p.get("name"): p["containerPort"] for p in container.get("ports") or []}
    return named.get(port, port)


def probe_problems(served: Served, ports: dict[str, int]) -> Iterator[str]:
    """Probes on the health routes of the door they name."""
    for kind, path in HEALTH_PATHS.items():
        probe = served.container.get(kind) or {}
        if "httpGet" in probe:
            if probe["httpGet"].get("path") != path:
                yield f"{served.where}: {kind} on {probe['httpGet'].get('path')}, expected {path}"
            if _port(served.container, probe["httpGet"].get("port", ports["http"])) != ports["http"]:
                yield f"{served.where}: {kind} not on the HTTP port {ports['http']}"
        if "grpc" in probe and probe["grpc"].get("port") != ports["grpc"]:
            yield f"{served.where}: {kind} not on the gRPC port {ports['grpc']}"


def container_problems(served: Served) -> Iterator[str]:
    """Address, ports, probes, the repository's mount, writable paths and the grace period of one container."""
    settings, where = served.settings, served.where
    ports = {"http": settings.port, "grpc": settings.grpc_port}
    if settings.host != "0.0.0.0":
        yield f"{where}: host {settings.host}: unreachable from outside the pod (LAYERSERVE_HOST=0.0.0.0)"
    for port in served.container.get("ports") or []:
        expected = ports.get(port.get("name"), port["containerPort"])
        if port["containerPort"] not in ports.values() or port["containerPort"] != expected:
            yield f"{where}: containerPort {port.get('name')} {port['containerPort']} is not a door ({ports})"
    yield from probe_problems(served, ports)
    yield from mount_problems(served)
    stop = served.container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    grace = served.pod.get("terminationGracePeriodSeconds", DEFAULT_GRACE_S)
    if grace < stop + settings.shutdown_timeout_s + GRACE_MARGIN_S:
        yield (
            f"{where}: terminationGracePeriodSeconds {grace} < preStop {stop} s + shutdown_timeout_s "
            f"{settings.shutdown_timeout_s:g} + {GRACE_MARGIN_S} s"
        )


def mount_problems(served: Served) -> Iterator[str]:
    """The repository mounted read-only (KServe's at /mnt/models), the export cache and job records writable."""
    settings, mounts = served.settings, served.container.get("volumeMounts") or []
    repository = PurePosixPath(settings.model_repository)
    if served.container.get("name") == KSERVE_CONTAINER:
        if repository != KSERVE_MODEL_DIR:
            yield f"{served.where}: serves {repository}, KServe's storage initializer fills {KSERVE_MODEL_DIR}"
    elif not any(PurePosixPath(m["mountPath"]) == repository and m.get("readOnly") for m in mounts):
        yield f"{served.where}: the repository {repository} is not a read-only volume mount"
    writable = [PurePosixPath(m["mountPath"]) for m in mounts if not m.get("readOnly")]
    for name, path in (("engine_cache_dir", settings.engine_cache_dir), ("jobs_dir", settings.job_records_dir)):
        if not any(PurePosixPath(path).is_relative_to(mount) for mount in writable):
            yield f"{served.where}: {name} {path} is on no writable volume"


def service_problems(documents: list[Document], containers: list[Served]) -> Iterator[str]:
    """Each Service of a Deployment reaches its doors: ports named `http` and `grpc`, each on a named targetPort of
    the pod, `http` on the HTTP door and `grpc` on the gRPC door."""
    deployments = [d for d in documents if d.kind == "Deployment"]
    for service in (d for d in documents if d.kind == "Service"):
        selector = service.body["spec"].get("selector") or {}
        targets = [
            d for d in deployments if selector.items() <= d.body["spec"]["template"]["metadata"]["labels"].items()
        ]
        if not targets:
            continue  # a RayService's (kuberay_problems checks those)
        pods = [s for s in containers if s.pod is targets[0].body["spec"]["template"]["spec"]]
        if missing := {"http", "grpc"} - {port.get("name") for port in service.body["spec"]["ports"]}:
            yield f"{service}: no port named {' or '.join(sorted(missing))}"
        for port in service.body["spec"]["ports"]:
            reached = [s for s in pods if _port(s.container, port["targetPort"]) != port["targetPort"]]
            door = {"http": "port", "grpc": "grpc_port"}.get(port.get("name", ""))
            if not reached:
                yield f"{service}: targetPort {port['targetPort']!r} is no named port of {targets[0]}"
            elif door and _port(reached[0].container, port["targetPort"]) != getattr(reached[0].settings, door):
                yield f"{service}: port {port['name']} does not reach the {door} of {reached[0].where}"


def kserve_agreement_problems(documents: list[Document], containers: list[Served]) -> Iterator[str]:
    """The runtime serves KServe's model folder on its doors, says so in its protocols and formats, and every
    InferenceService asks for what it offers."""
    runtimes = {
        d.body["metadata"]["name"]: d for d in documents if d.kind in ("ClusterServingRuntime", "ServingRuntime")
    }
    for runtime in runtimes.values():
        spec = runtime.body["spec"]
        if {"v2", "grpc-v2"} - set(spec.get("protocolVersions") or []):
            yield f"{runtime}: protocolVersions {spec.get('protocolVersions')}, expected v2 and grpc-v2"
        if {"keras", "tensorflow"} - {f["name"] for f in spec.get("supportedModelFormats") or []}:
            yield f"{runtime}: supportedModelFormats lack keras or tensorflow"
        kserve = [s for s in containers if s.where.startswith(str(runtime)) and s.container["name"] == KSERVE_CONTAINER]
        if not kserve:
            yield f"{runtime}: no {KSERVE_CONTAINER} running layerserve"
            continue
        settings = kserve[0].settings
        annotations = spec.get("annotations") or {}
        if annotations.get(PROMETHEUS_PORT, str(settings.port)) != str(settings.port):
            yield f"{runtime}: metrics annotated on port {annotations[PROMETHEUS_PORT]}, not {settings.port}"
        if annotations.get("prometheus.kserve.io/path", "/metrics") not in GET_PATHS:
            yield f"{runtime}: metrics annotated on {annotations['prometheus.kserve.io/path']}, no such route"
    for service in (d for d in documents if d.kind == "InferenceService"):
        yield from _inference_service_problems(service, runtimes, containers)


def _inference_service_problems(
    service: Document, runtimes: dict[str, Document], containers: list[Served]
) -> Iterator[str]:
    model = service.body["spec"]["predictor"]["model"]
    runtime = runtimes.get(model.get("runtime", ""))
    if runtime is None:
        yield f"{service}: runtime {model.get('runtime')!r} is not in the manifests"
        return
    formats = runtime.body["spec"]["supportedModelFormats"]
    wanted = model.get("modelFormat") or {}
    if not any(f["name"] == wanted.get("name") and wanted.get("version") in (None, f.get("version")) for f in formats):
        yield f"{service}: modelFormat {wanted} is not one of {runtime}'s"
    protocol = model.get("protocolVersion", "v1")
    if protocol not in runtime.body["spec"]["protocolVersions"]:
        yield f"{service}: protocolVersion {protocol} is not one of {runtime}'s"
    kserve = next(s for s in containers if s.where.startswith(str(runtime)) and s.container["name"] == KSERVE_CONTAINER)
    ports = {"http": kserve.settings.port, "grpc": kserve.settings.grpc_port}
    for port in model.get("ports") or []:
        door = "grpc" if port.get("name") == "h2c" else "http"
        if port["containerPort"] != ports[door] or (door == "grpc") != (protocol == "grpc-v2"):
            yield f"{service}: port {port} is not the runtime's {door} door {ports[door]} for {protocol}"
    yield from probe_problems(Served(str(service), model, {}, kserve.settings), ports)


def agreement_problems(documents: list[Document]) -> list[str]:
    """Every disagreement between the manifests and the code."""
    containers, problems = served(documents)
    problems += image_problems(documents)
    for container in containers:
        problems += container_problems(container)
    problems += service_problems(documents, containers)
    problems += kserve_agreement_problems(documents, containers)
    return problems
