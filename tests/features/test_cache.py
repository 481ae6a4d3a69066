"""The feature cache and store against a real Redis (127.0.0.1:6379, a private key prefix) and in process."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import numpy as np
import pytest
import redis

from layerserve.features.cache import FeatureCache, InProcessBackend, RedisBackend, decode_arrays, encode_arrays
from layerserve.features.feature_store import FeatureStore, StoredFeature
from tests.live_server import free_port

pytestmark = pytest.mark.anyio
REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
async def backends() -> AsyncIterator[list[RedisBackend]]:
    """Redis backends the test opens; closed afterwards."""
    opened: list[RedisBackend] = []
    yield opened
    for backend in opened:
        await backend.close()


def redis_backend(backends: list[RedisBackend], url: str = REDIS_URL, timeout_s: float = 0.5) -> RedisBackend:
    backend = RedisBackend(url, timeout_s)
    backends.append(backend)
    return backend


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    """A key prefix of this test's own; its keys are deleted afterwards."""
    value = f"layerserve-test-{uuid.uuid4().hex[:12]}:"
    yield value
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(f"{value}*"))
    if keys:
        client.delete(*keys)
    client.close()


def test_values_round_trip_and_garbage_is_a_miss() -> None:
    arrays = [np.arange(6, dtype=np.float16).reshape(2, 3), np.array([True, False]), np.int64(7) * np.ones(())]
    decoded = decode_arrays(encode_arrays(arrays), 3)
    assert decoded is not None
    for got, want in zip(decoded, arrays, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
    raw = encode_arrays(arrays)
    assert decode_arrays(raw, 2) is None  # another count
    assert decode_arrays(raw[:-3], 3) is None  # shorter than its header says
    assert decode_arrays(raw + b"x", 3) is None  # longer
    assert decode_arrays(b"\x80\x04pickle", 1) is None
    assert decode_arrays(raw.replace(b"<f2", b"|O8"), 3) is None  # an object dtype is refused


def test_row_keys_depend_on_data_dtype_shape_and_outputs() -> None:
    cache = FeatureCache(InProcessBackend(10**6), 0, "p:")
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    keys = cache.row_keys("m", 1, "w", ("out",), {"x": x})
    assert len(keys) == 2 and keys[0] != keys[1]
    assert cache.row_keys("m", 1, "w", ("out",), {"x": x.copy()}) == keys
    assert cache.row_keys("m", 1, "w", ("out",), {"x": x.astype(np.float64)})[0] != keys[0]
    assert cache.row_keys("m", 1, "w", ("out",), {"x": x.reshape(2, 3, 1)})[0] != keys[0]
    assert cache.row_keys("m", 1, "w", ("other",), {"x": x})[0] != keys[0]
    assert cache.row_keys("m", 2, "w", ("out",), {"x": x})[0] != keys[0]
    assert cache.row_keys("m", 1, "other weights", ("out",), {"x": x})[0] != keys[0]


async def test_in_process_backend_is_bounded() -> None:
    backend = InProcessBackend(max_bytes=100)
    await backend.set_many([("a", b"x" * 60), ("b", b"y" * 60)], 0)
    assert await backend.get_many(["a", "b"]) == [None, b"y" * 60]


async def test_redis_cache_rows_ttl_and_garbage(prefix: str, backends: list[RedisBackend]) -> None:
    cache = FeatureCache(redis_backend(backends), 120, prefix)
    keys = cache.row_keys("m", 1, "w", ("out",), {"x": np.arange(6, dtype=np.float32).reshape(3, 2)})
    assert await cache.lookup(keys, 1, "m") == [None, None, None]
    rows = [[np.full(4, i, np.float32)] for i in range(3)]
    await cache.store(keys, rows, "m")
    found = await cache.lookup(keys, 1, "m")
    assert [float(row[0][0]) for row in found if row] == [0.0, 1.0, 2.0]
    client = redis.Redis.from_url(REDIS_URL)
    assert 0 < client.ttl(keys[0]) <= 120
    client.set(keys[1], b"LSR1garbage")
    client.close()
    assert [row is None for row in await cache.lookup(keys, 1, "m")] == [False, True, False]


async def test_redis_down_is_a_miss_and_never_raises(backends: list[RedisBackend]) -> None:
    cache = FeatureCache(redis_backend(backends, f"redis://127.0.0.1:{free_port()}/0", 0.05), 60, "p:")
    keys = cache.row_keys("m", 1, "w", ("out",), {"x": np.arange(4, dtype=np.float32).reshape(2, 2)})
    assert await cache.lookup(keys, 1, "m") == [None, None]
    await cache.store(keys, [[np.ones(1)], [np.ones(1)]], "m")


async def test_feature_store_is_shared_through_redis(prefix: str, backends: list[RedisBackend]) -> None:
    writer = FeatureStore(redis_backend(backends), prefix)
    reader = FeatureStore(redis_backend(backends), prefix)  # another process would do the same
    vectors = [StoredFeature("cat", 3, "avg_pool", np.arange(5, dtype=np.float32)),
               StoredFeature("dog", 3, "avg_pool", np.ones(5, np.float16))]  # fmt: skip
    await writer.put_many("m", vectors)
    cat = await reader.get("m", "cat", None, None)
    assert (cat.model_version, cat.layer, cat.array.dtype, cat.array.tolist()) == (
        3,
        "avg_pool",
        np.float32,
        [0, 1, 2, 3, 4],
    )
    found = await reader.get_many("m", ["dog", "nope", "cat"], 3, "avg_pool")
    assert [f.id if f else None for f in found] == ["dog", None, "cat"]
    assert found[0] is not None and found[0].array.dtype == np.float16
    assert await reader.get_many("m", ["cat"], 4, "avg_pool") == [None]
