"""Engine choice: the ONNX export verified against Keras, or the Keras call with the reason; the preparer's
child process that loads, exports and verifies off the server process."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from layerserve.engines.base import Verdict, onnx_cache_path, probe_batch
from layerserve.engines.choice import choose_engine
from layerserve.engines.keras import KerasEngine
from layerserve.engines.onnx import export_and_verify
from layerserve.errors import ModelLoadError
from layerserve.lifecycle.model import file_digest, read_signature
from layerserve.lifecycle.prepare import ModelSource, Preparer, read_record
from layerserve.serving.layers import LayerGraph
from tests.models import build_mlp, build_multi, build_nested, save_model


def test_onnx_matches_keras(tmp_path: Path) -> None:
    model = build_multi()
    signature = read_signature(model)
    cache = tmp_path / "cache" / "abc.onnx"
    verdict = export_and_verify(model, signature.inputs, cache, probe_batch(signature.inputs, 2))
    assert verdict.max_difference is not None and verdict.max_difference < 1e-5 and not verdict.error
    choice = choose_engine(verdict, "auto", cache, signature.inputs, 1e-4, 0, lambda: pytest.fail("no fallback"))
    assert choice.engine.name == "onnx" and "verified" in choice.reason
    rng = np.random.default_rng(0)
    batch = [rng.normal(size=(7, 4)).astype(np.float32), rng.integers(0, 10, (7, 3)).astype(np.int32)]
    expected = [o.numpy() for o in model(batch)]
    for got, want in zip(choice.engine.run(batch), expected, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_export_failure_falls_back_to_keras_or_fails_when_onnx_is_forced(tmp_path: Path) -> None:
    model = build_multi()
    signature = read_signature(model)
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    verdict = export_and_verify(model, signature.inputs, blocker / "x.onnx", probe_batch(signature.inputs, 2))
    assert verdict.max_difference is None and verdict.error.startswith("ONNX export failed")
    keras_engine = KerasEngine(model, signature.inputs)
    choice = choose_engine(verdict, "auto", blocker / "x.onnx", signature.inputs, 1e-4, 0, lambda: keras_engine)
    assert choice.engine is keras_engine and "Keras compiled call" in choice.reason
    with pytest.raises(ModelLoadError, match="ONNX export failed"):
        choose_engine(verdict, "onnx", blocker / "x.onnx", signature.inputs, 1e-4, 0, lambda: keras_engine)


def test_verification_failure_falls_back(tmp_path: Path) -> None:
    model, other = build_multi(), build_multi()
    signature = read_signature(model)
    other.get_layer("regression").set_weights([w * 2.0 for w in other.get_layer("regression").get_weights()])
    cache = tmp_path / "x.onnx"
    export_and_verify(other, signature.inputs, cache, probe_batch(signature.inputs, 2))
    # A stale graph under this key (another model's): verification against this model finds it out.
    verdict = export_and_verify(model, signature.inputs, cache, probe_batch(signature.inputs, 2))
    assert verdict.max_difference is not None and verdict.max_difference > 1e-2
    keras_engine = KerasEngine(model, signature.inputs)
    choice = choose_engine(verdict, "auto", cache, signature.inputs, 1e-4, 0, lambda: keras_engine)
    assert choice.engine is keras_engine and "verification failed" in choice.reason


def test_keras_engine_runs_any_batch_size() -> None:
    model = build_multi()
    engine = KerasEngine(model, read_signature(model).inputs)
    for rows in (1, 5):
        batch = probe_batch(read_signature(model).inputs, rows)
        assert [o.shape for o in engine.run(batch)] == [(rows, 2), (rows, 5)]


def test_keras_engines_of_one_model_are_not_taken_for_retracing(caplog: pytest.LogCaptureFixture) -> None:
    # A model's cuts each get an engine, each traced once: TensorFlow warned "5 out of the last 5 calls to <function
    # KerasEngine.__init__.<locals>.call> triggered tf.function retracing" in the server's log.
    model = build_multi()
    inputs = read_signature(model).inputs
    batch = probe_batch(inputs, 2)
    expected = model([*batch], training=False)
    with caplog.at_level("WARNING", logger="tensorflow"):
        for _ in range(6):
            outputs = KerasEngine(model, inputs).run(batch)
            np.testing.assert_allclose(outputs[0], expected[0], rtol=1e-6)
    assert not [record.getMessage() for record in caplog.records if "retracing" in record.getMessage()]


def test_preparer_child_records_layer_table_and_verdict_once(tmp_path: Path) -> None:
    model = build_nested()
    path = save_model(model, tmp_path / "m", "model.keras")
    source = ModelSource(path, file_digest(path), trust=False)
    cache = onnx_cache_path(tmp_path / "cache", source.digest)
    preparer = Preparer()
    try:
        prepared = preparer.model(source, cache, 2)
    finally:
        preparer.close()
    in_process = LayerGraph(read_signature(model), model)
    assert prepared.signature == in_process.signature and list(prepared.layers) == in_process.layers
    assert prepared.layer_count == len(model.layers)
    assert prepared.verdict.max_difference is not None and prepared.verdict.max_difference < 1e-4
    assert read_record(cache) is not None
    stamp = cache.stat().st_mtime_ns
    again = Preparer()  # a fresh preparer reads the record: no child process is started
    assert again.model(source, cache, 2) == prepared and again._child is None
    assert cache.stat().st_mtime_ns == stamp
    assert again.model(source, cache, 2) is again.model(source, cache, 2)  # parsed once, then kept
    record = cache.with_name(cache.name + ".json")
    record.write_text(record.read_text().replace('"layer_count": ', '"layer_count": 1000'))
    assert again.model(source, cache, 2).layer_count == int(f"1000{len(model.layers)}")  # a new record is read


def test_probe_batches_are_deterministic_and_read_only() -> None:
    inputs = read_signature(build_multi()).inputs
    first, second = probe_batch(inputs, 3), probe_batch(inputs, 3)
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)
        assert not a.flags.writeable
    assert [a.shape[0] for a in probe_batch(inputs, 5)] == [5, 5]


def test_preparer_reports_load_errors_and_a_dead_child(tmp_path: Path) -> None:
    corrupt = tmp_path / "model.keras"
    corrupt.write_bytes(b"not a zip")
    preparer = Preparer()
    try:
        source = ModelSource(corrupt, file_digest(corrupt), trust=False)
        with pytest.raises(ModelLoadError, match=r"not a \.keras archive"):
            preparer.model(source, tmp_path / "c.onnx", 1)
        assert read_record(tmp_path / "c.onnx") is None  # a load error is not kept: the file may be fixed
        with pytest.raises(ModelLoadError, match="preparation process died"):
            preparer._run(os._exit, 1)
        with pytest.raises(ModelLoadError, match=r"not a \.keras archive"):
            preparer.model(source, tmp_path / "c.onnx", 1)  # a new child takes over
    finally:
        preparer.close()


def test_model_source_refuses_a_file_that_changed(tmp_path: Path) -> None:
    path = save_model(build_multi(), tmp_path, "model.keras")
    source = ModelSource(path, file_digest(path), trust=False)
    assert read_signature(source.load()).inputs[0].name == "features"
    save_model(build_nested(), tmp_path, "model.keras")
    with pytest.raises(ModelLoadError, match="changed since this version was loaded"):
        source.load()


def test_verdict_round_trips() -> None:
    for verdict in (Verdict(1.5e-6), Verdict(None, "ONNX export failed: x")):
        assert Verdict.from_dict(verdict.to_dict()) == verdict


def test_an_export_failed_by_the_disk_is_not_kept_and_the_next_load_exports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from layerserve.engines import onnx
    from layerserve.lifecycle.prepare import prepare_model

    path = save_model(build_mlp(3), tmp_path / "m", "model.keras")
    source = ModelSource(path, file_digest(path), trust=False)
    cache = onnx_cache_path(tmp_path / "cache", source.digest)
    cache.parent.mkdir()

    def disk_full(*args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(onnx, "export_onnx", disk_full)
        failed = prepare_model(source, cache, 2)
    assert failed["max_difference"] is None and "No space left on device" in failed["export_error"]
    assert read_record(cache) is None  # not kept: the disk may have room by the next load
    exported = prepare_model(source, cache, 2)
    assert exported["max_difference"] is not None and exported["max_difference"] < 1e-4
    assert read_record(cache) == {"format": read_record(cache)["format"], **exported}  # type: ignore[index]
