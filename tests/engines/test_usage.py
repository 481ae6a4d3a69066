"""trim_heap: the C heap's freed pages go back to the system; limit_heap_arenas holds glibc's heap to a few arenas."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

from layerserve.engines.process.usage import HEAP_ARENAS, process_usage, trim_heap

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


_COUNT_ARENAS = """
import ctypes, os, sys, tempfile, threading
from layerserve.engines.process.usage import limit_heap_arenas
if sys.argv[1] == "limit":
    limit_heap_arenas()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.fopen.restype = ctypes.c_void_p
barrier = threading.Barrier(6)
def allocate():
    barrier.wait()
    libc.malloc(1000)  # a thread's first allocation takes it an arena, a new one while the limit allows
    barrier.wait()
threads = [threading.Thread(target=allocate) for _ in range(6)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
with tempfile.NamedTemporaryFile() as report:
    stream = libc.fopen(report.name.encode(), b"w")
    libc.malloc_info(0, ctypes.c_void_p(stream))
    libc.fclose(ctypes.c_void_p(stream))
    heaps = open(report.name).read().count("<heap nr=")
print(heaps, os.environ.get("MALLOC_ARENA_MAX"))
"""


def _arenas(mode: str, environment: dict[str, str]) -> tuple[int, str]:
    """(glibc's heap arenas after six threads allocated at once, MALLOC_ARENA_MAX) in a fresh process."""
    answer = subprocess.run(
        [sys.executable, "-c", _COUNT_ARENAS, mode], env=environment, capture_output=True, text=True, check=True
    )
    heaps, variable = answer.stdout.split()
    return int(heaps), variable


def test_limit_heap_arenas_holds_the_heap_to_two_arenas_here_and_in_processes_started_after() -> None:
    environment = {key: value for key, value in os.environ.items() if key != "MALLOC_ARENA_MAX"}
    unlimited, _ = _arenas("free", environment)
    assert unlimited > HEAP_ARENAS  # glibc's default: an arena per thread, up to 8 per core
    assert _arenas("limit", environment) == (HEAP_ARENAS, str(HEAP_ARENAS))  # set in the process, and its children's
    assert _arenas("limit", {**environment, "MALLOC_ARENA_MAX": "3"}) == (3, "3")  # the operator's own choice stays
