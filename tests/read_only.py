"""A folder made read-only for a server, as a read-only volume is: a read-only mount as root, else permissions."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def read_only(folder: Path) -> Iterator[None]:
    """Make `folder` unwritable for the server: a read-only tmpfs holding its files when running as root
    (permissions do not bind root), else permissions."""
    if os.geteuid() != 0:
        paths = [folder, *folder.rglob("*")]
        for path in paths:
            path.chmod(path.stat().st_mode & 0o555)
        try:
            yield
        finally:
            for path in paths:
                path.chmod(path.stat().st_mode | 0o200)
        return
    staged = folder.with_name(folder.name + ".files")
    folder.rename(staged)
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(folder)], check=True)
    try:
        shutil.copytree(staged, folder, dirs_exist_ok=True)
        subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
        yield
    finally:
        subprocess.run(["umount", str(folder)], check=True)
