"""Engine processes: ONNX Runtime sessions of big graphs in processes of their own, their arrays through shared
memory, their processes kept for the next session, and a killed one failing its version only."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import uvloop

from layerserve.engines.base import probe_batch
from layerserve.engines.onnx import OnnxEngine, export_and_verify
from layerserve.engines.process.channel import Channel
from layerserve.engines.process.engine import ProcessOnnxEngine
from layerserve.engines.process.pool import EngineProcessPool
from layerserve.errors import EngineProcessError, ModelLoadError
from layerserve.lifecycle.model import file_digest, read_signature
from layerserve.settings import Settings
from tests.live_server import is_running, start_server, wait_until
from tests.models import build_mlp, build_multi, load_reference, save_model


@pytest.fixture
def multi_graph(tmp_path: Path) -> tuple[object, Path]:
    """The two-input, two-output model and its verified ONNX export."""
    model = build_multi()
    inputs = read_signature(model).inputs
    graph = tmp_path / "multi.onnx"
    assert export_and_verify(model, inputs, graph, probe_batch(inputs, 2)).max_difference is not None
    return model, graph


@pytest.fixture
def pool() -> Iterator[EngineProcessPool]:
    """An engine-process pool that takes every graph; its idle processes are stopped after the test."""
    processes = EngineProcessPool(0)
    yield processes
    processes.stop_idle()


def _resident_bytes(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_arrays_of_every_kind_cross_the_channel_unchanged() -> None:
    ours, theirs = multiprocessing.Pipe()
    sender, receiver = Channel(ours), Channel(theirs)
    rng = np.random.default_rng(5)
    for rows in (3, 400, 2_000):  # all inline, then through shared memory, then a grown buffer
        arrays = [
            rng.normal(size=(rows, 64)).astype(np.float32).T,  # not contiguous
            rng.integers(-(2**40), 2**40, (rows, 8)),
            rng.normal(size=(rows, 33)).astype(np.float16),
            rng.integers(0, 2, (rows, 40)).astype(bool),
            np.array([b"a", b"\x00bytes"] * rows, dtype=object).reshape(rows, 2),
            np.zeros((0, 7), np.float64),
            np.float32(2.5).reshape(()),
        ]
        sender.send_arrays(arrays)
        tag, received = receiver.receive(copy=True)
        assert tag == "arrays" and len(received) == len(arrays)
        for sent, got in zip(arrays, received, strict=True):
            assert got.dtype == sent.dtype and got.shape == sent.shape
            np.testing.assert_array_equal(got, sent)
    ours.close()
    theirs.close()


@pytest.fixture
def engines(
    multi_graph: tuple[object, Path], pool: EngineProcessPool
) -> Iterator[tuple[object, OnnxEngine, ProcessOnnxEngine]]:
    """The `multi` Keras model, its graph on ONNX Runtime in process, and the same graph in an engine process."""
    model, graph = multi_graph
    inputs = read_signature(model).inputs
    remote = ProcessOnnxEngine(pool, graph, inputs, 1, 2)
    yield model, OnnxEngine(graph, inputs, 1), remote
    remote.close()


def test_process_engine_equals_the_in_process_engine_and_keras(
    engines: tuple[object, OnnxEngine, ProcessOnnxEngine],
) -> None:
    model, local, remote = engines
    rng = np.random.default_rng(0)
    # 7 rows travel inside the message; 30,000 rows (480 KB of features) through shared memory, which
    # then grows for 90,000.
    for rows in (7, 30_000, 90_000, 3):
        batch = [rng.normal(size=(rows, 4)).astype(np.float32), rng.integers(0, 10, (rows, 3)).astype(np.int32)]
        got = remote.run(batch)
        for mine, theirs in zip(got, local.run(batch), strict=True):
            np.testing.assert_array_equal(mine, theirs)
            assert mine.flags.writeable and mine.flags.owndata  # a copy: the buffer is reused
        for mine, keras_value in zip(got, model(batch), strict=True):  # type: ignore[operator]
            np.testing.assert_allclose(mine, np.asarray(keras_value), atol=1e-5)
    with pytest.raises(RuntimeError, match=r"tokens|features|Got invalid dimensions"):
        remote.run([np.zeros((2, 5), np.float32), np.zeros((2, 3), np.int32)])  # ORT's own message
    np.testing.assert_array_equal(remote.run(batch)[1], local.run(batch)[1])  # still serving


def test_a_batch_sent_from_the_event_loop_equals_run_also_after_a_cancelled_caller(
    engines: tuple[object, OnnxEngine, ProcessOnnxEngine],
) -> None:
    _, local, remote = engines
    rng = np.random.default_rng(1)
    small, large, other = (
        [rng.normal(size=(rows, 4)).astype(np.float32), rng.integers(0, 10, (rows, 3)).astype(np.int32)]
        for rows in (5, 30_000, 3)
    )

    def assert_answers(batch: list[np.ndarray], got: list[np.ndarray]) -> None:
        for mine, theirs in zip(got, local.run(batch), strict=True):
            np.testing.assert_array_equal(mine, theirs)

    async def scenario() -> None:
        for batch in (small, large):  # inside the message, then through shared memory
            assert_answers(batch, await remote.run_async(batch))
        # A caller cancelled while its batch computes: its answer is still read, so the next calls get their own;
        # they come while it holds the session, so they wait for it on a thread, one after the other.
        cancelled = asyncio.ensure_future(remote.run_async(large))
        await asyncio.sleep(0)
        cancelled.cancel()
        first, second = await asyncio.gather(remote.run_async(small), remote.run_async(other))
        assert cancelled.cancelled()
        assert_answers(small, first)
        assert_answers(other, second)
        with pytest.raises(RuntimeError, match=r"tokens|features|Got invalid dimensions"):
            await remote.run_async([np.zeros((2, 5), np.float32), np.zeros((2, 3), np.int32)])
        assert_answers(other, await remote.run_async(other))

    uvloop.run(scenario())  # the server's loop, whose add_reader makes the socket non-blocking
    assert_answers(large, remote.run(large))  # and `run` (blocking) still reads whole answers after it


class _NoExecutorLoop(asyncio.SelectorEventLoop):
    """An event loop on which nothing may wait on a thread."""

    def run_in_executor(self, *args: object) -> asyncio.Future[object]:  # type: ignore[override]
        raise AssertionError("a call waited on a thread for a lane")


def test_batches_sent_at_once_run_side_by_side_on_the_sessions_lanes(multi_graph: tuple[object, Path]) -> None:
    model, graph = multi_graph
    inputs = read_signature(model).inputs
    pool = EngineProcessPool(0, lanes=2)
    remote, local = ProcessOnnxEngine(pool, graph, inputs, 1, 2), OnnxEngine(graph, inputs, 1)
    pid = remote.pid
    rng = np.random.default_rng(2)
    batches = [
        [rng.normal(size=(rows, 4)).astype(np.float32), rng.integers(0, 10, (rows, 3)).astype(np.int32)]
        for rows in (5, 30_000)  # inside the message, and through shared memory
    ]

    async def scenario() -> list[list[np.ndarray]]:
        # Each call on a lane of its own; with one lane the second would wait for the first on a thread.
        return list(await asyncio.gather(*(remote.run_async(batch) for batch in batches)))

    try:
        for _ in range(3):
            with asyncio.Runner(loop_factory=_NoExecutorLoop) as runner:
                answers = runner.run(scenario())
            for batch, answer in zip(batches, answers, strict=True):
                for mine, theirs in zip(answer, local.run(batch), strict=True):
                    np.testing.assert_array_equal(mine, theirs)
        assert remote.lanes == 2
    finally:
        remote.close()  # the lanes' threads end before the session is freed
        pool.stop_idle()
    assert pid is not None and not is_running(pid)


def test_a_call_with_every_lane_busy_takes_the_first_to_free(multi_graph: tuple[object, Path]) -> None:
    model, graph = multi_graph
    inputs = read_signature(model).inputs
    pool = EngineProcessPool(0, lanes=2)
    engine = ProcessOnnxEngine(pool, graph, inputs, 1, 1)
    first, second = engine._take_lane(wait=False), engine._take_lane(wait=False)  # as two batches computing
    assert first is not None and second is not None and engine._take_lane(wait=False) is None
    answers: list[list[np.ndarray]] = []
    caller = threading.Thread(target=lambda: answers.append(engine.run(probe_batch(inputs, 2))))
    try:
        caller.start()
        time.sleep(0.2)
        assert not answers  # it waits
        engine._give_back(second)  # the second lane frees first, while the first stays busy
        caller.join(30)
        assert answers and answers[0][1].shape == (2, 5)  # it ran on the second lane (it waited on the first before)
    finally:
        engine._give_back(first)
        caller.join(30)
        engine.close()
        pool.stop_idle()


def test_a_closing_engine_refuses_a_call_on_a_free_lane_and_its_process_serves_on(
    multi_graph: tuple[object, Path],
) -> None:
    # close() waits for the batch on the first lane, having closed the second's connection: a call then took the
    # second lane, failed on its closed connection, and was taken for the process gone, which was stopped with
    # every other session in it.
    model, graph = multi_graph
    inputs = read_signature(model).inputs
    pool = EngineProcessPool(0, max_processes=1, lanes=2)
    closing, neighbour = ProcessOnnxEngine(pool, graph, inputs, 1, 1), ProcessOnnxEngine(pool, graph, inputs, 1, 1)
    pid = closing.pid
    first_lane, second_lane = closing._lanes
    assert closing._take_lane(wait=False) is first_lane  # as a batch computing on the first lane holds it
    closer = threading.Thread(target=closing.close)
    try:
        closer.start()
        for _ in range(1000):
            if closing.pid is None or second_lane.channel.connection.closed:
                break
            time.sleep(0.01)
        with pytest.raises(EngineProcessError, match="is closed"):
            closing.run(probe_batch(inputs, 2))
    finally:
        closing._give_back(first_lane)  # the batch ends: close() goes on
        closer.join(30)
    assert not closer.is_alive() and is_running(pid)  # type: ignore[arg-type]
    try:
        assert neighbour.pid == pid and neighbour.run(probe_batch(inputs, 2))[1].shape == (2, 5)
    finally:
        neighbour.close()
        pool.stop_idle()


def test_a_closed_engines_process_is_kept_for_the_next_one(
    multi_graph: tuple[object, Path], pool: EngineProcessPool
) -> None:
    _, graph = multi_graph
    inputs = read_signature(build_multi()).inputs
    first = ProcessOnnxEngine(pool, graph, inputs, 1, 1)
    pid = first.pid
    assert pid is not None and is_running(pid)
    assert pool.usage()[1] > 10_000_000  # its resident memory counts as the server's
    first.close()
    assert first.pid is None and is_running(pid)  # kept, without a session
    engines = [ProcessOnnxEngine(pool, graph, inputs, 1, 1) for _ in range(3)]
    pids = [engine.pid for engine in engines]
    assert pids[0] == pid and len(set(pids)) == 3 and None not in pids  # the kept one, then two new ones
    for engine in engines:
        engine.close()
    running = [other for other in pids if other is not None and is_running(other)]
    assert len(running) == 2  # two are kept; the third stopped
    pool.stop_idle()
    assert not any(is_running(other) for other in running)


def test_sessions_share_a_process_up_to_the_pools_size_and_compute_side_by_side(
    multi_graph: tuple[object, Path],
) -> None:
    model, graph = multi_graph
    inputs = read_signature(model).inputs
    pool = EngineProcessPool(0, max_processes=2)
    engines = [ProcessOnnxEngine(pool, graph, inputs, 1, 1) for _ in range(3)]
    try:
        pids = [engine.pid for engine in engines]
        assert len(set(pids)) == 2 and pool.process_count == 2  # the third session joins the emptier process
        assert all(engine.session_bytes > 0 for engine in engines)  # what opening it added to its process
        for pid in set(pids):  # the process's memory, shared out between its sessions
            held = [engine.resident() for engine in engines if engine.pid == pid]
            assert sum(session + share for session, share in held) == pytest.approx(_resident_bytes(pid), rel=0.05)
        rng = np.random.default_rng(1)
        batches = [
            [rng.normal(size=(rows, 4)).astype(np.float32), rng.integers(0, 10, (rows, 3)).astype(np.int32)]
            for rows in (5, 40_000, 9)
        ]
        expected = [[np.asarray(value) for value in model(batch)] for batch in batches]  # type: ignore[operator]

        def served(engine: ProcessOnnxEngine) -> None:
            for _ in range(5):
                for batch, outputs in zip(batches, expected, strict=True):
                    for got, want in zip(engine.run(batch), outputs, strict=True):
                        np.testing.assert_allclose(got, want, atol=1e-5)

        with ThreadPoolExecutor(3) as threads:  # the sessions of one process answer at the same time
            list(threads.map(served, engines))
        shared = next(pid for pid in pids if pids.count(pid) == 2)
        first = pids.index(shared)
        engines[first].close()  # its neighbour in the process serves on
        neighbour = engines[pids.index(shared, first + 1)]
        served(neighbour)
        neighbour.close()
        assert is_running(shared) and pool.idle_count == 1  # without sessions: kept for the next one
    finally:
        for engine in engines:
            engine.close()
        pool.stop_idle()
    assert pool.process_count == 0 and not any(is_running(pid) for pid in pids if pid is not None)


def test_a_killed_shared_process_fails_every_session_in_it(multi_graph: tuple[object, Path]) -> None:
    _, graph = multi_graph
    inputs = read_signature(build_multi()).inputs
    pool = EngineProcessPool(0, max_processes=1)
    first, second = ProcessOnnxEngine(pool, graph, inputs, 1, 1), ProcessOnnxEngine(pool, graph, inputs, 1, 1)
    assert first.pid is not None and first.pid == second.pid
    os.kill(first.pid, signal.SIGKILL)
    with pytest.raises(EngineProcessError, match="killed by SIGKILL"):
        uvloop.run(first.run_async(probe_batch(inputs, 2)))  # sent from the event loop
    with pytest.raises(EngineProcessError, match="killed by SIGKILL"):
        second.run(probe_batch(inputs, 2))
    for engine in (first, second):
        engine.close()
    assert pool.process_count == 0
    replacement = ProcessOnnxEngine(pool, graph, inputs, 1, 1)  # a new process for the next session
    try:
        assert replacement.run(probe_batch(inputs, 2))[1].shape == (2, 5)
    finally:
        replacement.close()
        pool.stop_idle()


_SERVER = """
import json, sys, time
from pathlib import Path
from layerserve.engines.process.engine import ProcessOnnxEngine
from layerserve.engines.process.pool import EngineProcessPool
from layerserve.tensors import TensorSpec
inputs = tuple(TensorSpec.from_dict(spec) for spec in json.loads(sys.argv[2]))
print(ProcessOnnxEngine(EngineProcessPool(0), Path(sys.argv[1]), inputs, 1, 1).pid, flush=True)
time.sleep(600)
"""


def test_an_engine_process_exits_when_its_server_is_killed(multi_graph: tuple[object, Path]) -> None:
    model, graph = multi_graph
    specs = json.dumps([spec.to_dict() for spec in read_signature(model).inputs])
    command = [sys.executable, "-c", _SERVER, str(graph), specs]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as server:
        assert server.stdout is not None
        child = int(server.stdout.readline())
        assert child != server.pid and is_running(child)
        os.kill(server.pid, signal.SIGKILL)
        server.wait(timeout=10)
    wait_until(lambda: not is_running(child), "the engine process ends with its server", 15)


def test_an_unreadable_graph_is_a_load_error(
    tmp_path: Path, multi_graph: tuple[object, Path], pool: EngineProcessPool
) -> None:
    _, graph = multi_graph
    inputs = read_signature(build_multi()).inputs
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"not a protobuf at all" * 100)
    with pytest.raises(ModelLoadError, match=r"ONNX Runtime could not open garbage\.onnx"):
        ProcessOnnxEngine(pool, garbage, inputs, 1, 1)
    engine = ProcessOnnxEngine(pool, graph, inputs, 1, 1)  # the process that refused it opens the next one
    try:
        assert engine.run(probe_batch(inputs, 2))[1].shape == (2, 5)
    finally:
        engine.close()


def test_a_killed_engine_process_fails_its_version_only_and_a_load_restarts_it(tmp_path: Path) -> None:
    for name, seed in (("big", 1), ("other", 2)):
        save_model(build_mlp(seed), tmp_path / "repo" / name / "1", "model.keras")
    settings = Settings(
        model_repository=tmp_path / "repo", engine_cache_dir=tmp_path / "cache", reload_interval_s=0,
        engine_process_min_mb=0,
    )  # fmt: skip
    x = np.random.default_rng(3).normal(size=(4, 10)).astype(np.float32)
    body = {"inputs": [{"name": "x", "shape": [4, 10], "datatype": "FP32", "data": x.ravel().tolist()}]}
    expected = np.asarray(load_reference(tmp_path / "repo", "big", 1)(x))
    live = start_server(settings)
    try:

        def infer(model: str) -> httpx.Response:
            return httpx.post(f"{live.url}/v2/models/{model}/infer", json=body, timeout=30)

        def served() -> np.ndarray:
            response = infer("big")
            assert response.status_code == 200, response.text
            return np.asarray(response.json()["outputs"][0]["data"], np.float32).reshape(expected.shape)

        np.testing.assert_allclose(served(), expected, atol=1e-5)
        memory = httpx.get(f"{live.url}/v2/models/big").json()["memory"]
        assert memory["session_bytes"] > 0 and memory["process_share_bytes"] > 0, memory  # in its engine process
        assert memory["total_bytes"] == sum(value for part, value in memory.items() if part != "total_bytes")
        deadline = time.monotonic() + 10  # /metrics has it once the sampler has run (every second)
        while 'layerserve_version_memory_bytes{model="big",part="session",version="1"}' not in (
            metrics := httpx.get(f"{live.url}/metrics").text
        ):
            assert time.monotonic() < deadline, metrics
            time.sleep(0.2)
        reason = httpx.get(f"{live.url}/v2/models/big").json()["engine_reason"]
        found = re.search(r"runs in engine process (\d+)", reason)
        assert found, reason
        os.kill(int(found.group(1)), signal.SIGKILL)
        broken = infer("big")
        assert broken.status_code == 503 and "killed by SIGKILL" in broken.json()["error"]
        assert infer("big").status_code == 503  # FAILED now, not READY
        assert infer("other").status_code == 200  # the other model's process serves on
        index = {item["name"]: item for item in httpx.post(f"{live.url}/v2/repository/index").json()}
        assert index["big"]["state"] == "FAILED" and "load the model again" in index["big"]["reason"]
        assert httpx.post(f"{live.url}/v2/repository/models/big/load", timeout=60).status_code == 200
        np.testing.assert_allclose(served(), expected, atol=1e-5)
    finally:
        live.stop()


def test_big_model_files_are_hashed_in_an_engine_process(tmp_path: Path) -> None:
    model_file = tmp_path / "model.keras"
    model_file.write_bytes(np.random.default_rng(0).bytes(3_000_000))
    here = file_digest(model_file)
    small, big = EngineProcessPool(10_000_000), EngineProcessPool(1_000_000)
    try:
        assert small.digest(model_file) == here and small.usage()[1] == 0  # under its threshold: hashed here
        assert big.digest(model_file) == here  # over it: in an engine process, the same digest
        assert big.usage()[1] > 0  # that process is kept for the session that follows
    finally:
        big.stop_idle()
    model_file.unlink()
    with pytest.raises(FileNotFoundError):
        small.digest(model_file)
    folder = tmp_path / "saved"
    (folder / "variables").mkdir(parents=True)
    (folder / "saved_model.pb").write_bytes(b"graph")
    assert EngineProcessPool(0).digest(folder) == file_digest(folder)  # a SavedModel folder is hashed here


def test_a_freed_sessions_share_of_the_arena_goes_back_with_the_next_batch(multi_graph: tuple[object, Path]) -> None:
    model, graph = multi_graph
    inputs = read_signature(model).inputs
    pool = EngineProcessPool(0, max_processes=1)
    big, small = ProcessOnnxEngine(pool, graph, inputs, 1, 1), ProcessOnnxEngine(pool, graph, inputs, 1, 1)
    try:
        pid = big.pid
        assert pid is not None and small.pid == pid  # one process, one arena for both sessions
        rng = np.random.default_rng(2)

        def batch(rows: int) -> list[np.ndarray]:
            return [rng.normal(size=(rows, 4)).astype(np.float32), rng.integers(0, 10, (rows, 3)).astype(np.int32)]

        before = _resident_bytes(pid)
        big.run(batch(1_000_000))  # its activations grow the shared arena by some 100 MB
        grown = _resident_bytes(pid) - before
        assert grown > 50_000_000, grown
        big.close()
        kept = _resident_bytes(pid) - before
        assert kept > grown / 2, (grown, kept)  # freeing the session leaves the arena as it was
        small_batch = batch(3)
        expected = [np.asarray(value) for value in model(small_batch)]  # type: ignore[operator]
        for got, want in zip(small.run(small_batch), expected, strict=True):  # the next batch shrinks it
            np.testing.assert_allclose(got, want, atol=1e-5)
        wait_until(lambda: _resident_bytes(pid) - before < grown / 4, "the arena given back", 10)
    finally:
        big.close()
        small.close()
        pool.stop_idle()
