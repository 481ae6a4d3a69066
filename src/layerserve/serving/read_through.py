"""read_through: the one read-through path of the feature cache, for tensor rows and encoded images alike."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from layerserve.features.cache import FeatureCache
from layerserve.serving.statistics import VersionStatistics
from layerserve.tensors import Array
from layerserve.tracing import span

ComputeMisses = Callable[[list[int]], Awaitable[list[list[Array]]]]


async def read_through(
    cache: FeatureCache,
    keys: list[str],
    width: int,
    compute: ComputeMisses,
    statistics: VersionStatistics,
    model: str,
) -> list[list[Array]]:
    """Each key's row of `width` arrays, from the cache, or computed for the misses (`compute` gets their
    indices) and stored. Times hits and misses in the statistics (a miss: its lookup and its store, not its
    compute)."""
    started = time.perf_counter()
    with span("cache lookup") as lookup:
        found = await cache.lookup(keys, width, model)
        misses = [index for index, row in enumerate(found) if row is None]
        if lookup is not None:
            lookup.set_attributes({"layerserve.cache.rows": len(keys), "layerserve.cache.misses": len(misses)})
    if not misses:
        statistics.cache_hit.add(time.perf_counter() - started)
        return [row for row in found if row is not None]
    looked_up = time.perf_counter() - started
    fresh = await compute(misses)
    stored_at = time.perf_counter()
    await cache.store([keys[i] for i in misses], fresh, model)
    statistics.cache_miss.add(looked_up + time.perf_counter() - stored_at)
    rows = dict(zip(misses, fresh, strict=True))
    return [row if row is not None else rows[index] for index, row in enumerate(found)]
