"""CutCache: a cut taken out of the served export answers at once (no Keras here) and is checked against Keras after;
one the export does not hold is exported while the request waits; a version on Keras here serves a new cut on Keras
at once, then on the ONNX engine the preparer verified; LRU."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from layerserve.engines.base import onnx_cache_path
from layerserve.errors import BadRequestError
from layerserve.lifecycle.model import file_digest, read_signature
from layerserve.lifecycle.prepare import ModelSource, Preparer, record_path
from layerserve.serving.cuts import CutCache, ServedExport
from layerserve.serving.layers import LayerGraph
from layerserve.settings import Settings
from tests.models import build_conv_bn, build_multi, save_model


def test_cut_starts_on_keras_then_switches_to_onnx(tmp_path: Path) -> None:
    model = build_multi()
    path = save_model(model, tmp_path / "m", "model.keras")
    graph = LayerGraph(read_signature(model), model)
    exporter, preparer = ThreadPoolExecutor(1), Preparer()
    source = ModelSource(path, file_digest(path), trust=False)
    settings = Settings(engine_cache_dir=tmp_path / "cache")
    cache = CutCache(graph, source, settings, exporter, preparer, keras_here=True)
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
    source = ModelSource(path, file_digest(path), trust=False)
    cache = CutCache(graph, source, settings, exporter, preparer, keras_here=True)
    for output in ("embedding", "flat", "joined"):
        assert cache.get(("features", "tokens"), (output,)).engine.name == "keras"
    assert [c["outputs"] for c in cache.describe()] == [["flat"], ["joined"]]
    exporter.shutdown(wait=True)
    assert all(c["engine"] == "keras" for c in cache.describe()) and preparer._child is None


def _served(tmp_path: Path, build: Any = build_multi) -> tuple[Any, LayerGraph, ModelSource, Preparer, ServedExport]:
    """`multi` (or what `build` builds) prepared by the preparer's child, as a version serving its export sees it:
    the layer table, and where each layer's output is in the export (no Keras model here)."""
    model = build()
    path = save_model(model, tmp_path / "m", "model.keras")
    source, preparer = ModelSource(path, file_digest(path), trust=False), Preparer()
    export = onnx_cache_path(tmp_path / "cache", source.digest)
    prepared = preparer.model(source, export, 2)
    graph = LayerGraph.from_table(prepared.signature, prepared.layers, "", source.load)
    return model, graph, source, preparer, ServedExport(export, prepared.located)


def _keras_cut(model: Any, inputs: list[str], outputs: list[str], feed: list[np.ndarray]) -> list[np.ndarray]:
    import keras

    tensors = LayerGraph(read_signature(model), model)._tensors
    answers = keras.Model([tensors[n] for n in inputs], [tensors[n] for n in outputs])(feed)
    return [np.asarray(x) for x in (answers if isinstance(answers, list) else [answers])]


def test_a_cut_out_of_the_export_answers_at_once_and_is_checked_against_keras(tmp_path: Path) -> None:
    model, graph, source, preparer, export = _served(tmp_path)
    assert {"embedding", "flat", "joined", "features", "tokens"} <= set(export.located)
    exporter = ThreadPoolExecutor(1)
    cache = CutCache(graph, source, Settings(engine_cache_dir=tmp_path / "cache"), exporter, preparer, export)
    cut = cache.get(("features", "flat"), ("joined", "probs"))  # from a layer to a layer and a model output
    assert cut.engine.name == "onnx" and "cut out of the verified export" in cut.engine_reason
    assert graph._load is not None  # the Keras model was never loaded here
    features = np.random.default_rng(1).normal(size=(3, 4)).astype(np.float32)
    flat = np.random.default_rng(0).normal(size=(3, 6)).astype(np.float32)
    want = _keras_cut(model, ["features", "flat"], ["joined", "probs"], [features, flat])
    for got, expected in zip(cut.engine.run([features, flat]), want, strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-5)
    exporter.shutdown(wait=True)  # the check in the preparer's child has run
    preparer.close()
    assert "checked against Keras: max difference" in cut.engine_reason, cut.engine_reason
    again = CutCache(graph, source, Settings(engine_cache_dir=tmp_path / "cache"), ThreadPoolExecutor(1), preparer,
                     export)  # fmt: skip
    assert "checked against Keras" in again.get(("features", "flat"), ("joined", "probs")).engine_reason  # kept


def test_a_cut_from_the_model_inputs_is_taken_out_of_the_export(tmp_path: Path) -> None:
    model, graph, source, preparer, export = _served(tmp_path)
    assert export.located["tokens"].tensor == "tokens"  # the graph input, not a copy of it inside the graph
    cache = CutCache(graph, source, Settings(engine_cache_dir=tmp_path / "cache"), ThreadPoolExecutor(1), preparer,
                     export)  # fmt: skip
    cut = cache.get(("features", "tokens"), ("joined", "probs"))
    assert "cut out of the verified export" in cut.engine_reason, cut.engine_reason
    features = np.random.default_rng(2).normal(size=(3, 4)).astype(np.float32)
    tokens = np.random.default_rng(3).integers(0, 10, (3, 3)).astype(np.int32)
    want = _keras_cut(model, ["features", "tokens"], ["joined", "probs"], [features, tokens])
    for got, expected in zip(cut.engine.run([features, tokens]), want, strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-5)
    preparer.close()


def test_a_cut_the_export_does_not_hold_is_exported_while_the_request_waits(tmp_path: Path) -> None:
    model, graph, source, preparer, export = _served(tmp_path)
    partial = ServedExport(export.path, {k: v for k, v in export.located.items() if k != "joined"})
    cache = CutCache(graph, source, Settings(engine_cache_dir=tmp_path / "cache"), ThreadPoolExecutor(1), preparer,
                     partial)  # fmt: skip
    cut = cache.get(("features", "tokens"), ("joined",))
    assert cut.engine.name == "onnx" and "verified against Keras" in cut.engine_reason, cut.engine_reason
    features, tokens = np.ones((2, 4), np.float32), np.zeros((2, 3), np.int32)
    want = _keras_cut(model, ["features", "tokens"], ["joined"], [features, tokens])[0]
    np.testing.assert_allclose(cut.engine.run([features, tokens])[0], want, atol=1e-5)
    assert graph._load is not None
    preparer.close()


def test_a_cut_that_failed_its_check_is_exported_instead(tmp_path: Path) -> None:
    _, graph, source, preparer, export = _served(tmp_path)
    settings = Settings(engine_cache_dir=tmp_path / "cache")
    exporter = ThreadPoolExecutor(1)
    first = CutCache(graph, source, settings, exporter, preparer, export)
    assert "cut out of" in first.get(("features", "flat"), ("joined",)).engine_reason
    exporter.shutdown(wait=True)
    taken = first._cache_file(("features", "flat"), ("joined",), "-extracted")
    record = json.loads(record_path(taken).read_text())
    record_path(taken).write_text(json.dumps({**record, "max_difference": 0.5}))  # as a failed check leaves it
    cut = CutCache(graph, source, settings, ThreadPoolExecutor(1), preparer, export).get(
        ("features", "flat"), ("joined",)
    )
    assert "verified against Keras" in cut.engine_reason and "cut out of" not in cut.engine_reason
    preparer.close()


def test_a_cut_that_needs_a_missing_tensor_is_refused_from_the_table(tmp_path: Path) -> None:
    _, graph, source, preparer, export = _served(tmp_path)
    cache = CutCache(graph, source, Settings(engine_cache_dir=tmp_path / "cache"), ThreadPoolExecutor(1), preparer,
                     export)  # fmt: skip
    with pytest.raises(BadRequestError, match="also need flat"):
        cache.get(("features",), ("joined",))
    assert graph._load is not None and not (tmp_path / "cache" / "cuts").exists()  # refused from the table alone


def test_a_convolution_the_export_folded_is_cut_out_of_it_with_its_scale_and_shift(tmp_path: Path) -> None:
    model, graph, source, preparer, export = _served(tmp_path, build_conv_bn)
    place = export.located["conv"]  # no tensor of its own: found at the normalization's output, scaled back
    assert place.scale is not None and place.tensor == export.located["bn"].tensor, place
    exporter = ThreadPoolExecutor(1)
    cache = CutCache(graph, source, Settings(engine_cache_dir=tmp_path / "cache"), exporter, preparer, export)
    image = np.random.default_rng(4).uniform(-1, 1, (3, 8, 8, 3)).astype(np.float32)
    to_conv = cache.get(("image",), ("conv", "probs"))
    assert "cut out of the verified export" in to_conv.engine_reason, to_conv.engine_reason
    for got, expected in zip(to_conv.engine.run([image]), _keras_cut(model, ["image"], ["conv", "probs"], [image]),
                             strict=True):  # fmt: skip
        np.testing.assert_allclose(got, expected, atol=1e-5)
    conv = np.random.default_rng(5).normal(size=(3, 6, 6, 6)).astype(np.float32)
    from_conv = cache.get(("conv",), ("probs",))  # a cut that starts at the folded layer
    assert "cut out of the verified export" in from_conv.engine_reason, from_conv.engine_reason
    want = _keras_cut(model, ["conv"], ["probs"], [conv])[0]
    np.testing.assert_allclose(from_conv.engine.run([conv])[0], want, atol=1e-5)
    exporter.shutdown(wait=True)  # both checks against Keras have run in the preparer's child
    preparer.close()
    assert all("checked against Keras: max difference" in c.engine_reason for c in (to_conv, from_conv))
