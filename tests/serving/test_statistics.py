"""VersionStatistics fed by a real batcher and by ModelVersion.predict: Triton's model_stats counts."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from layerserve.errors import NotReadyError
from layerserve.serving.batcher import Batcher, QueueBudget
from layerserve.serving.statistics import VersionStatistics
from layerserve.serving.version import ModelVersion
from layerserve.settings import ModelConfig
from layerserve.tensors import Array

pytestmark = pytest.mark.anyio


def double(arrays: list[Array]) -> list[Array]:
    return [arrays[0] * 2]


async def test_a_batch_counts_its_rows_once_and_each_request_queued() -> None:
    statistics = VersionStatistics()
    merger = Batcher(double, ThreadPoolExecutor(1), 8, 0.01, QueueBudget(100), ("m", "1"), statistics=statistics)
    sent = [np.ones((n, 3), np.float32) for n in (1, 3, 2)]
    await asyncio.gather(*(merger.submit([a], None) for a in sent))  # one call: the batcher was idle, with a delay
    await merger.submit([np.ones((4, 3), np.float32)], None)
    assert statistics.inference_count == 10 and statistics.execution_count == 2
    assert statistics.queue.count == 4 and statistics.compute_infer.count == 4
    stats = statistics.to_dict("m", 1)
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in stats["batch_stats"]] == [(4, 1), (6, 1)]
    assert stats["inference_stats"]["success"] == {"count": 0, "ns": 0}  # requests are counted by predict


async def test_a_failed_batch_counts_no_execution() -> None:
    def broken(arrays: list[Array]) -> list[Array]:
        raise ValueError("broken")

    statistics = VersionStatistics()
    merger = Batcher(broken, ThreadPoolExecutor(1), 8, 0.0, QueueBudget(100), ("m", "1"), statistics=statistics)
    with pytest.raises(ValueError, match="broken"):
        await merger.submit([np.ones((2, 3), np.float32)], None)
    assert statistics.execution_count == statistics.inference_count == 0 and statistics.batches == {}


async def test_predict_counts_a_failed_request() -> None:
    version = ModelVersion("m", 1, Path(), ModelConfig())  # never loaded: predict fails
    with pytest.raises(NotReadyError):
        await version.predict({"x": np.ones((1, 3), np.float32)}, ("y",))
    stats = version.statistics.to_dict("m", 1)["inference_stats"]
    assert stats["fail"]["count"] == 1 and stats["success"]["count"] == 0
    assert version.statistics.last_inference_ms > 0


def test_the_shape_is_triton_s() -> None:
    stats = VersionStatistics().to_dict("m", 3)
    assert stats["name"] == "m" and stats["version"] == "3" and stats["batch_stats"] == []
    assert set(stats["inference_stats"]) == {"success", "fail", "queue", "compute_input", "compute_infer",
                                             "compute_output", "cache_hit", "cache_miss"}  # fmt: skip
