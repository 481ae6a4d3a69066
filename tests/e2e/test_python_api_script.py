"""The README's Python API snippet, saved as a user's `app.py` without a `__main__` guard and run with `python
app.py`: layerserve's child processes never run the user's script again (they did when multiprocessing started
them: every child re-imported `__main__`, and loaded every model once more)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

README_SNIPPET = """\
from layerserve.blocking import BlockingRuntime
from layerserve.messages import InferRequest
from layerserve.settings import Settings

runtime = BlockingRuntime(Settings(model_repository="models"))    # loads every model, once per process
print(runtime.infer(InferRequest("token_classifier", {"tokens": [[1, 2, 3] + [0] * 61]})).outputs["scores"])
"""


def test_the_readme_snippet_run_as_a_script_answers_once(
    demo_repository: Path, demo_engine_cache: Path, tmp_path: Path
) -> None:
    (tmp_path / "models").symlink_to(demo_repository, target_is_directory=True)  # token_classifier, EfficientNet
    (tmp_path / "app.py").write_text(README_SNIPPET)
    # The snippet's Settings keep the default engine_cache_dir, under the home folder: the session's demo cache
    # there, so that EfficientNet is exported once per test run.
    home = tmp_path / "home"
    (home / ".cache" / "layerserve").mkdir(parents=True)
    (home / ".cache" / "layerserve" / "onnx").symlink_to(demo_engine_cache, target_is_directory=True)
    run = subprocess.run(
        [sys.executable, "app.py"], check=False, cwd=tmp_path, env={**os.environ, "HOME": str(home)},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert run.stdout.count("[[") == 1, output  # one answer: the script ran once
    for sign in ("Traceback", "FAILED", "bootstrapping"):
        assert sign not in output, output
