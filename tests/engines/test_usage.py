"""trim_heap: the C heap's freed pages go back to the system."""

from __future__ import annotations

import ctypes

from layerserve.engines.process.usage import process_usage, trim_heap

BLOCK, BLOCKS = 4096, 25_000  # 100 MB in blocks under glibc's mmap threshold: on the heap, as a session's are


def test_trim_heap_gives_freed_heap_pages_back() -> None:
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(BLOCK) for _ in range(BLOCKS)]
    for block in blocks:
        ctypes.memset(block, 1, BLOCK)  # resident
    above = libc.malloc(64)  # allocated after them: the heap's top cannot shrink by itself when they are freed
    for block in blocks:
        libc.free(block)
    try:
        freed = process_usage()[1]
        trim_heap()
        given_back = freed - process_usage()[1]
    finally:
        libc.free(above)
    assert given_back > BLOCK * BLOCKS // 2, given_back
