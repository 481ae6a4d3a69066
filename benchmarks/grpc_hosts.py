"""The two ways to host gRPC that issue 42 weighed, measured side by side in one server process over one runtime:

  (a) gRPC as an ASGI app on uvicorn's own HTTP/2 (`http="zttp"`, `http2=True`, the status sent as response
      trailers through `http.response.trailers`), hosting the same servicer through a CallContext of its own;
  (b) the gRPC door: layerserve's sans-IO HTTP/2 core on zttp (transports/grpc/http2.py) and its thin IO layer.

    .venv/bin/python benchmarks/grpc_hosts.py [--duration-s 10] [--concurrency 1 8 32] [--json PATH]

Each step is `layerserve bench --protocol grpc` (V2 ModelInfer of one row, the demo token classifier and
EfficientNet-Lite0, the feature cache bypassed) against (a) and (b) in turns, with REST binary on the same server
for reference; the server's CPU comes from its /metrics (one process serves all three, one at a time). Then each
host takes 9,000 ModelInfer calls from grpcio, 32 in flight on one channel, and the failed ones are counted: zttp
ends a connection at its 4,096th stream (ENHANCE_YOUR_CALM), which (b) avoids by telling the client to go away
first (GOAWAY) and (a) cannot (neither uvicorn's protocol nor an ASGI app can send one).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from demo_server import wait_ready
from layerserve.bench.generator import BenchOptions, run_bench
from layerserve.demo import build_demo_repository
from results import arguments, load_parser, table, write_result
from soak_server import free_port

MODELS = ("token_classifier", "efficientnet_lite0")
HOSTS = {"rest": "REST binary", "asgi": "(a) ASGI on uvicorn's HTTP/2", "door": "(b) the gRPC door"}


class AsgiCall:
    """The CallContext of one call hosted by the ASGI app: its metadata and deadline; abort raises."""

    def __init__(self, headers: list[tuple[bytes, bytes]], timeout_s: float | None) -> None:
        from layerserve.transports.grpc import wire

        self._metadata = wire.metadata(headers)
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def invocation_metadata(self) -> Any:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    async def abort(self, code: Any, details: str = "") -> Any:
        from layerserve.transports.grpc.wire import CallError

        raise CallError(code, details)

    async def write(self, message: Any) -> None:
        raise NotImplementedError("unary calls only")


def grpc_asgi_app(handlers: dict[bytes, Any]) -> Any:
    """Unary gRPC calls as an ASGI app: the body read whole and unframed, the handler run, the answer framed, the
    status in the trailers."""
    import grpc

    from layerserve.transports.grpc import wire

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = scope["headers"]
        found = dict(headers)
        handler = handlers.get(scope["path"].encode())
        payload, code, details = b"", grpc.StatusCode.OK, ""
        try:
            if handler is None:
                raise wire.CallError(grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {scope['path']}")
            context = AsgiCall(headers, wire.timeout_s(found.get(b"grpc-timeout")))
            request = body[wire.PREFIX_BYTES :]
            parsed = request if handler.request_deserializer is None else handler.request_deserializer(request)
            answer = await handler.unary_unary(parsed, context)
            payload = answer if handler.response_serializer is None else handler.response_serializer(answer)
        except wire.CallError as error:
            code, details = error.code, error.details
        start = {"type": "http.response.start", "status": 200, "headers": wire.RESPONSE_HEADERS, "trailers": True}
        await send(start)
        await send({"type": "http.response.body", "body": wire.frame(payload) if payload else b""})
        await send({"type": "http.response.trailers", "headers": wire.status_trailers(code, details)})

    return app


def serve(repository: str, cache: str, http_port: int, door_port: int, asgi_port: int) -> None:
    """The server of the measurement: one Server, its HTTP and gRPC doors, and its servicer behind (a) too."""
    import uvicorn
    import uvloop

    from layerserve.server import Server
    from layerserve.settings import Settings

    settings = Settings(
        model_repository=Path(repository), engine_cache_dir=Path(cache), host="127.0.0.1", port=http_port,
        grpc_port=door_port, log_level="warning",
    )  # fmt: skip
    server = Server(settings)
    door = server.grpc
    assert door is not None
    config = uvicorn.Config(
        grpc_asgi_app(door.handlers), host="127.0.0.1", port=asgi_port, http="zttp", http2=True, lifespan="off",
        log_level="warning", access_log=False, loop="none",
    )  # fmt: skip

    async def main() -> None:
        hosted = uvicorn.Server(config)
        asyncio.get_running_loop().create_task(hosted.serve())
        await server.serve()

    uvloop.run(main())


def flood(port: int, calls: int = 9_000, in_flight: int = 32) -> int:
    """ModelInfer calls from grpcio on one channel, `in_flight` at a time: how many failed."""
    import grpc
    import numpy as np
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    request = service_pb2.ModelInferRequest(model_name="token_classifier")
    request.inputs.add(name="tokens", datatype="INT32", shape=[1, 64])
    request.raw_input_contents.append(np.arange(64, dtype=np.int32).tobytes())
    failed, pending = 0, []
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(calls):
            pending.append(stub.ModelInfer.future(request, timeout=30))
            if len(pending) >= in_flight:
                try:
                    pending.pop(0).result()
                except grpc.RpcError:
                    failed += 1
        for future in pending:
            try:
                future.result()
            except grpc.RpcError:
                failed += 1
    return failed


def render(result: dict[str, Any]) -> str:
    """Each model, concurrency and host: req/s, latency, server CPU, and each gRPC host against REST."""
    header = ["model", "concurrency", "host", "req/s", "p50 ms", "p99 ms", "server CPU %", "server us/request",
              "/ REST binary"]  # fmt: skip
    rows = []
    for row in result["rows"]:
        step, rest = row["step"], row["rest_req_s"]
        cpu = step["server_cpu_percent"]
        per_request = "-" if cpu is None or not step["req_s"] else cpu / 100 / step["req_s"] * 1e6
        ratio = "-" if row["host"] == "rest" else step["req_s"] / rest
        rows.append([row["model"], step["concurrency"], HOSTS[row["host"]], step["req_s"], step["p50_ms"],
                     step["p99_ms"], "-" if cpu is None else cpu, per_request, ratio])  # fmt: skip
    text = table(header, rows)
    failures = result["flood"]
    text += "\n\n" + table(
        ["host", "ModelInfer calls, 32 in flight on one channel", "failed"],
        [[HOSTS[host], result["parameters"]["flood_calls"], failed] for host, failed in failures.items()],
    )
    return text


def main() -> None:
    """Serve once, measure each host in turns, print the tables (and write JSON with `--json`)."""
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(*sys.argv[2:4], *(int(port) for port in sys.argv[4:7]))  # type: ignore[call-arg]
        return
    parser = load_parser(__doc__, 8790, [1, 8, 32])
    parser.add_argument("--flood-calls", type=int, default=9_000)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="layerserve-grpc-hosts-"))
    repository = work / "repo"
    build_demo_repository(repository)
    http_port, door_port, asgi_port = args.port, free_port(), free_port()
    command = [sys.executable, __file__, "--serve", str(repository), str(work / "cache"), str(http_port),
               str(door_port), str(asgi_port)]  # fmt: skip
    process = subprocess.Popen(command)
    url = f"http://127.0.0.1:{http_port}"
    rows: list[dict[str, Any]] = []
    try:
        wait_ready(url)
        for model in MODELS:
            for concurrency in args.concurrency:
                measured = {}
                for host, port in (("rest", 0), ("asgi", asgi_port), ("door", door_port)):
                    options = BenchOptions(
                        url, model, "tensor", [concurrency], args.duration_s, use_cache=False,
                        protocol="http" if host == "rest" else "grpc", grpc_port=port or door_port,
                    )  # fmt: skip
                    (measured[host],) = run_bench(options)["steps"]
                for host, step in measured.items():
                    rows.append({"model": model, "host": host, "step": step, "rest_req_s": measured["rest"]["req_s"]})
        failures = {host: flood(port, args.flood_calls) for host, port in (("asgi", asgi_port), ("door", door_port))}
    finally:
        process.terminate()
        process.wait(timeout=60)
    result = {"parameters": arguments(args), "models": list(MODELS), "rows": rows, "flood": failures}
    print(render(result))
    if args.json:
        write_result(args.json, result)


if __name__ == "__main__":
    main()
