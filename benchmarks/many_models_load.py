"""The many-models benchmark's load: closed loops sending V2 infer requests to models drawn from a Zipf mix, each
request told warm or cold by a readiness check just before it on the same connection; and the samplers of the
server's memory (from /proc) and of its /metrics.

Warm or cold: each loop asks, on its own connection (so of the worker that takes the request), whether the model
is ready right before each infer: over HTTP `GET /v2/models/M/ready` pipelined with the infer in one write (the
server answers a connection's requests in order, so the check sees the state the infer meets), over gRPC a
`ModelReady` call on the request's channel. A request whose model was not ready is cold: it waited for (or
started) a load. Its latency counts from the write of both to the infer's answer (the check adds tens of
microseconds); over gRPC from the infer call (the check is a call of its own before it).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson

from many_models_repo import ModelEntry
from soak_server import descendants, role_of

OK, REFUSED = 200, 503
BUDGET_NAME = b"model_memory_budget"  # what the budget's refusals name
_GRPC_UNAVAILABLE = 14
_KEPT_BODIES = 5


def zipf_order(count: int, s: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(the model index at each popularity rank, each rank's probability): rank k drawn with weight k^-s, the
    ranks dealt to the models at random (seeded), so that popularity and size are independent."""
    weights = np.arange(1, count + 1, dtype=np.float64) ** -s
    return np.random.default_rng(seed).permutation(count), weights / weights.sum()


def draws(order: np.ndarray, probabilities: np.ndarray, seed: int, chunk: int = 4096) -> Iterator[int]:
    """An endless stream of model indices drawn from the mix."""
    rng = np.random.default_rng(seed)
    while True:
        yield from order[rng.choice(len(order), size=chunk, p=probabilities)].tolist()


@dataclass
class Tally:
    """Every request: its model, when it was sent (s since the load began), latency, status, and whether its model
    was loaded when it came (None: the check failed)."""

    started: float = field(default_factory=time.perf_counter)
    models: list[int] = field(default_factory=list)
    sent_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    status: list[int] = field(default_factory=list)
    warm: list[bool | None] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)  # the first few 503 (UNAVAILABLE) messages
    failures: list[str] = field(default_factory=list)  # the first few failures, and why
    refusals_without_retry_after: int = 0
    replicas: list[tuple[int, str]] = field(default_factory=list)  # (model, the replica that answered), behind Ray

    def add(self, model: int, sent: float, status: int, warm: bool | None, detail: str = "") -> None:
        """Note one answer (`detail`: its message, kept for the first few refusals and failures)."""
        self.models.append(model)
        self.sent_s.append(sent - self.started)
        self.latency_s.append(time.perf_counter() - sent)
        self.status.append(status)
        self.warm.append(warm)
        kept = self.refusals if status == REFUSED else self.failures if status != OK else None
        if kept is not None and len(kept) < _KEPT_BODIES:
            kept.append(detail[:400])


def random_row(entry: ModelEntry, seed: int) -> np.ndarray:
    """One row of the model's input: standard normal values (pixel values 0..255 for the image models)."""
    row = np.random.default_rng(seed).standard_normal((1, *entry.input_shape)).astype("<f4")
    return (row * 40 + 128).clip(0, 255).astype("<f4") if entry.kind == "efficientnet" else row


def http_request(entry: ModelEntry, host: str, seed: int) -> bytes:
    """The readiness check and one V2 binary infer of one random row, as the bytes of two pipelined requests."""
    row = random_row(entry, seed)
    tensor = {"name": entry.input_name, "shape": list(row.shape), "datatype": "FP32",
              "parameters": {"binary_data_size": row.nbytes}}  # fmt: skip
    header = orjson.dumps({"inputs": [tensor], "parameters": {"binary_data_output": True}})
    body = header + row.tobytes()
    probe = f"GET /v2/models/{entry.name}/ready HTTP/1.1\r\nHost: {host}\r\n\r\n"
    infer = (f"POST /v2/models/{entry.name}/infer HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n"
             "Content-Type: application/octet-stream\r\n"
             f"Inference-Header-Content-Length: {len(header)}\r\n\r\n")  # fmt: skip
    return (probe + infer).encode() + body


async def _read_answer(reader: asyncio.StreamReader) -> tuple[int, bool, bytes, bytes]:
    """(status, whether it has Retry-After, body, head) of one HTTP/1.1 answer."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
    body = await reader.readexactly(int(length.group(1))) if length else b""
    return int(head[9:12]), re.search(rb"(?i)\r\nretry-after: *\d", head) is not None, body, head


def _header(head: bytes, name: str) -> bytes | None:
    """The value of one header of an answer's head (None: not there)."""
    found = re.search(rb"(?i)\r\n" + re.escape(name.encode()) + rb": *([^\r]*)", head)
    return found.group(1) if found else None


async def http_loop(
    host: str, port: int, requests: Sequence[bytes], mix: Iterator[int], stop_at: float, tally: Tally,
    replica_header: str | None = None,
) -> None:  # fmt: skip
    """One connection's closed loop: check and infer, again and again, until `stop_at` (perf_counter). Behind a
    proxy that sends each request to one of several replicas, `replica_header` names the header that says which
    answered (noted in `tally.replicas`): a request whose check and infer two replicas answered is told neither
    warm nor cold (None)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while (sent := time.perf_counter()) < stop_at:
            model = next(mix)
            writer.write(requests[model])
            try:
                ready, _, _, ready_head = await _read_answer(reader)
                status, retry_after, body, head = await _read_answer(reader)
            except (asyncio.IncompleteReadError, ConnectionError) as error:
                tally.add(model, sent, 0, None, f"connection: {error!r}")
                writer.close()
                reader, writer = await asyncio.open_connection(host, port)
                continue
            warm = {OK: True, REFUSED: False}.get(ready)
            if replica_header is not None:
                replica = _header(head, replica_header)
                tally.replicas.append((model, (replica or b"").decode()))
                if _header(ready_head, replica_header) != replica:
                    warm = None
            if status == REFUSED and not (retry_after and BUDGET_NAME in body):
                tally.refusals_without_retry_after += not retry_after
                status = 5030  # not the documented refusal (Retry-After, the budget named): a failure
            elif status == OK and b'"outputs"' not in body[:2000]:
                status = 2000  # a 200 without outputs: a failure
            tally.add(model, sent, status, warm, body[:400].decode(errors="replace"))
    finally:
        writer.close()


def grpc_requests(entries: Sequence[ModelEntry], seed: int) -> list[object]:
    """One ModelInferRequest of one random row per model."""
    from tritonclient.grpc import service_pb2

    messages = []
    for index, entry in enumerate(entries):
        row = random_row(entry, seed + index)
        request = service_pb2.ModelInferRequest(model_name=entry.name)
        request.inputs.add(name=entry.input_name, datatype="FP32", shape=row.shape)
        request.raw_input_contents.append(row.tobytes())
        messages.append(request)
    return messages


async def grpc_loop(
    target: str, entries: Sequence[ModelEntry], requests: Sequence[object], mix: Iterator[int], stop_at: float,
    tally: Tally,
) -> None:  # fmt: skip
    """One channel's closed loop (a connection of its own: so its worker's readiness): ModelReady, then ModelInfer.
    UNAVAILABLE naming the budget is the gRPC door's refusal (503, which has no Retry-After there)."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    options = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        while (sent := time.perf_counter()) < stop_at:
            model = next(mix)
            warm: bool | None = None
            try:
                answer = await stub.ModelReady(service_pb2.ModelReadyRequest(name=entries[model].name))
                warm = bool(answer.ready)
                sent = time.perf_counter()
                await stub.ModelInfer(requests[model])
            except grpc.aio.AioRpcError as error:
                code = error.code().value[0]
                details = error.details() or ""
                refused = code == _GRPC_UNAVAILABLE and BUDGET_NAME.decode() in details
                status = REFUSED if refused else 1000 + code  # any other status (or refusal) is a failure
                tally.add(model, sent, status, warm, f"{error.code().name}: {details}")
                continue
            tally.add(model, sent, OK, warm)


# --- Samplers ---------------------------------------------------------------------------------------------


def _memory_kb(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of a process in kB ((0, 0) once it is gone)."""
    values = {"Rss:": 0, "Pss:": 0}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, *rest = line.split()
            if key in values:
                values[key] = int(rest[0])
    return values["Rss:"], values["Pss:"]


@dataclass
class MemorySample:
    """The server's processes at one moment: RSS and PSS summed, in bytes, and by role (PSS)."""

    t_s: float
    rss_bytes: int
    pss_bytes: int
    by_role: dict[str, int]


def sample_memory(server: int, workers: bool, t_s: float) -> MemorySample:
    """The resident memory of the server (or supervisor) and every process below it."""
    rss = pss = 0
    by_role: dict[str, int] = {}
    for pid in [server, *descendants(server)]:
        process_rss, process_pss = (kb * 1024 for kb in _memory_kb(pid))
        role = role_of(pid, server, workers)
        rss, pss = rss + process_rss, pss + process_pss
        by_role[role] = by_role.get(role, 0) + process_pss
    return MemorySample(round(t_s, 2), rss, pss, by_role)


async def fetch_metrics(host: str, port: int) -> str:
    """The server's /metrics text."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(f"GET /metrics HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        _, _, body, _ = await _read_answer(reader)
    finally:
        writer.close()
    return body.decode()


def metric_sum(text: str, name: str, labels: str = "") -> float:
    """The sum of a metric's samples (those whose labels contain `labels`, e.g. `part="total"`)."""
    pattern = rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$"
    return sum(float(value) for found, value in re.findall(pattern, text, re.M) if labels in found)


def metric_by_model(text: str, name: str, labels: str = "") -> dict[str, float]:
    """A metric's samples summed per `model` label (those whose labels contain `labels`)."""
    by_model: dict[str, float] = {}
    for found, value in re.findall(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        model = re.search(r'model="([^"]*)"', found)
        if model and labels in found:
            by_model[model.group(1)] = by_model.get(model.group(1), 0.0) + float(value)
    return by_model
