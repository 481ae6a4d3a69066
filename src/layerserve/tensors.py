"""V2 datatypes <-> numpy dtypes, tensor specs, and shape checks (pure functions)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from layerserve.errors import BadRequestError

Array = NDArray[Any]

DATATYPE_TO_DTYPE: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(np.object_),
}
_DTYPE_TO_DATATYPE = {dtype: name for name, dtype in DATATYPE_TO_DTYPE.items()}
_MAX_ELEMENTS = 2**31


@dataclass(frozen=True)
class TensorSpec:
    """A named tensor: V2 datatype and shape, -1 for a free dimension (the batch dimension first)."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    @property
    def dtype(self) -> np.dtype[Any]:
        """The numpy dtype of this tensor's elements."""
        return DATATYPE_TO_DTYPE[self.datatype]

    def to_dict(self) -> dict[str, Any]:
        """The V2 metadata form `{name, datatype, shape}`."""
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TensorSpec:
        """Read the V2 metadata form."""
        return cls(str(data["name"]), str(data["datatype"]), tuple(int(dim) for dim in data["shape"]))


def datatype_of(dtype: np.dtype[Any] | str) -> str:
    """The V2 datatype name of a numpy dtype (strings and bytes are BYTES).

    Raises:
        BadRequestError: the dtype has no V2 datatype.
    """
    dtype = np.dtype(dtype)
    if dtype.kind in "SUO":
        return "BYTES"
    try:
        return _DTYPE_TO_DATATYPE[dtype]
    except KeyError:
        raise BadRequestError(f"dtype {dtype} has no V2 datatype") from None


def dtype_of(datatype: object, what: str) -> np.dtype[Any]:
    """The numpy dtype of a V2 datatype name.

    Raises:
        BadRequestError: the name is not a V2 datatype.
    """
    try:
        return DATATYPE_TO_DTYPE[datatype]  # type: ignore[index]  # non-str keys are caught below
    except (KeyError, TypeError):
        names = ", ".join(DATATYPE_TO_DTYPE)
        raise BadRequestError(f"{what}: unknown datatype {datatype!r}, expected one of {names}") from None


def parse_shape(shape: Any, what: str) -> tuple[int, ...]:
    """Check a request's shape: a list of non-negative integers whose product stays bounded.

    Raises:
        BadRequestError: the shape is not a list of non-negative integers, or is too large.
    """
    if not isinstance(shape, list) or not all(type(dim) is int for dim in shape):
        raise BadRequestError(f"{what}: shape must be a list of integers, got {shape!r:.80}")
    if any(dim < 0 for dim in shape):
        raise BadRequestError(f"{what}: shape {shape} has a negative dimension")
    if math.prod(shape) > _MAX_ELEMENTS:
        raise BadRequestError(f"{what}: shape {shape} has more than {_MAX_ELEMENTS} elements")
    return tuple(shape)


def check_against_spec(spec: TensorSpec, datatype: str, shape: tuple[int, ...]) -> None:
    """Check a request tensor's datatype and shape against the model's spec.

    Raises:
        BadRequestError: naming the input and what was expected.
    """
    if datatype != spec.datatype:
        raise BadRequestError(f"input '{spec.name}': expected datatype {spec.datatype}, got {datatype}")
    expected = list(spec.shape)
    fits = len(shape) == len(expected) and all(e in (-1, d) for e, d in zip(expected, shape, strict=True))
    if not fits:
        raise BadRequestError(f"input '{spec.name}': expected shape {expected}, got {list(shape)}")
    if shape and shape[0] == 0:
        raise BadRequestError(f"input '{spec.name}': the batch dimension must be at least 1, got shape {list(shape)}")


def check_batch_sizes(arrays: dict[str, Array]) -> int:
    """All inputs of one request share their first dimension; return it.

    Raises:
        BadRequestError: the inputs disagree on the batch size.
    """
    sizes = {name: array.shape[0] if array.ndim else 1 for name, array in arrays.items()}
    if len(set(sizes.values())) > 1:
        raise BadRequestError(f"inputs disagree on the batch size (first dimension): {sizes}")
    return next(iter(sizes.values()), 0)


def array_from_json(data: Any, dtype: np.dtype[Any], what: str, may_hold_bools: bool = True) -> Array:
    """Turn JSON data (nested or flat lists, or a scalar) into a flat array of `dtype`. `may_hold_bools=False` says
    the JSON text had no `true` or `false`, so that numbers need no search for them.

    Raises:
        BadRequestError: ragged lists, or values that do not fit the datatype.
    """
    if dtype.kind == "O":
        return _bytes_from_json(data, what)
    try:
        values = np.asarray(data)
    except (ValueError, TypeError):
        raise BadRequestError(f"{what}: data must be a (nested) list of numbers of one shape") from None
    values = values.reshape(-1)
    kind = values.dtype.kind
    if values.size == 0:
        return values.astype(dtype)
    if dtype.kind == "b" and kind != "b":
        raise BadRequestError(f"{what}: expected true/false values for BOOL, got {_given(values)}")
    if kind in "iuf" and may_hold_bools and _holds_bools(data):
        # numpy reads true as 1 beside numbers: refused, as Triton and TF Serving refuse it
        expected = "integers" if dtype.kind in "iu" else "numbers"
        raise BadRequestError(f"{what}: expected {expected} for {datatype_of(dtype)}, got true/false among them")
    if dtype.kind in "iu" and kind not in "iu":
        return _big_integers(data, dtype, _given(values), what)
    if dtype.kind == "f" and kind not in "fiu":
        raise BadRequestError(f"{what}: expected numbers for {datatype_of(dtype)}, got {_given(values)}")
    if dtype.kind in "iu":
        low, high = _integer_range(dtype)
        if values.min() < low or values.max() > high:
            raise BadRequestError(f"{what}: values out of range for {datatype_of(dtype)}")
    return values.astype(dtype)


def _holds_bools(data: Any) -> bool:
    """Whether nested lists hold a true or false anywhere."""
    stack = [data]
    while stack:
        item = stack.pop()
        if type(item) is list:
            stack.extend(item)
        elif type(item) is bool:
            return True
    return False


@functools.cache
def _integer_range(dtype: np.dtype[Any]) -> tuple[int, int]:
    """The smallest and largest value of an integer dtype (np.iinfo costs microseconds a call)."""
    info = np.iinfo(dtype)
    return int(info.min), int(info.max)


def _big_integers(data: Any, dtype: np.dtype[Any], given: str, what: str) -> Array:
    """Integers numpy could not hold in one integer dtype (UINT64 values past 2^63 beside small ones, or
    values past 2^64), checked one by one; `given` says what the data is, for the message.

    Raises:
        BadRequestError: a value that is not an integer, or out of the datatype's range.
    """
    values = np.asarray(data, dtype=object).reshape(-1)
    if not all(type(value) is int for value in values):
        raise BadRequestError(f"{what}: expected integers for {datatype_of(dtype)}, got {given}")
    info = np.iinfo(dtype)
    if not all(info.min <= value <= info.max for value in values):
        raise BadRequestError(f"{what}: values out of range for {datatype_of(dtype)}")
    return np.array(values.tolist(), dtype=dtype)


_KIND_NAMES = {
    "b": "true/false values",
    "i": "integers",
    "u": "integers",
    "f": "floating-point numbers",
    "U": "strings",
    "S": 'bytes (a {"b64": ...} object)',
}
_JSON_NAMES = {"NoneType": "null", "bool": "true/false", "int": "integer", "float": "number", "str": "string",
               "bytes": "bytes", "dict": "object", "list": "list"}  # fmt: skip


def _given(values: Array) -> str:
    """What JSON data was, in words, for messages (bytes come only from TF Serving's `{"b64": ...}`)."""
    kind = values.dtype.kind
    if kind != "O":
        return _KIND_NAMES.get(kind, f"data of numpy kind {kind!r}")
    found = sorted({_JSON_NAMES.get(type(value).__name__, type(value).__name__) for value in values[:1000]})
    return f"{found[0]} values" if len(found) == 1 else f"mixed values ({', '.join(found)})"


def _bytes_from_json(data: Any, what: str) -> Array:
    flat: list[bytes] = []
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(reversed(item))
        elif isinstance(item, str):
            flat.append(item.encode("utf-8"))
        else:
            raise BadRequestError(f"{what}: BYTES data must be strings, got {type(item).__name__}")
    array = np.empty(len(flat), dtype=object)
    array[:] = flat
    return array


def reshape_checked(values: Array, shape: tuple[int, ...], what: str) -> Array:
    """Give a flat array its declared shape.

    Raises:
        BadRequestError: the element count does not match the shape.
    """
    expected = math.prod(shape)
    if values.size != expected:
        raise BadRequestError(f"{what}: shape {list(shape)} needs {expected} elements, data has {values.size}")
    return values.reshape(shape)
