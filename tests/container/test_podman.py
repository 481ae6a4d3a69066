"""The container tests' own harness: the Debian mirror read from apt's sources, as apt reads them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.container.podman import debian_mirror

DEB822 = """\
Types: deb
URIs: http://mirror.invalid/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://mirror.invalid/debian-security
Suites: bookworm-security
Components: main
"""


def test_the_mirror_comes_from_a_deb822_source_offering_the_suite_and_main(tmp_path: Path) -> None:
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "other.sources.disabled").write_text(DEB822.replace("mirror", "other"))
    (tmp_path / "sources.list.d" / "debian.sources").write_text(DEB822)
    assert debian_mirror(tmp_path) == "http://mirror.invalid/debian"


def test_the_mirror_comes_from_a_one_line_source(tmp_path: Path) -> None:
    (tmp_path / "sources.list.d").mkdir()
    lines = "deb http://mirror.invalid/debian-security bookworm-security main\n"
    lines += "deb [arch=amd64] http://mirror.invalid/debian bookworm main contrib\n"
    (tmp_path / "sources.list").write_text(lines)
    assert debian_mirror(tmp_path) == "http://mirror.invalid/debian"


def test_no_source_of_the_suite_is_named(tmp_path: Path) -> None:
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list").write_text("deb http://mirror.invalid/debian trixie main\n")
    with pytest.raises(AssertionError, match="no apt source offers Debian bookworm main"):
        debian_mirror(tmp_path)
