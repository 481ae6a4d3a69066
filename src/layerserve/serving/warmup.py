"""A version's own warm-up requests, run before it is READY: TF Serving's `assets.extra/tf_serving_warmup_requests`
(a TFRecord file of PredictionLogs) and layerserve's `warmup/*.json` (V2 infer request bodies).

Each request is checked as a request is, its encoded images or texts decoded, and computed by the function every
batch of the version runs (its engine, or a cut's) at each batch size the batcher may send: its rows repeated to
1, 2, ... `max_batch_size` rows. A request that fails makes the version FAILED, the reason naming its file (and
record).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from layerserve.errors import BadRequestError, LayerserveError, ModelLoadError
from layerserve.features.images import ImageDecoder
from layerserve.messages import InferRequest
from layerserve.protocols.tfrecord import read_records
from layerserve.protocols.tfserving_warmup import infer_request
from layerserve.protocols.v2 import parse_infer_request
from layerserve.serving.input_codec import InputCodec
from layerserve.serving.layers import LayerGraph
from layerserve.serving.request_checks import RequestChecks
from layerserve.tensors import Array

log = logging.getLogger(__name__)

TF_SERVING_FILE = Path("assets.extra") / "tf_serving_warmup_requests"
JSON_FOLDER = "warmup"
MAX_REQUESTS = 1000  # TF Serving's limit on a warm-up file's records

RunNamed = Callable[[dict[str, Array], tuple[str, ...]], dict[str, Array]]


@dataclass(frozen=True)
class WarmupTarget:
    """What a version's warm-up runs on: its graph, request checks, input codec, batch function (VersionRouter.run)
    and largest batch; `max_image_pixels` bounds the images it decodes, as for requests."""

    graph: LayerGraph
    checks: RequestChecks
    codec: InputCodec
    run: RunNamed
    max_batch_size: int
    max_image_pixels: int


@dataclass(frozen=True)
class WarmupRequest:
    """One warm-up request and where it came from (its file, relative to the version's folder, and record)."""

    source: str
    request: InferRequest


def warmup_files(folder: Path) -> list[Path]:
    """The version's warm-up files, TF Serving's first, then `warmup/*.json` by name."""
    files = [folder / TF_SERVING_FILE] if (folder / TF_SERVING_FILE).is_file() else []
    return files + sorted((folder / JSON_FOLDER).glob("*.json"))


def read_requests(folder: Path, model: str, target: WarmupTarget) -> Iterator[WarmupRequest]:
    """The version's warm-up requests, in order.

    Raises:
        ModelLoadError: a file that cannot be read or parsed, or more than MAX_REQUESTS requests (naming the file and
            the record).
    """
    count = 0
    for path in warmup_files(folder):
        name = str(path.relative_to(folder))
        try:
            data = path.read_bytes()
        except OSError as error:
            raise ModelLoadError(f"warm-up file {name}: {error.strerror}") from None
        try:
            for index, request in enumerate(_parse(data, path, model, target)):
                count += 1
                if count > MAX_REQUESTS:
                    raise BadRequestError(f"more than {MAX_REQUESTS} warm-up requests")
                yield WarmupRequest(f"{name} record {index}" if path.name == TF_SERVING_FILE.name else name, request)
        except BadRequestError as error:
            raise ModelLoadError(f"warm-up file {name}: {error.message}") from None


def _parse(data: bytes, path: Path, model: str, target: WarmupTarget) -> Iterator[InferRequest]:
    """A warm-up file's requests: one per record of TF Serving's file, one per JSON file."""
    if path.suffix == ".json":
        yield parse_infer_request(data, None, model, check=target.checks.declared)
        return
    for index, record in enumerate(read_records(data)):
        yield infer_request(record, model, target.graph, target.codec.encoded_input, f"record {index}")


def batch_sizes(rows: int, max_batch_size: int) -> list[int]:
    """The batch sizes to warm up a request of `rows` rows at: every size the batcher may send, and its own."""
    if max_batch_size <= 1 or rows < 1:
        return [rows]
    return sorted({*range(1, max_batch_size + 1), rows})


def run_warmup(folder: Path, model: str, target: WarmupTarget) -> int:
    """Run the version's warm-up requests on `target` (see the module docstring); how many there were.

    Raises:
        ModelLoadError: a request could not be read or computed (naming its file and record).
    """
    count = 0
    for warmup in read_requests(folder, model, target):
        try:
            _run_one(warmup.request, target)
        except LayerserveError as error:
            raise ModelLoadError(f"warm-up request {warmup.source}: {error.message}") from None
        except Exception as error:  # the engine's own refusal (ONNX Runtime, Keras): the load fails, naming the file
            raise ModelLoadError(f"warm-up request {warmup.source}: the model failed on it: {error}") from None
        count += 1
    if count:
        log.info("model %s: %d warm-up request(s) from %s run", model, count, folder)
    return count


def _run_one(request: InferRequest, target: WarmupTarget) -> None:
    """One request through the checks, the codec and the version's batch function, at each batch size."""
    checks = target.checks
    inputs = checks.inputs(request.inputs, request.base64_inputs)
    outputs = tuple(output.name for output in request.requested)
    checks.outputs(outputs)
    inputs = _decoded(inputs, target.codec, target.max_image_pixels)
    checks.check_index_ranges(inputs)
    wanted = outputs or tuple(spec.name for spec in target.graph.signature.outputs)
    first = next(iter(inputs.values()))
    rows = first.shape[0] if first.ndim else 1
    sizes = batch_sizes(rows, target.max_batch_size) if all(a.ndim for a in inputs.values()) else [rows]
    for size in sizes:
        order = np.arange(size) % rows
        target.run({name: array if size == rows else array[order] for name, array in inputs.items()}, wanted)


def _decoded(inputs: dict[str, Array], codec: InputCodec, max_image_pixels: int) -> dict[str, Array]:
    """Encoded images or texts decoded as a request's are (this is the loader's thread: its own loop and pool)."""
    name = codec.encoded_input
    if name is None or name not in inputs or inputs[name].dtype != object:
        return inputs
    with ThreadPoolExecutor(1, thread_name_prefix="warmup-decode") as pool:
        return asyncio.run(codec.decode_encoded(inputs, ImageDecoder(pool, max_image_pixels)))
