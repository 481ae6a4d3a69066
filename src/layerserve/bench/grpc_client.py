"""`layerserve bench --protocol grpc`: the same closed loops as the HTTP load generator, over the gRPC door.

Each closed loop has a connection of its own (as each HTTP loop does) and sends one ModelInferRequest, encoded
once, again and again with grpc.aio; answers are received whole but not decoded, as the HTTP loops do.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import numpy as np
from tritonclient.grpc import service_pb2

from layerserve.engines.base import probe_batch
from layerserve.errors import BadRequestError
from layerserve.tensors import TensorSpec, datatype_of

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


async def _loop(target: str, request: bytes, stop_at: float, out: list[tuple[float, int]]) -> None:
    # A local subchannel pool: a connection per loop (grpc shares one between equal channels otherwise).
    options = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", -1)]
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        infer = channel.unary_unary(MODEL_INFER)  # bytes in, bytes out: encoded once, not decoded
        while time.perf_counter() < stop_at:
            started = time.perf_counter()
            try:
                await infer(request)
                status = _OK
            except grpc.aio.AioRpcError as error:
                status = error.code().value[0]
            out.append((time.perf_counter() - started, status))


def grpc_client_process(args: tuple[str, int, bytes, int, float]) -> tuple[list[tuple[float, int]], float]:
    """One load-generating process: `loops` closed loops for `seconds`; (latency, status)s and CPU seconds.
    A status is 200 for an answer, else the gRPC status code's number."""
    host, port, request, loops, seconds = args
    out: list[tuple[float, int]] = []
    cpu_started = time.process_time()

    async def main() -> None:
        stop_at = time.perf_counter() + seconds
        await asyncio.gather(*(_loop(f"{host}:{port}", request, stop_at, out) for _ in range(loops)))

    asyncio.run(main())
    return out, time.process_time() - cpu_started
