"""TensorFlow's import notices left out of standard error, and nothing else."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from layerserve.logs import import_quietly


def test_only_the_named_lines_written_at_import_are_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # Written to file descriptor 2 itself, as TensorFlow's C++ side writes, past Python's sys.stderr.
    (tmp_path / "noisy_module.py").write_text(
        "import os\n"
        "os.write(2, b'WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\\n')\n"
        "os.write(2, b'I0000 port.cc:153] oneDNN custom operations are on.\\n')\n"
        "os.write(2, b'E0000 could not load libcudart.so\\n')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "noisy_module", raising=False)
    import_quietly("noisy_module", (b"absl::InitializeLog()", b"oneDNN custom operations"))
    assert "noisy_module" in sys.modules
    assert capfd.readouterr().err == "E0000 could not load libcudart.so\n"
    print("after", file=sys.stderr)  # standard error is itself again
    assert capfd.readouterr().err == "after\n"


def test_an_import_that_fails_raises_and_gives_standard_error_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "broken_module.py").write_text("import os\nos.write(2, b'why it failed\\n')\nraise ImportError('no')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match="no"):
        import_quietly("broken_module", (b"absl",))
    assert capfd.readouterr().err == "why it failed\n"
