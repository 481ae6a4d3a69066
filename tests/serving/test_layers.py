"""LayerGraph against Keras computed directly: layer outputs, cuts, nested models, missing tensors."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest

from layerserve.errors import BadRequestError
from layerserve.lifecycle.model import read_signature
from layerserve.serving.layers import LayerGraph, LayerInfo
from tests.models import build_mobilenet, build_multi, build_nested, build_sequential


def graph_of(model: Any) -> LayerGraph:
    return LayerGraph(read_signature(model), model)


def reference(model: Any, inputs: list[str], outputs: list[str], *arrays: np.ndarray) -> list[np.ndarray]:
    """The same tensors from a sub-model built by hand with Keras (what users write today)."""
    sub = keras.Model([model.get_layer(n).output for n in inputs], [model.get_layer(n).output for n in outputs])
    result = sub(list(arrays))
    return [np.asarray(r) for r in (result if isinstance(result, list) else [result])]


@pytest.fixture(scope="module")
def mobilenet() -> Any:
    return build_mobilenet()


@pytest.fixture(scope="module")
def images() -> np.ndarray:
    return np.random.default_rng(0).uniform(-1, 1, (3, 96, 96, 3)).astype(np.float32)


def test_layer_table_in_graph_order(mobilenet: Any) -> None:
    graph = graph_of(mobilenet)
    names = [layer.name for layer in graph.layers]
    assert names == [layer.name for layer in mobilenet.layers]
    add = graph.layers[names.index("block_2_add")]
    assert add.class_name == "Add" and add.inbound == ("block_1_project_BN", "block_2_project_BN")
    assert add.to_dict()["output_shapes"] == [[-1, 24, 24, 8]] and add.to_dict()["datatype"] == "FP32"


def test_several_layers_at_once_match_keras(mobilenet: Any, images: np.ndarray) -> None:
    graph = graph_of(mobilenet)
    wanted = ("block_2_add", "block_6_expand_relu", "predictions")
    got = graph.build_cut((mobilenet.layers[0].name,), wanted)(images)
    expected = reference(mobilenet, [mobilenet.layers[0].name], list(wanted), images)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(np.asarray(a), b, atol=1e-4)


def test_bottleneck_then_rest_equals_full_model(mobilenet: Any, images: np.ndarray) -> None:
    graph = graph_of(mobilenet)
    bottleneck = np.asarray(graph.build_cut((mobilenet.layers[0].name,), ("block_13_expand_relu",))(images))
    rest = np.asarray(graph.build_cut(("block_13_expand_relu",), ("predictions",))(bottleneck))
    np.testing.assert_allclose(rest, np.asarray(mobilenet(images)), atol=1e-4)


def test_cut_inside_residual_block_names_the_missing_branch(mobilenet: Any) -> None:
    graph = graph_of(mobilenet)
    with pytest.raises(BadRequestError, match="also need block_1_project_BN"):
        graph.build_cut(("block_2_project_BN",), ("block_2_add",))
    both = graph.build_cut(("block_1_project_BN", "block_2_project_BN"), ("block_2_add",))
    a, b = np.ones((1, 24, 24, 8), np.float32), np.full((1, 24, 24, 8), 2, np.float32)
    np.testing.assert_allclose(np.asarray(both([a, b])), a + b)


def test_unknown_name_lists_close_layers(mobilenet: Any) -> None:
    graph = graph_of(mobilenet)
    with pytest.raises(BadRequestError) as error:
        graph.spec("block_2_ad", "output")
    message = error.value.message
    assert message.startswith("unknown output 'block_2_ad'; close layer names: block_2_add")
    assert len(message.split(": ", 1)[1].split(", ")) <= 5


def test_multi_input_multi_output_functional() -> None:
    model = build_multi()
    graph = graph_of(model)
    rng = np.random.default_rng(1)
    features = rng.normal(size=(4, 4)).astype(np.float32)
    tokens = rng.integers(0, 10, (4, 3)).astype(np.int32)
    got = graph.build_cut(("features", "tokens"), ("embedding", "joined", "probs"))([features, tokens])
    expected = reference(model, ["features", "tokens"], ["embedding", "joined", "probs"], features, tokens)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(np.asarray(a), b, atol=1e-5)
    joined = np.asarray(got[1])
    regression = np.asarray(graph.build_cut(("joined",), ("regression",))(joined))
    np.testing.assert_allclose(regression, np.asarray(model([features, tokens])[0]), atol=1e-5)


def test_sequential_layers() -> None:
    model = build_sequential()
    graph = graph_of(model)
    hidden = model.layers[0].name
    x = np.random.default_rng(2).normal(size=(5, 6)).astype(np.float32)
    got = np.asarray(graph.build_cut((graph.signature.inputs[0].name,), (hidden,))(x))
    expected = keras.Model(model.inputs, model.layers[0].output)(x)
    np.testing.assert_allclose(got, np.asarray(expected), atol=1e-5)


def test_nested_model_layers_are_outer_slash_inner(images: np.ndarray) -> None:
    model = build_nested()
    graph = graph_of(model)
    base = model.layers[1]
    names = [layer.name for layer in graph.layers]
    inner = f"{base.name}/block_5_add"
    assert inner in names and base.name in names and names.index(inner) < names.index(base.name)
    first_inner = graph.layers[1]
    assert first_inner.name == f"{base.name}/Conv1" and first_inner.inbound == ("image",)
    feature, probs = graph.build_cut(("image",), (inner, "head"))(images)
    expected = keras.Model(base.inputs, base.get_layer("block_5_add").output)(images)
    np.testing.assert_allclose(np.asarray(feature), np.asarray(expected), atol=1e-4)
    np.testing.assert_allclose(np.asarray(probs), np.asarray(model(images)), atol=1e-4)
    rest = graph.build_cut((inner,), ("head",))(feature)
    np.testing.assert_allclose(np.asarray(rest), np.asarray(model(images)), atol=1e-4)


def test_layer_with_several_outputs_is_name_colon_index() -> None:
    x = keras.Input((5, 3), name="x")
    _sequence, hidden, cell = keras.layers.LSTM(4, return_state=True, return_sequences=True, name="lstm")(x)
    model = keras.Model(x, keras.layers.Dense(2, name="out")(hidden))
    graph = graph_of(model)
    assert {"lstm:0", "lstm:1", "lstm:2"} <= set(graph.names)
    assert graph.spec("lstm:0", "output").shape == (-1, 5, 4)
    data = np.random.default_rng(3).normal(size=(2, 5, 3)).astype(np.float32)
    got = graph.build_cut(("x",), ("lstm:2",))(data)
    expected = keras.Model(x, cell)(data)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5)


def test_graph_from_a_stored_table_loads_the_model_for_its_first_cut_only() -> None:
    model = build_multi()
    full = graph_of(model)
    loads: list[int] = []

    def load() -> Any:
        loads.append(1)
        return model

    table = tuple(LayerInfo.from_record(layer.to_record()) for layer in full.layers)
    lazy = LayerGraph.from_table(full.signature, table, "", load)
    assert lazy.names == full.names and lazy.spec("flat", "output") == full.spec("flat", "output")
    with pytest.raises(BadRequestError, match="close layer names: flat"):
        lazy.spec("flatt", "output")
    assert not loads  # names and specs come from the table
    tokens = np.arange(6, dtype=np.int32).reshape(2, 3) % 10
    cut = lazy.build_cut(("tokens",), ("flat",))
    np.testing.assert_allclose(np.asarray(cut(tokens)), reference(model, ["tokens"], ["flat"], tokens)[0])
    with pytest.raises(BadRequestError, match="also need features"):
        lazy.build_cut(("tokens",), ("joined",))
    assert loads == [1]
