"""`layerserve bench`: a closed-loop HTTP (or gRPC) load generator with an in-process ceiling and a bare baseline."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import math
import re
import socket
import ssl
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from multiprocessing.pool import Pool
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import orjson

from layerserve.bench.grpc_client import MODEL_INFER, build_grpc_request, grpc_client_process
from layerserve.bench.loops import client_tls, run_timed
from layerserve.engines.base import probe_batch
from layerserve.engines.process.pool import EngineProcessPool
from layerserve.errors import BadRequestError
from layerserve.tensors import TensorSpec

WORKLOADS = ("tensor", "tensor-json", "image", "text")


@dataclass(frozen=True)
class Workload:
    """One request, sent again and again: its HTTP bytes and how many samples (rows) it carries."""

    kind: str
    path: str
    body: bytes
    headers: dict[str, str]
    rows: int
    grpc_port: int = 0  # not 0: `body` is an encoded ModelInferRequest for the gRPC door on this port

    def raw_request(self, host: str) -> bytes:
        """The whole HTTP/1.1 request, encoded once."""
        lines = [f"POST {self.path} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(self.body)}"]
        lines += [f"{name}: {value}" for name, value in self.headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + self.body


@dataclass
class StepResult:
    """What one concurrency level measured."""

    concurrency: int
    duration_s: float
    requests: int
    req_s: float
    samples_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    errors: dict[str, int] = field(default_factory=dict)
    server_cpu_percent: float | None = None
    server_rss_bytes: float | None = None
    client_cpu_percent: float = 0.0
    mean_batch_size: float | None = None  # rows per model call on the server over the step (from its /metrics)


def _get_json(url: str) -> Any:
    """GET `url` (the user's own server) as JSON.

    Raises:
        BadRequestError: the server cannot be reached, or answers with an error (its message is quoted).
    """
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            body = response.read()
    except urllib.error.HTTPError as error:
        answer = error.read().decode("utf-8", "replace")
        with contextlib.suppress(ValueError, KeyError, TypeError):  # not our JSON error: quoted as it came
            answer = json.loads(answer)["error"]
        raise BadRequestError(f"GET {url} answered {error.code}: {answer[:300]}") from None
    except TimeoutError:
        raise BadRequestError(f"GET {url} got no answer within 30 s") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as error:
        reason = getattr(error, "reason", error)
        raise BadRequestError(f"cannot reach the server at {url}: {reason}; is it running?") from None
    try:
        return json.loads(body)
    except ValueError:
        raise BadRequestError(f"GET {url} answered 200 with no JSON: is it a layerserve (V2) server?") from None


def build_workload(
    url: str,
    model: str,
    kind: str,
    rows: int,
    image: Path | None,
    outputs: tuple[str, ...] = (),
    use_cache: bool = True,
    text: str = "",
) -> Workload:
    """The request for a workload, built from the model's metadata (tensor) or an image file (image).

    `outputs` names the outputs or layers to ask for (default: the model's outputs); for the image
    workload, a layer makes it `/features?layer=...` instead of `/classify`. The text workload sends
    `rows` copies of `text` to `/classify`.

    Raises:
        BadRequestError: an unknown workload, or an image workload without an image file.
    """
    if kind == "text":
        body = orjson.dumps({"texts": [text] * rows})
        path = f"/v2/models/{model}/classify?cache={'true' if use_cache else 'false'}"
        return Workload(kind, path, body, {"Content-Type": "application/json"}, rows)
    if kind == "image":
        if image is None:
            raise BadRequestError("the image workload needs --image FILE")
        media = "image/png" if image.suffix.lower() == ".png" else "image/jpeg"
        route = f"features?layer={outputs[0]}&" if outputs else "classify?"
        path = f"/v2/models/{model}/{route}cache={'true' if use_cache else 'false'}"
        return Workload(kind, path, image.read_bytes(), {"Content-Type": media}, 1)
    if kind not in WORKLOADS:
        raise BadRequestError(f"workload must be one of {', '.join(WORKLOADS)}, got {kind!r}")
    meta = _get_json(f"{url}/v2/models/{model}")
    specs = tuple(TensorSpec(i["name"], i["datatype"], tuple(i["shape"])) for i in meta["inputs"])
    batch = probe_batch(specs, rows)
    path = f"/v2/models/{model}/infer"
    wanted: dict[str, object] = {"outputs": [{"name": name} for name in outputs]} if outputs else {}
    parameters: dict[str, object] = {} if use_cache else {"cache": False}
    if kind == "tensor-json":
        inputs = [{"name": s.name, "shape": list(a.shape), "datatype": s.datatype, "data": a.reshape(-1)}
                  for s, a in zip(specs, batch, strict=True)]  # fmt: skip
        body = orjson.dumps({"inputs": inputs, **wanted, "parameters": parameters}, option=orjson.OPT_SERIALIZE_NUMPY)
        return Workload(kind, path, body, {"Content-Type": "application/json"}, rows)
    inputs = [{"name": s.name, "shape": list(a.shape), "datatype": s.datatype,
               "parameters": {"binary_data_size": a.nbytes}} for s, a in zip(specs, batch, strict=True)]  # fmt: skip
    header = orjson.dumps({"inputs": inputs, **wanted, "parameters": {"binary_data_output": True, **parameters}})
    headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(header))}
    return Workload(kind, path, header + b"".join(a.tobytes() for a in batch), headers, rows)


def grpc_workload(options: BenchOptions, http: Workload) -> Workload:
    """The gRPC form of a workload: the same tensors, image or texts as one encoded ModelInferRequest."""
    meta = _get_json(f"{options.url}/v2/models/{options.model}")
    specs = tuple(TensorSpec(i["name"], i["datatype"], tuple(i["shape"])) for i in meta["inputs"])
    request = build_grpc_request(
        specs, options.model, options.workload, options.rows, options.image, options.outputs, options.use_cache,
        options.text,
    )  # fmt: skip
    return Workload(http.kind, MODEL_INFER, request, {}, http.rows, options.grpc_port)


def _status_and_length(head: bytes) -> tuple[int, int]:
    """An HTTP/1.1 answer's status and Content-Length (0 if none) from its head."""
    match = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
    return int(head[9:12]), int(match.group(1)) if match else 0


async def _read_response(reader: asyncio.StreamReader) -> int:
    status, length = _status_and_length(await reader.readuntil(b"\r\n\r\n"))
    await reader.readexactly(length)
    return status


async def _connection(
    host: str, port: int, request: bytes, stop_at: float, out: list[tuple[float, int]], tls: ssl.SSLContext | None
) -> None:
    reader, writer = await asyncio.open_connection(host, port, ssl=tls)
    try:
        while time.perf_counter() < stop_at:
            started = time.perf_counter()
            writer.write(request)
            try:
                status = await _read_response(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                out.append((time.perf_counter() - started, 0))
                writer.close()
                reader, writer = await asyncio.open_connection(host, port, ssl=tls)
                continue
            out.append((time.perf_counter() - started, status))
    finally:
        writer.close()


def _client_process(args: tuple[str, int, bytes, int, float, bool]) -> tuple[list[tuple[float, int]], float]:
    """One load-generating process: `connections` closed loops for `seconds` (over TLS with `tls`); (latency,
    status)s and CPU s."""
    host, port, request, connections, seconds, tls = args
    out: list[tuple[float, int]] = []
    context = client_tls("http/1.1") if tls else None

    async def main() -> None:
        stop_at = time.perf_counter() + seconds
        await asyncio.gather(*(_connection(host, port, request, stop_at, out, context) for _ in range(connections)))

    cpu_seconds = run_timed(main)
    return out, cpu_seconds


@dataclass(frozen=True)
class _ServerMetrics:
    """What the server's /metrics says at one moment: its CPU seconds and RSS bytes, and the rows and model calls
    its batchers have counted (all its models: the load calls one)."""

    cpu_s: float
    rss_bytes: float
    batch_rows: float
    batches: float


def _metric_sum(text: str, name: str) -> float | None:
    """The sum of every line of one metric in a /metrics text, or None if it has none."""
    # One line per worker process (`{pid="..."}`) or per model (`{model="...",...}`), one without labels otherwise.
    values = re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    return sum(map(float, values)) if values else None


def _process_metrics(url: str) -> _ServerMetrics | None:
    """The server's figures from its /metrics, or None if it has none."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            text = response.read().decode()
    except (OSError, http.client.HTTPException):  # no server, no /metrics, or not HTTP/1.1 (a bare gRPC server)
        return None
    cpu = _metric_sum(text, "layerserve_process_cpu_seconds")
    rss = _metric_sum(text, "layerserve_process_resident_memory_bytes")
    if cpu is None or rss is None:
        return None
    rows, batches = _metric_sum(text, "layerserve_batch_size_sum"), _metric_sum(text, "layerserve_batch_size_count")
    return _ServerMetrics(cpu, rss, rows or 0.0, batches or 0.0)


@dataclass
class _Slice:
    """What one closed-loop run measured: (latency, status) samples over `seconds` (from the start to the last
    answer), the load's and the server's CPU seconds, and the rows and model calls the server's batchers ran."""

    samples: list[tuple[float, int]]
    seconds: float
    client_cpu_s: float
    server_cpu_s: float | None = None
    server_rss_bytes: float | None = None
    server_batches: tuple[float, float] | None = None  # (rows, model calls)


def _run_slice(url: str, workload: Workload, concurrency: int, seconds: float, pool: Pool) -> _Slice:
    """Drive the server with `concurrency` closed-loop connections, spread over the pool's processes."""
    address = urlsplit(url)
    host, port = address.hostname or "127.0.0.1", address.port or 80
    request = workload.body if workload.grpc_port else workload.raw_request(f"{host}:{port}")
    port, client = (workload.grpc_port, grpc_client_process) if workload.grpc_port else (port, _client_process)
    processes = max(1, min(pool._processes, concurrency))  # type: ignore[attr-defined]  # Pool's size
    shares = [concurrency // processes + (1 if i < concurrency % processes else 0) for i in range(processes)]
    before = _process_metrics(url)
    started = time.perf_counter()
    tls = address.scheme == "https"
    per_process = pool.map(client, [(host, port, request, n, seconds, tls) for n in shares])
    elapsed = time.perf_counter() - started
    after = _process_metrics(url)
    # The slice lasts until its last answer: the requests sent before the stop are all counted, so dividing by the
    # nominal seconds overstated the rate by up to one answer per connection (13% for 2.5 s at 340 ms a request).
    samples = [sample for part, _ in per_process for sample in part]
    measured = _Slice(samples, elapsed, sum(cpu for _, cpu in per_process))
    if before and after:
        measured.server_cpu_s, measured.server_rss_bytes = after.cpu_s - before.cpu_s, after.rss_bytes
        measured.server_batches = (after.batch_rows - before.batch_rows, after.batches - before.batches)
    return measured


def _step(concurrency: int, rows: int, slices: list[_Slice]) -> StepResult:
    """One step's figures from its slices (one, or several interleaved with the bare stack's)."""
    seconds = sum(part.seconds for part in slices)
    samples = [sample for part in slices for sample in part.samples]
    ok = [latency for latency, status in samples if status == 200]
    errors = Counter(str(status) if status else "connection" for _, status in samples if status != 200)
    ms = np.array(ok or [math.nan]) * 1000
    result = StepResult(
        concurrency, seconds, len(samples), len(ok) / seconds, len(ok) * rows / seconds,
        float(np.percentile(ms, 50)), float(np.percentile(ms, 90)), float(np.percentile(ms, 99)), dict(errors),
    )  # fmt: skip
    result.client_cpu_percent = 100 * sum(part.client_cpu_s for part in slices) / seconds
    server_cpu = [part.server_cpu_s for part in slices]
    if all(cpu is not None for cpu in server_cpu):
        result.server_cpu_percent = 100 * sum(server_cpu) / seconds  # type: ignore[arg-type]
        result.server_rss_bytes = slices[-1].server_rss_bytes
    batches = [part.server_batches for part in slices if part.server_batches is not None]
    batch_rows, calls = sum(part[0] for part in batches), sum(part[1] for part in batches)
    if len(batches) == len(slices) and calls:
        result.mean_batch_size = batch_rows / calls
    return result


def run_step(url: str, workload: Workload, concurrency: int, seconds: float, pool: Pool) -> StepResult:
    """Drive the server with `concurrency` closed-loop connections for `seconds`, spread over the pool's processes."""
    return _step(concurrency, workload.rows, [_run_slice(url, workload, concurrency, seconds, pool)])


def _ok_rate(part: _Slice) -> float:
    return sum(1 for _, status in part.samples if status == 200) / part.seconds


PAIRED_ROUNDS = 4


@dataclass
class References:
    """What a step's slices take turns with: the bare stack (its URL and workload), the model in process (batches
    of `best_batch`, and at concurrency 1 batches of one too)."""

    bare: tuple[str, Workload] | None = None
    model: InProcessModel | None = None
    best_batch: int = 1

    @property
    def rounds(self) -> int:
        """Slices per step: `PAIRED_ROUNDS` with a reference to take turns with, else one."""
        return PAIRED_ROUNDS if self.bare is not None or self.model is not None else 1


def run_paired_step(
    url: str, workload: Workload, concurrency: int, seconds: float, pool: Pool, references: References
) -> tuple[StepResult, StepResult | None, dict[str, float]]:
    """The server in `references.rounds` slices of one concurrency, each followed by a slice of each reference: the
    served step, the bare step (if any), and the ratios, each the median over the rounds of side-by-side slices (a
    shared machine's speed drifts within seconds: a ratio of slices next to each other in time drifts far less than
    one of two steps apart): `vs_bare` (req/s), `vs_in_process` (samples/s over the in-process ceiling's), and at
    concurrency 1 `p50_over_in_process_ms` (served p50 minus the in-process p50 of a batch of one, over HTTP from
    requests and calls taking turns one by one: `_taking_turns`)."""
    rounds = references.rounds
    part = seconds / rounds
    served, baseline = [], []
    ratios: dict[str, list[float]] = {"vs_bare": [], "vs_in_process": [], "p50_over_in_process_ms": []}
    for _ in range(rounds):
        served.append(_run_slice(url, workload, concurrency, part, pool))
        rate = _ok_rate(served[-1])
        if references.bare is not None:
            baseline.append(_run_slice(*references.bare, concurrency, part, pool))
            if _ok_rate(baseline[-1]):
                ratios["vs_bare"].append(rate / _ok_rate(baseline[-1]))
        if references.model is not None:
            ceiling, _ = references.model.run(references.best_batch, part)
            ratios["vs_in_process"].append(rate * workload.rows / ceiling)
            if concurrency == 1:
                if workload.grpc_port:  # no blocking gRPC client here: the slice's answers, then calls
                    answered = [latency for latency, status in served[-1].samples if status == 200]
                    calls = references.model.run(1, part)[1]
                else:
                    answered, calls = _taking_turns(url, workload, references.model, part)
                if answered:
                    ratios["p50_over_in_process_ms"].append((np.median(answered) - np.median(calls)) * 1000)
    bare_step = _step(concurrency, references.bare[1].rows, baseline) if references.bare is not None else None
    medians = {name: float(np.median(values)) for name, values in ratios.items() if values}
    return _step(concurrency, workload.rows, served), bare_step, medians


def _taking_turns(
    url: str, workload: Workload, model: InProcessModel, seconds: float
) -> tuple[list[float], list[float]]:
    """At concurrency 1, one request to the server, then one in-process call of a batch of one, in turns for
    `seconds`: the seconds of each request answered 200 and of each call. Request by request, a shared machine's
    drift (the in-process p50 moved by half from one slice of seconds to the next here) falls on both alike."""
    address = urlsplit(url)
    host, port = address.hostname or "127.0.0.1", address.port or 80
    request = workload.raw_request(f"{host}:{port}")
    answered, calls = [], []
    with socket.create_connection((host, port), timeout=60) as raw:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock = client_tls("http/1.1").wrap_socket(raw, server_hostname=host) if address.scheme == "https" else raw
        reader = sock.makefile("rb")
        stop_at = time.perf_counter() + seconds
        while time.perf_counter() < stop_at:
            started = time.perf_counter()
            sock.sendall(request)
            if _read_response_blocking(reader) == 200:
                answered.append(time.perf_counter() - started)
            calls.append(model.call(1))
    return answered, calls


def _read_response_blocking(reader: Any) -> int:
    """`_read_response` from a blocking file: read one answer framed by its Content-Length; its status."""
    head = b""
    while (line := reader.readline()) not in (b"\r\n", b""):
        head += line
    status, length = _status_and_length(head + b"\r\n")
    reader.read(length)
    return status


class InProcessModel:
    """A repository's model loaded in this process on the engine the server uses, to measure its ceiling."""

    def __init__(self, repository: Path, model: str, workload: Workload, threads: int = 0) -> None:
        """Load the model's newest version; `threads`: intra-op threads per call (0: as a server with the default
        settings runs it)."""
        from concurrent.futures import ThreadPoolExecutor

        from layerserve.lifecycle.prepare import Preparer
        from layerserve.lifecycle.repository import scan
        from layerserve.serving.registry import ModelVersion
        from layerserve.settings import Settings

        specs = [spec for spec in scan(repository) if spec.name == model]
        if not specs or not specs[0].versions:
            raise BadRequestError(f"model {model!r} has no version in {repository}")
        number, path = max(specs[0].versions.items())
        self._version = version = ModelVersion(model, number, path, specs[0].config)
        settings = Settings(model_repository=repository, intra_op_threads=threads)
        self._processes = EngineProcessPool.from_settings(settings)
        self._exporter, self._preparer = ThreadPoolExecutor(1), Preparer()
        self._decoders = ThreadPoolExecutor()
        self._workload = workload
        self._batches: dict[int, list[Any]] = {}  # probe batches by size
        version.load(settings, self._exporter, self._preparer, self._processes)
        if version.engine is None:
            self.close()
            raise BadRequestError(f"model {model!r} failed to load: {version.reason}")

    def run(self, size: int, seconds: float) -> tuple[float, list[float]]:
        """Batches of `size` for `seconds` (images: decode included): samples/s, and each call's seconds."""
        calls, started = [], time.perf_counter()
        while time.perf_counter() - started < seconds:
            calls.append(self.call(size))
        return len(calls) * size / (time.perf_counter() - started), calls

    def call(self, size: int) -> float:
        """One batch of `size` (images: decoded first; texts: tokenized first); its seconds."""
        from layerserve.features.images import load_one

        version, workload = self._version, self._workload
        engine, image = version.engine, version.image
        assert engine is not None
        batch = self._batches.get(size) or self._batches.setdefault(size, probe_batch(version.signature.inputs, size))
        started = time.perf_counter()
        if workload.kind == "text" and version.tokenizer is not None:
            batch = [version.tokenizer.encode(json.loads(workload.body)["texts"][:1] * size)]
        elif workload.kind == "image" and image is not None:
            decoded = self._decoders.map(lambda raw: load_one(raw, image, 10**9), [workload.body] * size)
            batch = [np.stack(list(decoded))]
        engine.run(batch)
        return time.perf_counter() - started

    def close(self) -> None:
        """Free the model and its engine process."""
        self._version.close()
        self._exporter.shutdown()
        self._decoders.shutdown()
        self._preparer.close()
        self._processes.stop_idle()


def in_process_ceiling(
    repository: Path, model: str, workload: Workload, batch_sizes: list[int], seconds: float, threads: int = 0
) -> dict[int, float]:
    """Samples/s of the model on the engine the server uses (`threads`: see InProcessModel), per batch size (images:
    decode included)."""
    model_here = InProcessModel(repository, model, workload, threads)
    try:
        return {size: model_here.run(size, seconds)[0] for size in batch_sizes}
    finally:
        model_here.close()


@dataclass(frozen=True)
class BenchOptions:
    """What `layerserve bench` was asked to do."""

    url: str
    model: str
    workload: str
    concurrency: list[int]
    duration_s: float
    rows: int = 1
    image: Path | None = None
    outputs: tuple[str, ...] = ()
    use_cache: bool = True
    text: str = ""
    in_process: Path | None = None
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    in_process_threads: int = 0  # intra-op threads of the model in process (0: as the server runs it by default)
    bare: bool = False
    client_processes: int = 1
    output: Path | None = None
    plot: Path | None = None
    protocol: str = "http"
    grpc_port: int = 8001


def _warm_up(_: int) -> None:
    """Run in each client process once, so that process start-up is not timed."""


def drive(
    url: str, workload: Workload, references: References, options: BenchOptions, pool: Pool
) -> list[tuple[StepResult, StepResult | None, dict[str, float]]]:
    """A warm-up, then one step per concurrency (taking turns with the references, if any: see run_paired_step),
    with a progress bar."""
    from rich.progress import Progress

    run_step(url, workload, 1, 1.0, pool)  # warm the server's path and the connections
    if references.bare is not None:
        run_step(*references.bare, 1, 1.0, pool)
    steps = []
    with Progress(transient=True) as progress:
        task = progress.add_task(f"server c={options.concurrency[0]}", total=len(options.concurrency))
        for concurrency in options.concurrency:
            progress.update(task, description=f"server: concurrency {concurrency}, {options.duration_s:g} s")
            steps.append(run_paired_step(url, workload, concurrency, options.duration_s, pool, references))
            progress.advance(task)
    return steps


def run_bench(options: BenchOptions) -> dict[str, Any]:
    """Measure the server (and optionally the in-process ceiling and the bare stack); returns the report."""
    import multiprocessing

    if options.workload in ("text", "image"):  # the tensor workloads read the model's metadata to build theirs
        _get_json(f"{options.url}/v2/models/{options.model}")  # the server answers, and serves the model
    workload = build_workload(
        options.url, options.model, options.workload, options.rows, options.image, options.outputs,
        options.use_cache, options.text,
    )  # fmt: skip
    if options.protocol == "grpc":
        workload = grpc_workload(options, workload)
    report: dict[str, Any] = {"options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items()}}
    references = References()
    try:
        if options.in_process is not None:
            references.model = InProcessModel(options.in_process, options.model, workload, options.in_process_threads)
            rates = {size: references.model.run(size, 3.0)[0] for size in options.batch_sizes}
            references.best_batch = best = max(rates, key=lambda size: rates[size])
            report["in_process"] = {"samples_s": rates, "best_batch_size": best, "best_samples_s": rates[best]}
        with multiprocessing.get_context("spawn").Pool(options.client_processes) as pool:
            pool.map(_warm_up, range(options.client_processes))
            _drive_into(report, workload, references, options, pool)
    finally:
        if references.model is not None:
            references.model.close()
    if options.output:
        options.output.write_text(json.dumps(report, indent=2))
    if options.plot:
        plot(report, options.plot)
    return report


def _drive_into(
    report: dict[str, Any], workload: Workload, references: References, options: BenchOptions, pool: Pool
) -> None:
    """The served steps, taking turns with the bare stack (started here) and the model in process, into `report`."""
    process = None
    if options.bare:
        from layerserve.bench.baseline import start_bare_server

        process, port = start_bare_server(options.protocol)
        bare = replace(workload, grpc_port=port) if options.protocol == "grpc" else workload
        references.bare = (f"http://127.0.0.1:{port}", bare)
    try:
        steps = drive(options.url, workload, references, options, pool)
    finally:
        if process is not None:
            process.kill()
    report["steps"] = [asdict(step) | ratios for step, _, ratios in steps]
    if references.rounds > 1:
        report["paired_rounds"] = references.rounds  # the ratios are medians of side-by-side slices
    if options.bare:
        report["bare"] = [asdict(bare_step) for _, bare_step, _ in steps if bare_step is not None]


def print_report(report: dict[str, Any]) -> None:
    """The results as a table on the terminal."""
    from rich.console import Console
    from rich.measure import Measurement
    from rich.table import Table

    table = Table(title=f"{report['options']['workload']} workload on {report['options']['model']}")
    for column in ("conc.", "req/s", "samples/s", "p50 ms", "p90 ms", "p99 ms", "errors", "srv CPU%",
                   "srv RSS MB", "load CPU%", "/ceiling", "/bare"):  # fmt: skip
        table.add_column(column, justify="right")
    for step in report["steps"]:
        cpu, rss = step["server_cpu_percent"], step["server_rss_bytes"]
        table.add_row(
            str(step["concurrency"]), f"{step['req_s']:.1f}", f"{step['samples_s']:.1f}", f"{step['p50_ms']:.1f}",
            f"{step['p90_ms']:.1f}", f"{step['p99_ms']:.1f}", json.dumps(step["errors"]) if step["errors"] else "0",
            "-" if cpu is None else f"{cpu:.0f}", "-" if rss is None else f"{rss / 2**20:.0f}",
            f"{step['client_cpu_percent']:.0f}",
            f"{step['vs_in_process']:.2f}" if "vs_in_process" in step else "-",
            f"{step['vs_bare']:.2f}" if "vs_bare" in step else "-",
        )  # fmt: skip
    console = Console()
    width = Measurement.get(console, console.options.update_width(1000), table).maximum  # its natural width
    if width > console.width:
        # A pipe (80 columns) or a narrow terminal: rich would cut the figures to "352…"; lines may wrap instead.
        console = Console(width=width)
    console.print(table)
    if "in_process" in report:
        ceiling = report["in_process"]
        console.print(
            f"in-process ceiling: {ceiling['best_samples_s']:.1f} samples/s at batch {ceiling['best_batch_size']}"
        )
    for step in report.get("bare", []):
        console.print(
            f"bare stack, concurrency {step['concurrency']}: {step['req_s']:.1f} req/s, p50 {step['p50_ms']:.1f} ms"
        )


def plot(report: dict[str, Any], path: Path) -> None:
    """Throughput and p99 latency against concurrency, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = report["steps"]
    concurrency = [s["concurrency"] for s in steps]
    figure, (rate, latency) = plt.subplots(1, 2, figsize=(10, 4))
    rate.plot(concurrency, [s["samples_s"] for s in steps], marker="o", label="served")
    if "bare" in report:
        rate.plot(concurrency, [s["samples_s"] for s in report["bare"]], marker="s", label="bare HTTP stack")
    if "in_process" in report:
        rate.axhline(report["in_process"]["best_samples_s"], color="grey", linestyle="--", label="in-process ceiling")
    rate.set(xscale="log", xlabel="concurrency", ylabel="samples/s", title="throughput")
    rate.legend()
    latency.plot(concurrency, [s["p99_ms"] for s in steps], marker="o", color="tab:red")
    latency.set(xscale="log", xlabel="concurrency", ylabel="ms", title="p99 latency")
    figure.suptitle(f"{report['options']['workload']} workload on {report['options']['model']}")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
