"""CPU time and resident memory of a process, from /proc; and the C heap's free pages given back."""

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


def trim_heap() -> None:
    """Give the C heap's free pages back to the system: glibc keeps what a freed session, graph or batch took,
    and a process that loads and frees versions again and again would grow by it."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
