"""CutCache: a new cut serves at once on Keras, then switches to the ONNX engine the preparer verified; LRU."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from layerserve.lifecycle.model import file_digest, read_signature
from layerserve.lifecycle.prepare import ModelSource, Preparer
from layerserve.serving.cuts import CutCache
from layerserve.serving.layers import LayerGraph
from layerserve.settings import Settings
from tests.models import build_multi, save_model


def test_cut_starts_on_keras_then_switches_to_onnx(tmp_path: Path) -> None:
    model = build_multi()
    path = save_model(model, tmp_path / "m", "model.keras")
    graph = LayerGraph(read_signature(model), model)
    exporter, preparer = ThreadPoolExecutor(1), Preparer()
    source = ModelSource(path, file_digest(path), trust=False)
    cache = CutCache(graph, source, Settings(engine_cache_dir=tmp_path / "cache"), exporter, preparer)
    cut = cache.get(("features", "tokens"), ("joined",))
    assert cut.engine.name == "keras" and "while the ONNX export runs" in cut.engine_reason
    features = np.ones((2, 4), np.float32)
    tokens = np.zeros((2, 3), np.int32)
    on_keras = cut.engine.run([features, tokens])[0]
    exporter.shutdown(wait=True)  # the background export has finished
    preparer.close()
    assert cut.engine.name == "onnx" and "verified" in cut.engine_reason
    np.testing.assert_allclose(cut.engine.run([features, tokens])[0], on_keras, atol=1e-5)
    assert cache.get(("features", "tokens"), ("joined",)) is cut
    assert cache.describe() == [cut.to_dict()]


def test_bounded_and_keras_only(tmp_path: Path) -> None:
    model = build_multi()
    path = save_model(model, tmp_path / "m", "model.keras")
    graph = LayerGraph(read_signature(model), model)
    settings = Settings(engine_cache_dir=tmp_path / "cache", engine="keras", max_cuts_per_version=2)
    exporter, preparer = ThreadPoolExecutor(1), Preparer()
    cache = CutCache(graph, ModelSource(path, file_digest(path), trust=False), settings, exporter, preparer)
    for output in ("embedding", "flat", "joined"):
        assert cache.get(("features", "tokens"), (output,)).engine.name == "keras"
    assert [c["outputs"] for c in cache.describe()] == [["flat"], ["joined"]]
    exporter.shutdown(wait=True)
    assert all(c["engine"] == "keras" for c in cache.describe()) and preparer._pool is None
