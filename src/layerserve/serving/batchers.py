"""BatcherTable: a version's batchers, one per (input names, outputs, non-batch shapes), and its BatchingPlan."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass

from layerserve.lifecycle.model import Signature
from layerserve.serving.batcher import Batcher, QueueBudget
from layerserve.serving.statistics import VersionStatistics
from layerserve.settings import ModelConfig, Settings
from layerserve.tensors import Array

_MAX_BATCHERS = 64  # beyond this many input/output/shape sets, idle batchers are dropped

RunNamed = Callable[[dict[str, Array], tuple[str, ...]], dict[str, Array]]
RunNamedAsync = Callable[[dict[str, Array], tuple[str, ...]], Awaitable[dict[str, Array]]]


@dataclass(frozen=True)
class BatchingPlan:
    """A version's batching settings in force; `inline`: its full-model batches are fast enough to run on the
    event loop (decided by the warm-up)."""

    max_batch_size: int = 1
    max_delay_s: float = 0.0
    max_queue_size: int = 1
    inline: bool = False

    @classmethod
    def of(cls, config: ModelConfig, settings: Settings, signature: Signature) -> BatchingPlan:
        """The model's own settings over the server's; a model without a batch dimension runs one at a time."""
        is_batchable = all(spec.shape and spec.shape[0] == -1 for spec in signature.inputs)
        return cls(
            (config.max_batch_size or settings.max_batch_size) if is_batchable else 1,
            (settings.max_delay_ms if config.max_delay_ms is None else config.max_delay_ms) / 1000,
            config.max_queue_size or settings.max_queue_size,
        )


class BatcherTable:
    """Requests with the same input names, outputs and non-batch shapes share one batcher; all of a version's
    batchers share its queue budget and its model thread. `run` computes one batch (on the model thread, or on
    the event loop for a full-model call when `is_inline` says so); `run_async`, with the names it takes, sends one
    from the event loop instead of the model thread. `index_check` gives the batcher of some input names the check
    of their values' ranges (RequestChecks.index_check)."""

    def __init__(
        self,
        run: RunNamed,
        thread: Executor,
        plan: BatchingPlan,
        timeout_ms: int,
        labels: tuple[str, str],
        statistics: VersionStatistics,
        is_inline: Callable[[tuple[str, ...], tuple[str, ...]], bool],
        run_async: tuple[RunNamedAsync, Callable[[tuple[str, ...], tuple[str, ...]], bool]] | None = None,
        index_check: Callable[[tuple[str, ...]], Callable[[list[Array]], None] | None] | None = None,
        lanes: int = 1,
    ) -> None:
        self._run = run
        self._lanes = lanes
        self._index_check = index_check
        self._run_async = run_async
        self._thread = thread
        self._max_batch_size = plan.max_batch_size
        self._max_delay_s = plan.max_delay_s
        self._budget = QueueBudget(plan.max_queue_size)
        self._timeout_ms = timeout_ms
        self._labels = labels
        self._statistics = statistics
        self._is_inline = is_inline
        self._batchers: dict[tuple[object, ...], Batcher] = {}

    async def submit(
        self, inputs: dict[str, Array], outputs: tuple[str, ...], timeout_ms: int | None
    ) -> dict[str, Array]:
        """Queue one request with the batcher of its names and shapes; its rows of the outputs.

        Raises:
            QueueFullError: too many requests wait already (503).
            DeadlineExceededError: not answered within `timeout_ms` (default: the server's) (504).
        """
        names = tuple(sorted(inputs))
        arrays = [inputs[name] for name in names]
        key = (names, outputs, tuple((a.shape[1:], a.dtype) for a in arrays))
        batcher = self._batchers.get(key) or self._new_batcher(key, names, outputs)
        deadline = time.perf_counter() + (timeout_ms or self._timeout_ms) / 1000
        results = await batcher.submit(arrays, deadline)
        return dict(zip(outputs, results, strict=True))

    def _new_batcher(self, key: tuple[object, ...], names: tuple[str, ...], wanted: tuple[str, ...]) -> Batcher:
        if len(self._batchers) >= _MAX_BATCHERS:
            self._batchers = {k: b for k, b in self._batchers.items() if not b.is_idle}

        def run(arrays: list[Array]) -> list[Array]:
            results = self._run(dict(zip(names, arrays, strict=True)), wanted)
            return [results[name] for name in wanted]

        run_async = None
        if self._run_async is not None and self._run_async[1](names, wanted):
            run_named_async = self._run_async[0]

            async def run_async(arrays: list[Array]) -> list[Array]:
                results = await run_named_async(dict(zip(names, arrays, strict=True)), wanted)
                return [results[name] for name in wanted]

        batcher = Batcher(
            run, self._thread, self._max_batch_size, self._max_delay_s, self._budget, self._labels,
            self._is_inline(names, wanted), self._statistics, run_async,
            None if self._index_check is None else self._index_check(names), self._lanes,
        )  # fmt: skip
        self._batchers[key] = batcher
        return batcher

    @property
    def queued(self) -> int:
        """Requests waiting now, over all the version's batchers."""
        return self._budget.queued

    def clear(self) -> None:
        """Drop every batcher (the version is closed)."""
        self._batchers = {}
