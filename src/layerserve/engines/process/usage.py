"""CPU time and resident memory of a process, from /proc; the C heap's free pages given back, and its arenas held
to a few."""

from __future__ import annotations

import contextlib
import ctypes
import os
from pathlib import Path


def process_usage(pid: int | str = "self") -> tuple[float, int]:
    """CPU seconds and resident bytes of a process (this one by default; (0, 0) once it is gone)."""
    where = str(pid)
    try:
        fields = Path(f"/proc/{where}/stat").read_text().rsplit(")", 1)[1].split()
        ticks, page = os.sysconf("SC_CLK_TCK"), os.sysconf("SC_PAGE_SIZE")
        resident = int(Path(f"/proc/{where}/statm").read_text().split()[1]) * page
        return (int(fields[11]) + int(fields[12])) / ticks, resident  # utime, stime
    except (OSError, ValueError, IndexError):
        return 0.0, 0


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")
    ]  # fmt: skip


def heap_bytes() -> int:
    """Bytes the C heap has handed out now (glibc's mallinfo2: in use in its arenas, and in its own mappings); 0
    where there is no glibc. Unlike resident memory it counts what a session allocates, not the pages it touched
    first, so a growth of it measures one load even among many."""
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return 0
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd)


def trim_heap() -> None:
    """Give the C heap's free pages back to the system: glibc keeps what a freed session, graph or batch took,
    and a process that loads and frees versions again and again would grow by it."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


HEAP_ARENAS = 2  # glibc's own default is 8 per core
_M_ARENA_MAX = -8  # mallopt's parameter for MALLOC_ARENA_MAX


def limit_heap_arenas() -> None:
    """Hold glibc's heap to HEAP_ARENAS arenas in this process and in those it starts after (workers, engine
    processes, the preparer), unless `MALLOC_ARENA_MAX` is set already. Each thread that allocates at once gets an
    arena of its own by default, and memory freed in one arena serves no other: a server that loads and frees
    versions from its executor's threads, among its requests' threads, keeps more of what they freed and touches
    fresh pages for each load."""
    if "MALLOC_ARENA_MAX" in os.environ:  # glibc read it at this process's start
        return
    os.environ["MALLOC_ARENA_MAX"] = str(HEAP_ARENAS)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(_M_ARENA_MAX, HEAP_ARENAS)
