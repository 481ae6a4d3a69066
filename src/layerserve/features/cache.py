"""FeatureCache: output rows by (model, version, outputs, input bytes), in process or on Redis; fails soft.

Values hold each array's dtype, shape and raw bytes behind a checked header: nothing is ever unpickled.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
import time
from collections import OrderedDict
from typing import Protocol

import numpy as np

from layerserve import metrics
from layerserve.tensors import Array

log = logging.getLogger(__name__)

_MAGIC = b"LSR1"
_U32 = struct.Struct("<I")
_ERROR_LOG_INTERVAL_S = 30.0


def encode_arrays(arrays: list[Array]) -> bytes:
    """Arrays as one value: magic, count, then per array its dtype, shape, byte length and raw bytes."""
    parts = [_MAGIC, _U32.pack(len(arrays))]
    for value in arrays:
        array = np.asarray(value)  # not ascontiguousarray: it turns 0-d arrays into 1-d ones
        array = array if array.flags.c_contiguous else array.copy()
        dtype = array.dtype.str.encode("ascii")
        parts += [bytes([len(dtype)]), dtype, bytes([array.ndim]), struct.pack(f"<{array.ndim}I", *array.shape)]
        parts += [_U32.pack(array.nbytes), array.tobytes()]
    return b"".join(parts)


def decode_arrays(raw: bytes, count: int) -> list[Array] | None:
    """The arrays of a value, or None when it is not exactly `count` well-formed numeric arrays whose
    lengths match their headers (a miss, not a crash). Object dtypes are refused: nothing is unpickled."""
    try:
        if raw[:4] != _MAGIC or _U32.unpack_from(raw, 4)[0] != count:
            return None
        arrays, offset = [], 8
        for _ in range(count):
            size = raw[offset]
            dtype = np.dtype(raw[offset + 1 : offset + 1 + size].decode("ascii"))
            offset += 1 + size
            ndim = raw[offset]
            shape = struct.unpack_from(f"<{ndim}I", raw, offset + 1)
            offset += 1 + 4 * ndim
            (nbytes,) = _U32.unpack_from(raw, offset)
            offset += 4
            if dtype.kind not in "biuf" or nbytes != dtype.itemsize * int(np.prod(shape)) or offset + nbytes > len(raw):
                return None
            arrays.append(np.frombuffer(raw, dtype, int(np.prod(shape)), offset).reshape(shape))
            offset += nbytes
        return arrays if offset == len(raw) else None
    except (ValueError, TypeError, IndexError, struct.error, UnicodeDecodeError):
        return None


class CacheBackend(Protocol):
    """Where values live: many keys in one round trip each way."""

    name: str

    async def get_many(self, keys: list[str]) -> list[bytes | None]:
        """The values of the keys (None for missing), in one round trip."""
        ...

    async def set_many(self, items: list[tuple[str, bytes]], ttl_s: float) -> None:
        """Store the values (ttl_s 0: no expiry), in one round trip."""
        ...


class InProcessBackend:
    """A byte-bounded LRU dictionary with expiry, in this process."""

    name = "memory"

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._items: OrderedDict[str, tuple[bytes, float]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    async def get_many(self, keys: list[str]) -> list[bytes | None]:
        """The values of the keys (None for missing or expired)."""
        now = time.monotonic()
        found: list[bytes | None] = []
        with self._lock:
            for key in keys:
                item = self._items.get(key)
                if item is None or (item[1] and item[1] < now):
                    found.append(None)
                    continue
                self._items.move_to_end(key)
                found.append(item[0])
        return found

    async def set_many(self, items: list[tuple[str, bytes]], ttl_s: float) -> None:
        """Store the values; the least recently used go beyond `max_bytes`."""
        expires = time.monotonic() + ttl_s if ttl_s else 0.0
        with self._lock:
            for key, value in items:
                old = self._items.pop(key, None)
                self._bytes += len(value) - (len(old[0]) if old else 0)
                self._items[key] = (value, expires)
            while self._bytes > self._max_bytes and self._items:
                _, (dropped, _) = self._items.popitem(last=False)
                self._bytes -= len(dropped)


class RedisBackend:
    """A Redis server: MGET to read, one pipelined batch of SETs to write, short socket timeouts."""

    name = "redis"

    def __init__(self, url: str, timeout_s: float) -> None:
        import redis.asyncio as redis

        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False
        )

    async def get_many(self, keys: list[str]) -> list[bytes | None]:
        """MGET (raises the client's errors; FeatureCache turns them into misses)."""
        values = await self._client.mget(keys)
        return [value.encode() if isinstance(value, str) else value for value in values]

    async def set_many(self, items: list[tuple[str, bytes]], ttl_s: float) -> None:
        """SET with EX for each item, pipelined in one round trip."""
        async with self._client.pipeline(transaction=False) as pipe:
            for key, value in items:
                pipe.set(key, value, ex=int(ttl_s) if ttl_s else None)
            await pipe.execute()

    async def close(self) -> None:
        """Close the connections."""
        await self._client.aclose()


class FeatureCache:
    """Rows of outputs keyed by model, version, output names and each input row's bytes, dtype and shape.

    Every backend error is a miss: logged at most once per 30 s, counted, and the cache resumes by itself.
    """

    def __init__(self, backend: CacheBackend, ttl_s: float, prefix: str) -> None:
        self.backend = backend
        self._ttl_s = ttl_s
        self._prefix = prefix
        self._last_error_log = 0.0

    def row_keys(
        self, model: str, version: int, salt: str, outputs: tuple[str, ...], inputs: dict[str, Array]
    ) -> list[str]:
        """One key per input row: SHA-256 over `salt` (the model file's hash: other weights under the same
        version number never hit), the outputs and each input's name, dtype, row shape and bytes."""
        names = sorted(inputs)
        rows = inputs[names[0]].shape[0]
        head = hashlib.sha256(f"{salt}\0".encode() + "\0".join(outputs).encode())
        keys = []
        for row in range(rows):
            digest = head.copy()
            for name in names:
                value = inputs[name][row]
                digest.update(f"\0{name}\0{inputs[name].dtype.str}\0{value.shape}\0".encode())
                digest.update(_row_bytes(value))
            keys.append(f"{self._prefix}cache:{model}:{version}:{digest.hexdigest()}")
        return keys

    def encoded_keys(self, model: str, version: int, salt: str, output: str, payloads: list[bytes]) -> list[str]:
        """One key per encoded input (an image file): SHA-256 over its bytes, the output and `salt` (the model
        file's hash and the preprocessing config), so that a hit skips decoding too."""
        keys = []
        for payload in payloads:
            digest = hashlib.sha256(f"encoded\0{salt}\0{output}\0".encode())
            digest.update(payload)
            keys.append(f"{self._prefix}cache:{model}:{version}:{digest.hexdigest()}")
        return keys

    async def lookup(self, keys: list[str], count: int, model: str) -> list[list[Array] | None]:
        """The cached rows (None for a miss); a backend error makes every row a miss."""
        try:
            values = await self.backend.get_many(keys)
        except Exception as error:  # fail-soft boundary: Redis down, slow or confused
            self._failed("read", error, model)
            values = [None] * len(keys)
        rows = []
        for value in values:
            row = decode_arrays(value, count) if value is not None else None
            if value is not None and row is None:
                metrics.CACHE_ERRORS.labels(model, self.backend.name).inc()
            rows.append(row)
        hits = sum(row is not None for row in rows)
        metrics.CACHE_HITS.labels(model, self.backend.name).inc(hits)
        metrics.CACHE_MISSES.labels(model, self.backend.name).inc(len(rows) - hits)
        return rows

    async def store(self, keys: list[str], rows: list[list[Array]], model: str) -> None:
        """Store computed rows (errors are logged and counted; the answer does not wait for retries).

        Rows holding strings (BYTES) are not cached: only numeric arrays are stored.
        """
        if any(array.dtype.kind not in "biuf" for row in rows for array in row):
            return
        items = [(key, encode_arrays(row)) for key, row in zip(keys, rows, strict=True)]
        try:
            await self.backend.set_many(items, self._ttl_s)
        except Exception as error:  # fail-soft boundary
            self._failed("write", error, model)
            return
        metrics.CACHE_BYTES.labels(model, self.backend.name).inc(sum(len(value) for _, value in items))

    def _failed(self, action: str, error: Exception, model: str) -> None:
        metrics.CACHE_ERRORS.labels(model, self.backend.name).inc()
        now = time.monotonic()
        if now - self._last_error_log >= _ERROR_LOG_INTERVAL_S:
            self._last_error_log = now
            log.warning("feature cache %s failed (%s: %s); computing as a miss", action, type(error).__name__, error)


def _row_bytes(value: Array) -> bytes:
    if value.dtype == object:
        return b"".join(_U32.pack(len(b)) + b for b in (bytes(e) for e in value.reshape(-1)))
    return np.ascontiguousarray(value).tobytes()


async def wait_closed(backend: CacheBackend) -> None:
    """Close a backend's connections, if it has any."""
    close = getattr(backend, "close", None)
    if close is not None:
        await close()
