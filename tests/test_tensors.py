"""Datatype mapping, JSON data conversion and shape checks."""

from __future__ import annotations

import numpy as np
import pytest

from layerserve.errors import BadRequestError
from layerserve.tensors import (
    DATATYPE_TO_DTYPE,
    TensorSpec,
    array_from_json,
    check_against_spec,
    datatype_of,
    parse_shape,
    reshape_checked,
)


@pytest.mark.parametrize("datatype", list(DATATYPE_TO_DTYPE))
def test_datatype_round_trip(datatype: str) -> None:
    assert datatype_of(DATATYPE_TO_DTYPE[datatype]) == datatype


def test_array_from_json_nested_and_flat() -> None:
    nested = array_from_json([[1, 2], [3, 4]], np.dtype(np.float32), "x")
    assert nested.dtype == np.float32 and nested.tolist() == [1, 2, 3, 4]
    assert array_from_json([True, False], np.dtype(bool), "x").tolist() == [True, False]
    assert array_from_json([["a", "é"]], np.dtype(object), "x").tolist() == [b"a", "é".encode()]


@pytest.mark.parametrize(
    ("data", "dtype", "message"),
    [
        ([[1, 2], [3]], np.float32, "one shape"),
        ([1, 2], bool, "expected true/false"),
        ([1.5], np.int32, "expected integers"),
        ([300], np.uint8, "out of range"),
        ([-1], np.uint32, "out of range"),
        (["a"], np.float32, "expected numbers"),
        ([1], object, "BYTES data must be strings"),
        ([b"\x00\x01"], np.int32, 'expected integers for INT32, got bytes \\(a {"b64": ...} object\\)'),
        ([b"\x00\x01"], np.float32, "expected numbers for FP32, got bytes"),
        ([b"\x00\x01"], bool, "expected true/false values for BOOL, got bytes"),
        ([1.5], bool, "expected true/false values for BOOL, got floating-point numbers"),
        (["a"], np.int32, "expected integers for INT32, got strings"),
        ([1, None], np.int32, "expected integers for INT32, got mixed values \\(integer, null\\)"),
        ([{"a": 1}], np.float32, "expected numbers for FP32, got object values"),
        ([1, True], np.int32, "expected integers for INT32, got true/false among them"),
        ([[0.5, 1.5], [False, 2.0]], np.float32, "expected numbers for FP32, got true/false among them"),
    ],
)
def test_array_from_json_rejects(data: object, dtype: type, message: str) -> None:
    with pytest.raises(BadRequestError, match=message):
        array_from_json(data, np.dtype(dtype), "input 'x'")


def test_numbers_from_text_without_true_or_false_are_not_searched_for_them() -> None:
    # The V2 parser says when the JSON text had neither word: numpy's reading is then taken as it is.
    assert array_from_json([1, True], np.dtype(np.int32), "x", may_hold_bools=False).tolist() == [1, 1]


def test_shapes() -> None:
    assert parse_shape([2, 3], "x") == (2, 3)
    for bad in ([2, -1], [2.0], "2", [2**40, 2**40]):
        with pytest.raises(BadRequestError):
            parse_shape(bad, "x")
    spec = TensorSpec("x", "FP32", (-1, 3))
    check_against_spec(spec, "FP32", (5, 3))
    with pytest.raises(BadRequestError, match="expected shape"):
        check_against_spec(spec, "FP32", (5, 4))
    with pytest.raises(BadRequestError, match="at least 1"):
        check_against_spec(spec, "FP32", (0, 3))
    with pytest.raises(BadRequestError, match="needs 6 elements, data has 5"):
        reshape_checked(np.zeros(5), (2, 3), "x")


def test_uint64_past_int64_and_integers_past_64_bits() -> None:
    big = array_from_json([0, 2**63, 2**64 - 1], np.dtype(np.uint64), "input 'x'")
    assert big.dtype == np.uint64 and big.tolist() == [0, 2**63, 2**64 - 1]
    with pytest.raises(BadRequestError, match="out of range for UINT64"):
        array_from_json([0, 2**64], np.dtype(np.uint64), "input 'x'")
    with pytest.raises(BadRequestError, match="out of range for INT64"):
        array_from_json([1, 2**63], np.dtype(np.int64), "input 'x'")
    with pytest.raises(BadRequestError, match="expected integers for UINT64"):
        array_from_json([2**63, 1.5], np.dtype(np.uint64), "input 'x'")
