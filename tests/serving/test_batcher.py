"""The batcher, driven deterministically: merging, full batches, oversize requests, errors, 503, 504."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from layerserve.errors import (
    BadRequestError,
    DeadlineExceededError,
    EngineProcessError,
    LayerserveError,
    QueueFullError,
)
from layerserve.serving.batcher import Batcher, QueueBudget
from layerserve.tensors import Array

pytestmark = pytest.mark.anyio


class GatedModel:
    """Doubles its input; each call records its batch size and waits for `gate` when one is set."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate = gate
        self.calls: list[int] = []
        self.started = threading.Event()

    def __call__(self, arrays: list[Array]) -> list[Array]:
        self.calls.append(arrays[0].shape[0])
        self.started.set()
        if self.gate is not None:
            self.gate.wait(timeout=30)
        return [arrays[0] * 2, arrays[0].sum(axis=1)]


def rows(start: int, count: int) -> list[Array]:
    return [np.arange(start, start + count * 3, dtype=np.float32).reshape(count, 3)]


def batcher(model: GatedModel, max_batch: int = 8, delay_s: float = 0.0, queue: int = 100) -> Batcher:
    return Batcher(model, ThreadPoolExecutor(1), max_batch, delay_s, QueueBudget(queue), ("m", "1"))


async def started(model: GatedModel) -> None:
    await asyncio.get_running_loop().run_in_executor(None, model.started.wait, 30)


def check(result: list[Array], sent: list[Array]) -> None:
    np.testing.assert_array_equal(result[0], sent[0] * 2)
    np.testing.assert_array_equal(result[1], sent[0].sum(axis=1))


async def test_concurrent_requests_share_one_call_and_get_their_own_rows() -> None:
    model = GatedModel()
    merger = batcher(model, delay_s=0.05)  # with a delay, a batch takes what is queued up to max_batch_size
    sent = [rows(100 * i, n) for i, n in enumerate([1, 3, 2])]
    results = await asyncio.gather(*(merger.submit(s, None) for s in sent))
    assert model.calls == [6]
    for result, arrays in zip(results, sent, strict=True):
        check(result, arrays)


async def test_a_batch_takes_half_the_unanswered_rows_so_the_next_is_queued_when_it_ends() -> None:
    # Eight clients, each sending its next request when answered: batches of 4, never 8, so that 4 requests wait
    # whenever a batch ends instead of the model waiting for the answers to go out and the requests to come back.
    model = GatedModel()
    slow = Batcher(
        lambda arrays: (time.sleep(0.01), model(arrays))[1], ThreadPoolExecutor(1), 8, 0.0, QueueBudget(100), ("m", "1")
    )

    async def client(start: int) -> None:
        for turn in range(6):
            sent = rows(start + 1000 * turn, 1)
            check(await slow.submit(sent, None), sent)

    await asyncio.gather(*(client(10 * i) for i in range(8)))
    assert sum(model.calls) == 48
    assert max(model.calls) == 4
    assert model.calls.count(4) >= 10  # burst start-up aside, every batch is 4 rows

    merger = batcher(GatedModel(), max_batch=4)
    lone = [rows(0, 3)]
    check(await merger.submit(lone[0], None), lone[0])  # one request alone still runs whole


class LaneModel:
    """`run_async` of a session with lanes: doubles its input; each call records its batch size, then waits until
    `finish` ends the oldest call still running."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.running: list[asyncio.Event] = []

    async def __call__(self, arrays: list[Array]) -> list[Array]:
        self.calls.append(arrays[0].shape[0])
        done = asyncio.Event()
        self.running.append(done)
        await done.wait()
        return [arrays[0] * 2, arrays[0].sum(axis=1)]

    async def settle(self) -> None:
        for _ in range(20):  # turns of the loop for the batcher and its callers to act
            await asyncio.sleep(0)

    async def finish(self) -> None:
        self.running.pop(0).set()
        await self.settle()


async def test_two_lanes_run_two_batches_at_once_each_with_its_share_of_the_rows() -> None:
    model = LaneModel()
    lanes = Batcher(
        model, ThreadPoolExecutor(1), 8, 0.0, QueueBudget(100), ("m", "1"), run_async=model, lanes=2
    )  # fmt: skip
    # Eight clients: half the rows run, in two batches of two at once (one lane: one batch of four).
    sent = [rows(10 * i, 1) for i in range(8)]
    tasks = [asyncio.create_task(lanes.submit(arrays, None)) for arrays in sent]
    await model.settle()
    assert model.calls == [2, 2] and len(model.running) == 2
    while model.running:
        await model.finish()
    for task, arrays in zip(tasks, sent, strict=True):
        check(await task, arrays)
    assert sum(model.calls) == 8 and max(model.calls) == 2 and lanes.is_idle

    # A lane is free, but one row is under the next batch's share of the rows not answered (a quarter of 9, rounded
    # up: 3): it waits for more instead of running a batch of one beside the other; with three rows, it runs.
    model.calls.clear()
    big, one, two = rows(0, 8), rows(100, 1), rows(200, 2)
    tasks = [asyncio.create_task(lanes.submit(big, None))]
    await model.settle()
    tasks.append(asyncio.create_task(lanes.submit(one, None)))
    await model.settle()
    assert model.calls == [8]
    tasks.append(asyncio.create_task(lanes.submit(two, None)))
    await model.settle()
    assert model.calls == [8, 3] and len(model.running) == 2
    while model.running:
        await model.finish()
    for task, arrays in zip(tasks, (big, one, two), strict=True):
        check(await task, arrays)
    assert lanes.is_idle


async def test_requests_queued_while_busy_form_the_next_batch() -> None:
    gate = threading.Event()
    model = GatedModel(gate)
    merger = batcher(model, max_batch=4)
    first = asyncio.create_task(merger.submit(rows(0, 1), None))
    await started(model)
    sent = [rows(10 * i, n) for i, n in enumerate([2, 2, 1, 3], start=1)]
    waiting = [asyncio.create_task(merger.submit(s, None)) for s in sent]
    await asyncio.sleep(0)
    gate.set()
    results = await asyncio.gather(first, *waiting)
    assert model.calls == [1, 4, 4]  # 2+2 fill a batch of 4; then 1+3
    for result, arrays in zip(results[1:], sent, strict=True):
        check(result, arrays)


async def test_an_inline_batch_waits_one_turn_for_requests_read_by_the_next_poll() -> None:
    # A's task queues on turn 1; B's is created on turn 1 (as data_received creates a request's task when the
    # loop's poll reads its bytes) and queues on turn 2; C's a turn later still.
    model = GatedModel()
    merger = Batcher(model, ThreadPoolExecutor(1), 8, 0.0, QueueBudget(100), ("m", "1"), is_inline=True)
    loop = asyncio.get_running_loop()
    sent = [rows(0, 1), rows(3, 1), rows(6, 1)]
    tasks: list[asyncio.Future[list[Array]]] = []

    def submit(arrays: list[Array]) -> None:
        tasks.append(asyncio.ensure_future(merger.submit(arrays, None)))

    submit(sent[0])
    loop.call_soon(submit, sent[1])
    loop.call_soon(loop.call_soon, submit, sent[2])
    await asyncio.sleep(0.01)
    results = await asyncio.gather(*tasks)
    assert model.calls == [2, 1]  # B joined A's batch; the batch waited one turn, not two
    for result, arrays in zip(results, sent, strict=True):
        check(result, arrays)


async def test_full_batch_goes_at_once_and_delay_merges_stragglers() -> None:
    model = GatedModel()
    merger = batcher(model, max_batch=4, delay_s=30.0)
    await asyncio.wait_for(asyncio.gather(merger.submit(rows(0, 2), None), merger.submit(rows(6, 2), None)), 10)
    assert model.calls == [4]
    patient = batcher(model, max_batch=8, delay_s=0.2)
    first = asyncio.create_task(patient.submit(rows(0, 1), None))
    await asyncio.sleep(0.01)
    await asyncio.gather(first, patient.submit(rows(3, 1), None))
    assert model.calls == [4, 2]


async def test_larger_than_max_batch_runs_alone() -> None:
    model = GatedModel()
    merger = batcher(model, max_batch=4)
    big, small = rows(0, 6), rows(50, 2)
    results = await asyncio.gather(merger.submit(big, None), merger.submit(small, None))
    assert model.calls == [6, 2]
    check(results[0], big)
    check(results[1], small)


async def test_errors_reach_every_caller_of_the_batch() -> None:
    def broken(arrays: list[Array]) -> list[Array]:
        raise LayerserveError("the model broke")

    merger = Batcher(broken, ThreadPoolExecutor(1), 8, 0.0, QueueBudget(10), ("m", "1"))
    results = await asyncio.gather(*(merger.submit(rows(0, 1), None) for _ in range(3)), return_exceptions=True)
    assert [str(r) for r in results] == ["the model broke"] * 3

    def wrong_rows(arrays: list[Array]) -> list[Array]:
        return [np.zeros((1, 2))]

    merger = Batcher(wrong_rows, ThreadPoolExecutor(1), 8, 0.0, QueueBudget(10), ("m", "1"))
    with pytest.raises(LayerserveError, match=r"shape \[1, 2\] for a batch of 2 rows"):
        await merger.submit(rows(0, 2), None)


class PoisonedModel(GatedModel):
    """A GatedModel whose every call fails when any row holds the marker value, as a bad input fails ORT."""

    MARKER = -1.0

    def __call__(self, arrays: list[Array]) -> list[Array]:
        results = super().__call__(arrays)
        if (arrays[0] == self.MARKER).any():
            raise RuntimeError("Gather node: indices element out of data bounds")
        return results


@pytest.mark.parametrize("bad_count", [1, 2])
async def test_a_failing_request_fails_alone_and_its_batch_mates_get_their_rows(bad_count: int) -> None:
    rng = np.random.default_rng(bad_count)
    for _ in range(10):
        gate = threading.Event()
        model = PoisonedModel(gate)
        merger = batcher(model, max_batch=32, delay_s=0.001)  # a delay: batches up to max_batch, not half
        first = asyncio.ensure_future(merger.submit(rows(0, 1), None))
        await started(model)  # the model thread is busy: the next 25 requests queue up and form one batch
        sent = [rows(1000 * i, 1) for i in range(24 + bad_count)]
        bad = set(rng.choice(len(sent), bad_count, replace=False).tolist())
        for index in bad:
            sent[index][0][0, 1] = PoisonedModel.MARKER
        waiting = [asyncio.ensure_future(merger.submit(arrays, None)) for arrays in sent]
        gate.set()
        results = await asyncio.gather(*waiting, return_exceptions=True)
        check(await first, rows(0, 1))
        assert model.calls[:2] == [1, len(sent)]  # one batch of all of them failed, then it was split
        for index, (result, arrays) in enumerate(zip(results, sent, strict=True)):
            if index in bad:
                assert isinstance(result, RuntimeError), result
            else:
                assert isinstance(result, list), (index, result)
                check(result, arrays)
        assert len(model.calls) <= 2 + 2 * bad_count * int(np.ceil(np.log2(len(sent)))) + 2


def refuse_negative_rows(arrays: list[Array]) -> None:
    """A check of a batch's rows (as RequestChecks.index_check gives one): no negative value."""
    if (arrays[0] < 0).any():
        row = int(np.argwhere(arrays[0] < 0)[0][0])
        raise BadRequestError(f"negative value in row {row} of {arrays[0].shape[0]}")


@pytest.mark.parametrize(("inline", "delay_s"), [(False, 0.05), (True, 0.0)])  # a task's batch, a callback's
async def test_rows_the_check_refuses_fail_alone_named_in_their_own_request_and_are_never_computed(
    inline: bool, delay_s: float
) -> None:
    model = GatedModel()
    merger = Batcher(
        model, ThreadPoolExecutor(1), 8, delay_s, QueueBudget(100), ("m", "1"), is_inline=inline,
        check_rows=refuse_negative_rows,
    )  # fmt: skip
    sent = [rows(3 * i, 2) for i in range(4)]
    sent[2][0][1, 0] = -1.0  # the third request's second row
    results = await asyncio.gather(*(merger.submit(s, None) for s in sent), return_exceptions=True)
    error = results[2]
    assert isinstance(error, BadRequestError) and error.message == "negative value in row 1 of 2", error
    assert model.calls == [6]  # one call for the three others, the refused rows never computed
    for index in (0, 1, 3):
        check(results[index], sent[index])  # type: ignore[arg-type]
    assert await merger.submit(rows(0, 1), None) and model.calls == [6, 1]  # a batch that passes: one check


async def test_an_engine_that_is_gone_fails_the_whole_batch_at_once() -> None:
    gate = threading.Event()
    calls: list[int] = []
    first_started = threading.Event()

    def gone(arrays: list[Array]) -> list[Array]:
        calls.append(arrays[0].shape[0])
        if len(calls) == 1:
            first_started.set()
            gate.wait(timeout=30)
            return [arrays[0] * 2, arrays[0].sum(axis=1)]
        raise EngineProcessError("the engine process of model m version 1 was killed by SIGKILL")

    merger = Batcher(gone, ThreadPoolExecutor(1), 8, 0.001, QueueBudget(10), ("m", "1"))
    first = asyncio.ensure_future(merger.submit(rows(0, 1), None))
    await asyncio.get_running_loop().run_in_executor(None, first_started.wait, 30)
    waiting = [asyncio.ensure_future(merger.submit(rows(0, 1), None)) for _ in range(4)]
    gate.set()
    results = await asyncio.gather(*waiting, return_exceptions=True)
    check(await first, rows(0, 1))
    assert all(isinstance(r, EngineProcessError) for r in results), results
    assert calls == [1, 4]  # not split and run again


async def test_queue_full_is_503() -> None:
    gate = threading.Event()
    model = GatedModel(gate)
    merger = batcher(model, queue=2)
    running = asyncio.create_task(merger.submit(rows(0, 1), None))
    await started(model)
    queued = [asyncio.create_task(merger.submit(rows(3, 1), None)) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(QueueFullError, match=r"full \(2 requests\)") as error:
        await merger.submit(rows(6, 1), None)
    assert error.value.status_code == 503
    gate.set()
    await asyncio.gather(running, *queued)
    assert model.calls == [1, 2]


async def test_expired_requests_get_504_and_are_never_computed() -> None:
    gate = threading.Event()
    model = GatedModel(gate)
    merger = batcher(model)
    running = asyncio.create_task(merger.submit(rows(0, 1), None))
    await started(model)
    with pytest.raises(DeadlineExceededError) as error:
        await merger.submit(rows(3, 5), time.perf_counter() + 0.05)
    assert error.value.status_code == 504
    later = asyncio.create_task(merger.submit(rows(30, 2), None))
    await asyncio.sleep(0)
    gate.set()
    await asyncio.gather(running, later)
    assert model.calls == [1, 2]  # the expired 5 rows never reached the model
