"""`layerserve bench --protocol grpc`: the same closed loops as the HTTP load generator, over the gRPC door.

Each closed loop has a connection of its own (as each HTTP loop does) and sends one ModelInferRequest, encoded
and framed once, again and again over a minimal HTTP/2 client (h2_client.py: zttp's client connection on an asyncio
protocol), as the HTTP loops use raw sockets: grpc.aio's client took 2-3x the CPU of the HTTP client from the cores
the server runs on. Answers are received whole and their grpc-status read, but not decoded, as the HTTP loops do.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from pathlib import Path

import numpy as np
from tritonclient.grpc import service_pb2

from layerserve.bench.h2_client import ConnectionLostError, GoingAwayError, H2Connection
from layerserve.bench.loops import client_tls, run_timed
from layerserve.engines.base import probe_batch
from layerserve.errors import BadRequestError
from layerserve.tensors import TensorSpec, datatype_of
from layerserve.transports.grpc.wire import frame

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
_OK = 200  # what the report counts as an answer, as HTTP's status


def _bytes_tensor(items: list[bytes]) -> bytes:
    return b"".join(len(item).to_bytes(4, "little") + item for item in items)


def build_grpc_request(
    specs: tuple[TensorSpec, ...],
    model: str,
    kind: str,
    rows: int,
    image: Path | None,
    outputs: tuple[str, ...] = (),
    use_cache: bool = True,
    text: str = "",
) -> bytes:
    """The ModelInferRequest of a workload, encoded: random tensors (tensor), an encoded image or texts as BYTES
    of the model's first input (image, text).

    Raises:
        BadRequestError: an image workload without an image file.
    """
    request = service_pb2.ModelInferRequest(model_name=model)
    if kind in ("image", "text"):
        if kind == "image" and image is None:
            raise BadRequestError("the image workload needs --image FILE")
        items = [image.read_bytes()] if kind == "image" and image is not None else [text.encode()] * rows
        request.inputs.add(name=specs[0].name, datatype="BYTES", shape=[len(items)])
        request.raw_input_contents.append(_bytes_tensor(items))
    else:
        for spec, array in zip(specs, probe_batch(specs, rows), strict=True):
            request.inputs.add(name=spec.name, datatype=datatype_of(array.dtype), shape=array.shape)
            request.raw_input_contents.append(np.ascontiguousarray(array).tobytes())
    for name in outputs:
        request.outputs.add(name=name)
    if not use_cache:
        request.parameters["cache"].bool_param = False
    serialized: bytes = request.SerializeToString()
    return serialized


async def _loop(
    host: str, port: int, message: bytes, stop_at: float, out: list[tuple[float, int]], tls: ssl.SSLContext | None
) -> None:
    connection = await H2Connection.open(host, port, MODEL_INFER, tls)
    try:
        while time.perf_counter() < stop_at:
            started = time.perf_counter()
            try:
                code = await connection.call(message)
            except GoingAwayError:  # not taken: sent again on a new connection, as gRPC clients do
                connection.close()
                connection = await H2Connection.open(host, port, MODEL_INFER, tls)
                continue
            except (ConnectionLostError, ConnectionError, asyncio.IncompleteReadError):
                out.append((time.perf_counter() - started, 0))
                connection.close()
                connection = await H2Connection.open(host, port, MODEL_INFER, tls)
                continue
            out.append((time.perf_counter() - started, _OK if code == 0 else code))
    finally:
        connection.close()


def grpc_client_process(args: tuple[str, int, bytes, int, float, bool]) -> tuple[list[tuple[float, int]], float]:
    """One load-generating process: `loops` closed loops for `seconds` (over TLS with `tls`); (latency, status)s and
    CPU seconds. A status is 200 for an answer, else the gRPC status code's number."""
    host, port, request, loops, seconds, tls = args
    out: list[tuple[float, int]] = []
    context = client_tls("h2") if tls else None

    async def main() -> None:
        stop_at = time.perf_counter() + seconds
        message = frame(request)
        await asyncio.gather(*(_loop(host, port, message, stop_at, out, context) for _ in range(loops)))

    cpu_seconds = run_timed(main)
    return out, cpu_seconds
