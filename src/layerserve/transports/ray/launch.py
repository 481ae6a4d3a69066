"""launch: `layerserve ray serve`: connect to (or start) Ray, deploy the application, wait until it is ready."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import httpx

from layerserve.errors import ConfigError, NotReadyError
from layerserve.settings import Settings
from layerserve.transports.ray.deployment import DEPLOYMENT_NAME, RayOptions, build_app
from layerserve.transports.ray.grpc_ingress import SERVICER_FUNCTION
from layerserve.transports.ray.retry import PROXY_CALLBACK, PROXY_CALLBACK_VARIABLE
from layerserve.transports.tls import check_tls, door_tls

log = logging.getLogger(__name__)

WORKER_NICENESS_VARIABLE = "RAY_worker_niceness"
# The proxies inherit the Serve controller's environment, so they install RetryLostReplica (and NameModel) whatever
# the environment of `ray start` on each node was.
_PROXY_ENVIRONMENT = {"runtime_env": {"env_vars": {PROXY_CALLBACK_VARIABLE: PROXY_CALLBACK}}}


def wait_ready(url: str, timeout_s: float) -> None:
    """Wait until every replica of the application has started (each loads every model before it does), then
    until `url`/v2/health/ready answers 200.

    Raises:
        NotReadyError: not ready within `timeout_s`.
    """
    from ray import serve

    deadline, last = time.monotonic() + timeout_s, "no answer"
    while time.monotonic() < deadline:
        application = serve.status().applications.get(DEPLOYMENT_NAME)
        last = f"application {application.status if application else 'not deployed'}"
        if application is not None and application.status == "RUNNING":
            break
        if application is not None and application.status == "DEPLOY_FAILED":
            raise NotReadyError(f"the Ray Serve application failed to deploy: {application.message}")
        time.sleep(0.5)
    while time.monotonic() < deadline:
        try:  # its own proxy, on this machine: whatever name the certificate is for, no verification
            response = httpx.get(f"{url}/v2/health/ready", timeout=5, verify=False)
            if response.status_code == 200:
                return
            last = f"{response.status_code} {response.text[:200]}"
        except httpx.HTTPError as error:
            last = repr(error)
        time.sleep(0.5)
    raise NotReadyError(f"the Ray Serve application was not ready within {timeout_s:.0f} s: {last}")


def _check_placement(options: RayOptions, is_local: bool) -> None:
    """Refuse replicas that the Ray started here cannot place; on a cluster (whose autoscaler may add nodes),
    say so and deploy.

    Raises:
        ConfigError: a local Ray has too few resources for the replicas asked for.
    """
    import ray

    nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]  # type: ignore[no-untyped-call]
    shortfall = options.shortfall(nodes)
    if shortfall is None:
        return
    advice = "ask for fewer replicas or less of each (--replicas, --replica-cpus, a group's :CPUS)"
    if is_local:
        raise ConfigError(f"{shortfall}: {advice}")
    log.warning("%s: the replicas wait until the cluster has the resources (or %s)", shortfall, advice)


def proxy_tls(settings: Settings) -> dict[str, str]:
    """Ray Serve's HTTP options for the TLS settings (checked now); none without TLS.

    Raises:
        ConfigError: TLS that Ray Serve's proxies cannot give: mutual TLS (its HTTP proxy asks no client
            certificate), TLS 1.3 only, or gRPC (its gRPC proxy speaks no TLS); or a TLS file that is wrong.
    """
    files = door_tls(settings, "http")
    if files is None:
        return {}
    where = "the direct port (--direct-port) and `layerserve serve` do"
    if files.client_ca is not None:
        raise ConfigError(f"Ray Serve's HTTP proxy does not require client certificates: no mutual TLS there; {where}")
    if files.min_version != "1.2":
        raise ConfigError(f"Ray Serve's HTTP proxy cannot be limited to TLS {files.min_version}; {where}")
    if settings.grpc_port:
        raise ConfigError(
            f"Ray Serve's gRPC proxy speaks no TLS: with TLS settings give --grpc-port 0 (gRPC off), or serve gRPC "
            f"with `layerserve serve` (TLS on {settings.tls_cert_file})"
        )
    check_tls(settings)
    password = {"ssl_keyfile_password": files.password} if files.password else {}
    return {"ssl_certfile": str(files.cert), "ssl_keyfile": str(files.key), **password}


def launch(settings: Settings, options: RayOptions, address: str, http_port: int, ready_timeout_s: float) -> int:
    """Deploy `settings.model_repository` on Ray Serve (see build_app) and wait until every model is ready.

    With `address` "local", Ray starts here and the application serves until SIGINT or SIGTERM, then Ray stops;
    with a cluster's address, it stays deployed there and this returns (`serve shutdown` removes it).
    """
    import ray
    from ray import serve

    tls = proxy_tls(settings)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per readiness poll
    is_local = address == "local"
    if is_local:
        # Ray starts its workers (so the replicas and its proxy) at niceness 15, behind every other program of
        # the machine; a server started here should not yield its cores to whatever else runs beside it.
        os.environ.setdefault(WORKER_NICENESS_VARIABLE, "0")
    ray.init(address=None if is_local else address, include_dashboard=False, logging_level=logging.WARNING)
    try:
        _check_placement(options, is_local)
        grpc = {"port": settings.grpc_port, "grpc_servicer_functions": [SERVICER_FUNCTION]}  # Ray's gRPC proxy
        http = {"host": settings.host, "port": http_port, **tls}  # Ray's HTTP proxy
        serve.start(
            proxy_location=options.proxy_location, http_options=http, grpc_options=grpc if settings.grpc_port else None,
            controller_options=_PROXY_ENVIRONMENT,
        )  # fmt: skip
        serve.run(build_app(settings, options), name=DEPLOYMENT_NAME, route_prefix="/", blocking=False)
        host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
        scheme = "https" if tls else "http"
        wait_ready(f"{scheme}://{host}:{http_port}", ready_timeout_s)
        log.info("serving %s on Ray Serve at %s://%s:%d (%d replicas)", settings.model_repository, scheme, host,
                 http_port, options.replicas)  # fmt: skip
        doors = f", gRPC {host}:{settings.grpc_port}" if settings.grpc_port else ""
        if options.direct_port:
            doors += f", direct {scheme}://{host}:{options.direct_port}"
        groups = "".join(f", group {name}: {group.replicas}" for name, group in options.groups.items())
        print(f"layerserve on Ray Serve: {scheme}://{host}:{http_port}{doors} ({options.replicas} replicas{groups})",
              flush=True)  # fmt: skip
        if not is_local:
            return 0
        stop = threading.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())
        stop.wait()
        serve.shutdown()  # type: ignore[no-untyped-call]
        return 0
    finally:
        ray.shutdown()
