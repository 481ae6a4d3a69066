"""Engine choice: ONNX exported once and verified against Keras, or the Keras call with a logged reason."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from layerserve.engine import KerasEngine, choose_engine, probe_batch
from layerserve.errors import ModelLoadError
from layerserve.model import read_signature
from tests.conftest import build_multi


def test_onnx_matches_keras_and_is_cached(tmp_path: Path) -> None:
    model = build_multi()
    signature = read_signature(model)
    probe = probe_batch(signature.inputs, 2)
    cache = tmp_path / "cache" / "abc.onnx"
    choice = choose_engine(model, signature.inputs, "auto", cache, probe, 1e-4, 0)
    assert choice.engine.name == "onnx" and "verified" in choice.reason
    rng = np.random.default_rng(0)
    batch = [rng.normal(size=(7, 4)).astype(np.float32), rng.integers(0, 10, (7, 3)).astype(np.int32)]
    expected = [o.numpy() for o in model(batch)]
    for got, want in zip(choice.engine.run(batch), expected, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
    stamp = cache.stat().st_mtime_ns
    again = choose_engine(model, signature.inputs, "auto", cache, probe, 1e-4, 0)
    assert again.engine.name == "onnx" and cache.stat().st_mtime_ns == stamp
    assert "(when exported)" in again.reason  # the recorded verification is reused, Keras is not traced


def test_export_failure_falls_back_to_keras_or_fails_when_onnx_is_forced(tmp_path: Path) -> None:
    model = build_multi()
    signature = read_signature(model)
    probe = probe_batch(signature.inputs, 2)
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    choice = choose_engine(model, signature.inputs, "auto", blocker / "x.onnx", probe, 1e-4, 0)
    assert choice.engine.name == "keras"
    assert choice.reason.startswith("ONNX export failed") and "Keras compiled call" in choice.reason
    with pytest.raises(ModelLoadError, match="ONNX export failed"):
        choose_engine(model, signature.inputs, "onnx", blocker / "x.onnx", probe, 1e-4, 0)


def test_verification_failure_falls_back(tmp_path: Path) -> None:
    model, other = build_multi(), build_multi()
    signature = read_signature(model)
    other.get_layer("regression").set_weights([w * 2.0 for w in other.get_layer("regression").get_weights()])
    probe = probe_batch(signature.inputs, 2)
    cache = tmp_path / "x.onnx"
    choose_engine(other, signature.inputs, "onnx", cache, probe, 1e-4, 0)
    (tmp_path / "x.onnx.verified.json").unlink()  # a stale graph under this key, never verified for it
    choice = choose_engine(model, signature.inputs, "auto", cache, probe, 1e-4, 0)
    assert choice.engine.name == "keras" and "verification failed" in choice.reason


def test_keras_engine_runs_any_batch_size() -> None:
    model = build_multi()
    engine = KerasEngine(model, read_signature(model).inputs)
    for rows in (1, 5):
        batch = probe_batch(read_signature(model).inputs, rows)
        assert [o.shape for o in engine.run(batch)] == [(rows, 2), (rows, 5)]
