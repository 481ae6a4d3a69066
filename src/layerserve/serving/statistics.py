"""VersionStatistics: a version's request and batch counters, in the shape of Triton's statistics extension."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Duration:
    """How many times something happened, and the nanoseconds it took in all."""

    count: int = 0
    ns: int = 0

    def add(self, seconds: float, times: int = 1) -> None:
        """Count `times` more, each of `seconds`."""
        self.count += times
        self.ns += int(seconds * 1e9) * times

    def to_dict(self) -> dict[str, int]:
        """Triton's `{"count", "ns"}`."""
        return {"count": self.count, "ns": self.ns}


@dataclass
class BatchDurations:
    """The model calls of one batch size."""

    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass
class StepStatistics:
    """A pipeline's counters of one step: its requests to the step's model, and the version that answered last."""

    model: str
    output: str
    version: int = 0
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)

    def record(self, is_success: bool, seconds: float, version: int) -> None:
        """One step of a request, answered (or failed) by `version` after `seconds`."""
        (self.success if is_success else self.fail).add(seconds)
        self.version = version

    def to_dict(self, number: int) -> dict[str, Any]:
        """One entry of a pipeline's `steps`."""
        return {
            "step": number, "model": self.model, "version": str(self.version), "output": self.output,
            "success": self.success.to_dict(), "fail": self.fail.to_dict(),
        }  # fmt: skip


_REQUEST_STATS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit",
                  "cache_miss")  # fmt: skip


@dataclass
class VersionStatistics:
    """Counters of one loaded version since it was loaded; updated on the event loop only.

    `inference_count` counts rows computed by the model, `execution_count` model calls (batches); neither
    counts rows served from the feature cache. `compute_infer` is the whole batch's compute (joining the
    requests, the model call, splitting the answers), counted once per request of the batch as Triton does;
    `compute_input` and `compute_output` stay 0, layerserve does not time them apart.
    """

    last_inference_ms: int = 0
    inference_count: int = 0
    execution_count: int = 0
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    cache_hit: Duration = field(default_factory=Duration)
    cache_miss: Duration = field(default_factory=Duration)
    batches: dict[int, BatchDurations] = field(default_factory=dict)
    steps: list[StepStatistics] = field(default_factory=list)  # a pipeline's, one per step

    def record_request(self, is_success: bool, seconds: float) -> None:
        """One request answered (or failed) after `seconds`."""
        (self.success if is_success else self.fail).add(seconds)
        self.last_inference_ms = time.time_ns() // 1_000_000

    def record_batch(self, started: float, enqueued: list[float], rows: int) -> None:
        """One model call of `rows` rows for requests queued at `enqueued`, computed from `started` until now
        (`time.perf_counter` values)."""
        seconds = time.perf_counter() - started
        for queued_at in enqueued:
            self.queue.add(started - queued_at)
        self.compute_infer.add(seconds, len(enqueued))
        self.inference_count += rows
        self.execution_count += 1
        self.batches.setdefault(rows, BatchDurations()).compute_infer.add(seconds)

    def to_dict(self, name: str, version: int) -> dict[str, Any]:
        """One entry of Triton's `model_stats`."""
        return {
            "name": name,
            "version": str(version),
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {key: getattr(self, key).to_dict() for key in _REQUEST_STATS},
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": batch.compute_input.to_dict(),
                    "compute_infer": batch.compute_infer.to_dict(),
                    "compute_output": batch.compute_output.to_dict(),
                }
                for size, batch in sorted(self.batches.items())
            ],
            **({"steps": [step.to_dict(number) for number, step in enumerate(self.steps, 1)]} if self.steps else {}),
        }
