"""CPU time and resident memory of a process, from /proc."""

from __future__ import annotations

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
