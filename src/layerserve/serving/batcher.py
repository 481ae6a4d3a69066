"""Batcher: merges concurrent requests for one version and input/output set into one model call."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np

from layerserve import metrics
from layerserve.errors import DeadlineExceededError, EngineProcessError, LayerserveError, QueueFullError
from layerserve.serving.statistics import VersionStatistics
from layerserve.tensors import Array

RunBatch = Callable[[list[Array]], list[Array]]


@dataclass
class QueueBudget:
    """How many requests may wait for one version, across all its batchers."""

    limit: int
    queued: int = 0


@dataclass
class _Pending:
    arrays: list[Array]
    rows: int
    future: asyncio.Future[list[Array]]
    enqueued: float = field(default_factory=time.perf_counter)


class Batcher:
    """Concatenates queued requests along the batch axis up to `max_batch_size` rows per model call.

    A batch is sent when the model thread is free and either the queue holds a full batch or the
    oldest request has waited `max_delay_s` (0: at once). A request larger than `max_batch_size`
    runs alone. Every caller gets exactly its own rows back, or the error its own rows cause. With
    `is_inline`, batches run on the event loop itself: for models so fast that the hop to the model
    thread would cost more than the call.
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
    ) -> None:
        self._run = run
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
        self._full = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def is_idle(self) -> bool:
        """Whether nothing is queued or running (the batcher can be dropped)."""
        return self._task is None

    async def submit(self, arrays: list[Array], deadline: float | None) -> list[Array]:
        """Queue one request's arrays (same first dimension) and wait for its rows of the outputs.

        Raises:
            QueueFullError: the version's queue is full (503).
            DeadlineExceededError: the deadline (a `time.perf_counter` value) passed first (504).
        """
        if self._budget.queued >= self._budget.limit:
            raise QueueFullError(f"the queue of model {self._labels[0]} is full ({self._budget.limit} requests)")
        pending = _Pending(arrays, arrays[0].shape[0], asyncio.get_running_loop().create_future())
        self._queue.append(pending)
        self._budget.queued += 1
        self._rows += pending.rows
        if self._rows >= self._max_batch_size:
            self._full.set()
        if self._task is None:
            self._task = asyncio.create_task(self._serve())
        if deadline is None:
            return await pending.future
        # One timer per request (cheaper than wait_for + shield): it fails the future at the deadline.
        timer = asyncio.get_running_loop().call_at(
            asyncio.get_running_loop().time() + max(0.0, deadline - time.perf_counter()), _expire, pending
        )
        try:
            return await pending.future
        finally:
            timer.cancel()

    async def _serve(self) -> None:
        try:
            while self._queue:
                await self._wait_for_batch()
                batch = self._take()
                if batch:
                    await self._compute(batch)
        finally:
            self._task = None

    async def _wait_for_batch(self) -> None:
        waited = time.perf_counter() - self._queue[0].enqueued
        if self._rows < self._max_batch_size and waited < self._max_delay_s:
            self._full.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._full.wait(), self._max_delay_s - waited)

    def _take(self) -> list[_Pending]:
        """Pop queued requests up to a full batch, skipping those whose caller gave up."""
        batch: list[_Pending] = []
        rows = 0
        while self._queue:
            head = self._queue[0]
            if head.future.done():  # its deadline passed, or its caller went away: never computed
                if head.future.cancelled():
                    self._cancelled_metric.inc()
                self._pop()
                continue
            if batch and rows + head.rows > self._max_batch_size:
                break
            batch.append(self._pop())
            rows += head.rows
        return batch

    def _pop(self) -> _Pending:
        pending = self._queue.popleft()
        self._budget.queued -= 1
        self._rows -= pending.rows
        return pending

    async def _compute(self, batch: list[_Pending]) -> None:
        started = time.perf_counter()
        for pending in batch:
            self._queue_metric.observe(started - pending.enqueued)
        self._batch_size_metric.observe(sum(p.rows for p in batch))
        try:
            await self._answer(batch)
        finally:
            self._compute_metric.observe(time.perf_counter() - started)

    async def _answer(self, batch: list[_Pending]) -> None:
        """Run one batch and give every caller its rows. If the call fails, the batch is split in halves and
        each half run again, so that only the request(s) that fail alone get the error: one bad request never
        fails the others it was batched with. An error that says the engine itself is gone fails them all."""
        started = time.perf_counter()
        try:
            split = await self._call(batch)
        except Exception as error:
            if len(batch) == 1 or isinstance(error, EngineProcessError):
                for pending in batch:
                    if not pending.future.done():
                        pending.future.set_exception(error)
                return
            self._isolations_metric.inc()
            middle = len(batch) // 2
            for half in (batch[:middle], batch[middle:]):
                live = [p for p in half if not p.future.done()]  # callers past their deadline are not re-run
                if live:
                    await self._answer(live)
            return
        if self._statistics is not None:
            self._statistics.record_batch(started, [p.enqueued for p in batch], sum(p.rows for p in batch))
        for pending, rows in zip(batch, split, strict=True):
            if not pending.future.done():
                pending.future.set_result(rows)

    async def _call(self, batch: list[_Pending]) -> list[list[Array]]:
        """One model call for the batch (concatenated along axis 0); each caller's rows of the outputs."""
        if len(batch) > 1:
            arrays = [np.concatenate(parts) for parts in zip(*(p.arrays for p in batch), strict=True)]
        else:
            arrays = batch[0].arrays
        if self._is_inline:
            outputs = self._run(arrays)
        else:
            outputs = await asyncio.get_running_loop().run_in_executor(self._thread, self._run, arrays)
        return _split(outputs, [p.rows for p in batch])


def _expire(pending: _Pending) -> None:
    """Fail a request whose deadline passed; the batcher skips it if it was not taken yet."""
    if not pending.future.done():
        waited = time.perf_counter() - pending.enqueued
        pending.future.set_exception(DeadlineExceededError(f"request timed out after waiting {waited:.3f} s"))


def _split(outputs: list[Array], sizes: list[int]) -> list[list[Array]]:
    """Cut each output back into the callers' rows."""
    total = sum(sizes)
    for output in outputs:
        if output.ndim == 0 or output.shape[0] != total:
            raise LayerserveError(f"an output has shape {list(output.shape)} for a batch of {total} rows")
    bounds = np.cumsum(sizes)[:-1]
    per_output = [np.split(output, bounds) for output in outputs]
    return [list(parts) for parts in zip(*per_output, strict=True)]
