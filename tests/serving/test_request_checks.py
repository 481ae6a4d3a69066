"""RequestChecks against the `multi` model's graph read from Keras: names, datatypes, shapes, model inputs,
batch sizes, Embedding ranges, outputs, lists and base64 images."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from layerserve.errors import BadRequestError
from layerserve.lifecycle.model import read_signature
from layerserve.serving.layers import LayerGraph
from layerserve.serving.request_checks import RequestChecks
from tests.models import build_multi


@pytest.fixture(scope="module")
def checks() -> RequestChecks:
    model = build_multi()
    return RequestChecks(LayerGraph(read_signature(model), model))


def _good(rows: int = 2) -> dict[str, np.ndarray]:
    return {"features": np.zeros((rows, 4), np.float32), "tokens": np.ones((rows, 3), np.int32)}


def test_good_inputs_pass_and_lists_take_the_tensor_s_datatype(checks: RequestChecks) -> None:
    arrays = checks.inputs({"features": [[0.5] * 4], "tokens": [[1, 2, 9]]})
    assert arrays["features"].dtype == np.float32 and arrays["tokens"].dtype == np.int32
    joined = checks.inputs({"joined": np.zeros((3, 10), np.float32)})  # a cut: the layer 'joined' as the input
    assert joined["joined"].shape == (3, 10)
    checks.outputs(("probs", "embedding"))


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({}, "non-empty"),
        ({"nope": np.zeros((1, 4), np.float32)}, "unknown input 'nope'"),
        ({**_good(), "features": np.zeros((2, 4), np.float64)}, "expected datatype FP32, got FP64"),
        ({**_good(), "features": np.zeros((2, 5), np.float32)}, "expected shape [-1, 4], got [2, 5]"),
        ({"features": np.zeros((2, 4), np.float32)}, "missing input(s): tokens"),
        ({**_good(), "tokens": np.ones((3, 3), np.int32)}, "inputs disagree on the batch size"),
        ({"features": np.float32(1.0), "tokens": np.ones((1, 3), np.int32)}, "got a scalar"),
        ({"features": [[0.5] * 4, [0.5]], "tokens": [[1, 2, 3]] * 2}, "one shape"),
    ],
)
def test_bad_inputs_are_refused_naming_the_problem(
    checks: RequestChecks, inputs: dict[str, object], message: str
) -> None:
    with pytest.raises(BadRequestError) as raised:
        checks.inputs(inputs)
    assert message in raised.value.message


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        (np.array([[1, 2, 10], [0, 0, 0]], np.int32), "input 'tokens': value 10 at position [0, 2]"),
        (np.array([[1, 2, 3], [0, -1, 0]], np.int32), "value -1 at position [1, 1]"),
        (np.array([[1, 2, 3], [0, 2**31 - 1, 0]], np.int32), "from 0 to 9"),
        (np.array([[1.0, 2.5, 3.0], [0.0, 10.0, 0.0]], np.float32), "value 10.0 at position [1, 1]"),
        (np.array([[np.nan, 2.0, 3.0]], np.float32), "value nan at position [0, 0]"),
    ],
)
def test_values_past_an_embedding_are_refused_naming_value_and_position(
    checks: RequestChecks, tokens: np.ndarray, message: str
) -> None:
    with pytest.raises(BadRequestError) as raised:
        checks.check_index_ranges({**_good(2), "tokens": tokens})
    assert message in raised.value.message and "Embedding 'embedding' of 10 rows" in raised.value.message
    check = checks.index_check(("features", "tokens"))  # a batch's check: the arrays in the order of their names
    assert check is not None
    with pytest.raises(BadRequestError, match="out of range"):
        check([np.zeros((len(tokens), 4), np.float32), tokens])
    check([np.zeros((2, 4), np.float32), np.array([[0, 9, 3], [1, 1, 1]], np.int32)])  # in range: passes
    assert checks.index_check(("features",)) is None  # names that index no Embedding: nothing to check


def test_outputs_must_exist_once(checks: RequestChecks) -> None:
    with pytest.raises(BadRequestError, match="unknown output 'nothing'"):
        checks.outputs(("nothing",))
    with pytest.raises(BadRequestError, match="output names must be unique"):
        checks.outputs(("probs", "probs"))
    checks.outputs(("probs",))
    with pytest.raises(BadRequestError, match="output names must be unique"):  # a name list that passed is kept,
        checks.outputs(("probs", "probs"))  # one that failed is checked again


def test_base64_text_of_encoded_images_is_decoded_only_for_image_inputs() -> None:
    model = build_multi()
    graph = LayerGraph(read_signature(model), model)
    png, tokens = b"\x89PNG fake bytes", np.ones((1, 3), np.int32)
    encoded = np.array([base64.b64encode(png)], dtype=object)
    images = RequestChecks(graph, "features", takes_images=True)
    assert images.inputs({"features": encoded, "tokens": tokens}, {"features"})["features"][0] == png
    with pytest.raises(BadRequestError, match="must be base64"):
        images.inputs({"features": np.array([b"not base64!"], dtype=object), "tokens": tokens}, {"features"})
    raw = images.inputs(
        {"features": np.array([png], dtype=object), "tokens": tokens}
    )  # raw bytes (binary data, gRPC) stay
    assert raw["features"][0] == png
    texts = RequestChecks(graph, "features", takes_images=False)
    assert (
        texts.inputs({"features": np.array([b"hello"], dtype=object), "tokens": tokens}, {"features"})["features"][0]
        == b"hello"
    )


def test_a_signature_that_passed_is_not_checked_again(checks: RequestChecks) -> None:
    fresh = RequestChecks(checks._graph)  # its own memory of passed signatures
    good = _good(2)
    assert fresh.inputs(good)["tokens"] is good["tokens"]
    for bad, message in [
        ({**good, "tokens": np.ones((3, 3), np.int32)}, "inputs disagree on the batch size"),
        ({"features": good["features"]}, "missing input"),
        ({**good, "features": good["features"].astype(">f4")}, "has no V2 datatype"),  # another byte order
    ]:
        with pytest.raises(BadRequestError, match=message):
            fresh.inputs(bad)
    assert len(fresh._passed) == 1
