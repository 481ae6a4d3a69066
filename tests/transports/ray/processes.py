"""Ray's own processes on this machine, to check that a test leaves none behind."""

from __future__ import annotations

from pathlib import Path


def ray_processes() -> set[int]:
    """Pids of Ray's own processes (GCS, raylets, workers) on this machine."""
    found = set()
    for folder in Path("/proc").iterdir():
        if not folder.name.isdigit():
            continue
        try:
            command = (folder / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"gcs_server" in command or b"raylet" in command or command.startswith(b"ray::"):
            found.add(int(folder.name))
    return found
