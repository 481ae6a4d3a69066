"""Batcher: merges concurrent requests for one version and input/output set into one model call."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from layerserve import metrics
from layerserve.errors import (
    BadRequestError,
    DeadlineExceededError,
    EngineProcessError,
    LayerserveError,
    QueueFullError,
)
from layerserve.serving.statistics import VersionStatistics
from layerserve.tensors import Array
from layerserve.tracing import CURRENT, trace_batch

if TYPE_CHECKING:
    from opentelemetry.trace import Span

RunBatch = Callable[[list[Array]], list[Array]]
RunBatchAsync = Callable[[list[Array]], Awaitable[list[Array]]]


@dataclass
class QueueBudget:
    """How many requests may wait for one version, across all its batchers."""

    limit: int
    queued: int = 0


class _Pending:
    """One queued request: its arrays, their rows, the future its caller awaits, when it was queued, and its trace
    (None when it is not traced)."""

    __slots__ = ("arrays", "enqueued", "future", "rows", "trace")

    def __init__(self, arrays: list[Array], rows: int, future: asyncio.Future[list[Array]]) -> None:
        self.arrays, self.rows, self.future = arrays, rows, future
        self.enqueued = time.perf_counter()
        self.trace = CURRENT.get()


class Batcher:
    """Concatenates queued requests along the batch axis up to `max_batch_size` rows per model call.

    A batch is sent when the model thread is free and either the queue holds a full batch or the
    oldest request has waited `max_delay_s` (0: at once). A request larger than `max_batch_size`
    runs alone. Off the loop with no delay, a batch holds at most half the rows not yet answered (`_limit`).
    Every caller gets exactly its own rows back, or the error its own rows cause. With
    `is_inline`, batches run on the event loop itself: for models so fast that the hop to the model
    thread would cost more than the call; with no `max_delay_s`, such a batcher is a callback on a later turn of
    the loop (see `_flush_inline`), not a task. With `run_async`, batches are sent from the event loop instead of the
    model thread (an engine process's session: the answer wakes the loop directly), up to `lanes` batches at once
    (see `_lane_is_due`). With `check_rows`, a batch's
    joined arrays are checked before the call, and a request whose own rows fail it is refused alone.
    """

    def __init__(
        self,
        run: RunBatch,
        thread: Executor,
        max_batch_size: int,
        max_delay_s: float,
        budget: QueueBudget,
        labels: tuple[str, str],
        is_inline: bool = False,
        statistics: VersionStatistics | None = None,
        run_async: RunBatchAsync | None = None,
        check_rows: Callable[[list[Array]], None] | None = None,
        lanes: int = 1,
    ) -> None:
        self._run = run
        self._check_rows = check_rows
        self._run_async = run_async
        self._is_inline = is_inline
        self._statistics = statistics
        self._thread = thread
        self._max_batch_size = max(1, max_batch_size)
        self._max_delay_s = max_delay_s
        self._budget = budget
        self._labels = labels
        self._batch_size_metric = metrics.BATCH_SIZE.labels(*labels)
        self._queue_metric = metrics.QUEUE_SECONDS.labels(*labels)
        self._compute_metric = metrics.COMPUTE_SECONDS.labels(*labels)
        self._isolations_metric = metrics.BATCH_ISOLATIONS.labels(*labels)
        self._cancelled_metric = metrics.REQUESTS_CANCELLED.labels(*labels)
        self._queue: deque[_Pending] = deque()
        self._rows = 0
        self._unanswered = 0  # rows submitted whose callers have not resumed yet (queued, running or answered)
        self._full = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._flush_scheduled = False
        self._waited_a_turn = False  # (inline) the scheduled flush has waited its one turn (see _flush_inline)
        self._lanes = lanes if run_async is not None else 1
        self._in_flight = 0  # (lanes) batches computing now
        self._more = asyncio.Event()  # (lanes) rows came, or a batch ended, while one computes
        self._computing: set[asyncio.Task[None]] = set()

    @property
    def is_idle(self) -> bool:
        """Whether nothing is queued or running (the batcher can be dropped)."""
        return self._task is None and not self._flush_scheduled and not self._in_flight

    async def submit(self, arrays: list[Array], deadline: float | None) -> list[Array]:
        """Queue one request's arrays (same first dimension) and wait for its rows of the outputs.

        Raises:
            QueueFullError: the version's queue is full (503).
            DeadlineExceededError: the deadline (a `time.perf_counter` value) passed first (504).
        """
        if self._budget.queued >= self._budget.limit:
            raise QueueFullError(f"the queue of model {self._labels[0]} is full ({self._budget.limit} requests)")
        loop = asyncio.get_running_loop()
        pending = _Pending(arrays, arrays[0].shape[0], loop.create_future())
        self._queue.append(pending)
        self._budget.queued += 1
        self._rows += pending.rows
        if self._is_inline and not self._max_delay_s:
            # Computed on a later turn of the loop, with whatever else was queued by then: a callback, not a task.
            # No deadline timer either: nothing makes the request wait longer than the batches queued before it.
            if not self._flush_scheduled:
                self._flush_scheduled = True
                loop.call_soon(self._flush_inline)
            return await pending.future
        self._unanswered += pending.rows
        try:
            if self._rows >= self._max_batch_size:  # (`_full` matters with a delay only, where that is the limit)
                self._full.set()
            if self._in_flight:
                self._more.set()
            if self._task is None:
                self._task = asyncio.create_task(self._serve())
            if deadline is None:
                return await pending.future
            # One timer per request (cheaper than wait_for + shield): it fails the future at the deadline.
            timer = loop.call_at(loop.time() + max(0.0, deadline - time.perf_counter()), _expire, pending)
            try:
                return await pending.future
            finally:
                timer.cancel()
        finally:
            self._unanswered -= pending.rows

    def _flush_inline(self) -> None:
        """(inline, no delay) Compute one batch of what is queued; another turn for the rest.

        A batch that is not full waits one more turn of the loop first: the requests whose bytes its next poll of
        the sockets reads join it. Under load, requests come back from clients a few at a time, and without that
        turn each few made its own model call.
        """
        if not self._waited_a_turn and self._rows < self._max_batch_size:
            self._waited_a_turn = True
            asyncio.get_running_loop().call_soon(self._flush_inline)
            return
        self._waited_a_turn = self._flush_scheduled = False
        batch = self._take()
        if batch:
            started = self._observe_start(batch)
            span = self._trace(batch, started)
            try:
                self._answer_now(batch)
            finally:
                self._compute_metric.observe(time.perf_counter() - started)
                if span is not None:
                    span.end()
        if self._queue and not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_inline)

    async def _serve(self) -> None:
        try:
            while self._queue:
                await self._wait_for_batch()
                if self._lanes == 1:
                    batch = self._take()
                    if batch:
                        await self._compute(batch)
                elif self._lane_is_due():
                    batch = self._take()
                    if batch:
                        self._in_flight += 1
                        task = asyncio.create_task(self._compute_on_lane(batch))
                        self._computing.add(task)
                        task.add_done_callback(self._computing.discard)
                else:
                    self._more.clear()
                    await self._more.wait()
        finally:
            self._task = None

    def _lane_is_due(self) -> bool:
        """(lanes) Whether the next batch goes now: a lane is free, and no batch runs or the queue holds the next
        one's share of the rows (`_limit`). A second batch taken with the first request back would hold one row."""
        if self._in_flight >= self._lanes:
            return False
        return not self._in_flight or self._rows >= self._limit()

    async def _compute_on_lane(self, batch: list[_Pending]) -> None:
        try:
            await self._compute(batch)
        finally:
            self._in_flight -= 1
            self._more.set()

    async def _wait_for_batch(self) -> None:
        waited = time.perf_counter() - self._queue[0].enqueued
        if self._rows < self._max_batch_size and waited < self._max_delay_s:
            self._full.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._full.wait(), self._max_delay_s - waited)

    def _take(self) -> list[_Pending]:
        """Pop queued requests up to a full batch, skipping those whose caller gave up."""
        batch: list[_Pending] = []
        rows, limit = 0, self._limit()
        while self._queue:
            head = self._queue[0]
            if head.future.done():  # its deadline passed, or its caller went away: never computed
                if head.future.cancelled():
                    self._cancelled_metric.inc()
                self._pop()
                continue
            if batch and rows + head.rows > limit:
                break
            batch.append(self._pop())
            rows += head.rows
        return batch

    def _limit(self) -> int:
        """The most rows the next batch takes.

        Off the loop and with no `max_delay_s`, at most half the rows not yet answered (rounded up), shared between
        the lanes: at the moment a batch ends its callers have not resumed yet and still count, so with 8 clients
        and one lane a batch takes 4 and leaves 4 to run next while the first 4 are answered and send their next
        requests (taking all 8 left the model idle for that round trip at every batch); with two lanes, two batches
        of 2 run at once. Inline, the loop runs the model itself and cannot overlap it with anything; with a delay,
        the user asked for fuller batches: `max_batch_size` for both.
        """
        if self._is_inline or self._max_delay_s:
            return self._max_batch_size
        shares = 2 * self._lanes
        return min(self._max_batch_size, (self._unanswered + shares - 1) // shares)

    def _pop(self) -> _Pending:
        pending = self._queue.popleft()
        self._budget.queued -= 1
        self._rows -= pending.rows
        return pending

    def _observe_start(self, batch: list[_Pending]) -> float:
        """A batch leaves the queue: its queue times and size go to the metrics; the start of its compute."""
        started = time.perf_counter()
        for pending in batch:
            self._queue_metric.observe(started - pending.enqueued)
        self._batch_size_metric.observe(sum(p.rows for p in batch))
        return started

    def _trace(self, batch: list[_Pending], started: float) -> Span | None:
        """The batch's `engine compute` span (and each traced request's `queue wait`), when a request in it is
        traced; else None, at the cost of a look at each request."""
        for pending in batch:
            if pending.trace is not None:
                traced = [(p.trace, p.enqueued) for p in batch if p.trace is not None]
                return trace_batch(traced, started, sum(p.rows for p in batch), self._labels)
        return None

    async def _compute(self, batch: list[_Pending]) -> None:
        started = self._observe_start(batch)
        span = self._trace(batch, started)
        try:
            await self._answer(batch)
        finally:
            self._compute_metric.observe(time.perf_counter() - started)
            if span is not None:
                span.end()

    async def _answer(self, batch: list[_Pending]) -> None:
        """Run one batch and give every caller its rows. If the call fails, the batch is split in halves and
        each half run again, so that only the request(s) that fail alone get the error: one bad request never
        fails the others it was batched with. An error that says the engine itself is gone fails them all."""
        started = time.perf_counter()
        try:
            batch, arrays = self._joined_checked(batch)
            if not batch:
                return
            if self._is_inline:
                outputs = self._run(arrays)
            elif self._run_async is not None:
                outputs = await self._run_async(arrays)
            else:
                outputs = await asyncio.get_running_loop().run_in_executor(self._thread, self._run, arrays)
            split = _split(outputs, [p.rows for p in batch])
        except Exception as error:
            for half in self._halves_to_retry(batch, error):
                await self._answer(half)
            return
        self._deliver(batch, split, started)

    def _answer_now(self, batch: list[_Pending]) -> None:
        """`_answer` on the event loop itself (an inline batch)."""
        started = time.perf_counter()
        try:
            batch, arrays = self._joined_checked(batch)
            if not batch:
                return
            split = _split(self._run(arrays), [p.rows for p in batch])
        except Exception as error:
            for half in self._halves_to_retry(batch, error):
                self._answer_now(half)
            return
        self._deliver(batch, split, started)

    def _joined_checked(self, batch: list[_Pending]) -> tuple[list[_Pending], list[Array]]:
        """The requests of the batch whose rows pass `check_rows`, and their arrays joined. The joined arrays are
        checked at once; only if they fail is each request checked alone, and each that fails gets its own error
        (naming its own position), never computed."""
        arrays = _joined(batch)
        if self._check_rows is None:
            return batch, arrays
        try:
            self._check_rows(arrays)
            return batch, arrays
        except BadRequestError:
            passed = []
            for pending in batch:
                try:
                    self._check_rows(pending.arrays)
                    passed.append(pending)
                except BadRequestError as error:
                    if not pending.future.done():
                        pending.future.set_exception(error)
            return passed, _joined(passed) if passed else []

    def _halves_to_retry(self, batch: list[_Pending], error: Exception) -> list[list[_Pending]]:
        """After a failed call: the halves of the batch to run again, or none (a lone request, or an engine that
        is gone), the error given to every caller then."""
        if len(batch) == 1 or isinstance(error, EngineProcessError):
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(error)
            return []
        self._isolations_metric.inc()
        middle = len(batch) // 2
        halves = ([p for p in half if not p.future.done()] for half in (batch[:middle], batch[middle:]))
        return [half for half in halves if half]  # callers past their deadline are not re-run

    def _deliver(self, batch: list[_Pending], split: list[list[Array]], started: float) -> None:
        if self._statistics is not None:
            self._statistics.record_batch(started, [p.enqueued for p in batch], sum(p.rows for p in batch))
        for pending, rows in zip(batch, split, strict=True):
            if not pending.future.done():
                pending.future.set_result(rows)


def _joined(batch: list[_Pending]) -> list[Array]:
    """The batch's arrays, concatenated along axis 0."""
    if len(batch) == 1:
        return batch[0].arrays
    return [np.concatenate(parts) for parts in zip(*(p.arrays for p in batch), strict=True)]


def _expire(pending: _Pending) -> None:
    """Fail a request whose deadline passed; the batcher skips it if it was not taken yet."""
    if not pending.future.done():
        waited = time.perf_counter() - pending.enqueued
        pending.future.set_exception(DeadlineExceededError(f"request timed out after waiting {waited:.3f} s"))


def _check_rows(outputs: list[Array], total: int) -> None:
    for output in outputs:
        if output.ndim == 0 or output.shape[0] != total:
            raise LayerserveError(f"an output has shape {list(output.shape)} for a batch of {total} rows")


def _split(outputs: list[Array], sizes: list[int]) -> list[list[Array]]:
    """Cut each output back into the callers' rows."""
    _check_rows(outputs, sum(sizes))
    if len(sizes) == 1:
        return [outputs]
    ends = list(itertools.accumulate(sizes))
    return [[output[end - size : end] for output in outputs] for size, end in zip(sizes, ends, strict=True)]
