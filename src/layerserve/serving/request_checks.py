"""RequestChecks: the one place a request is checked against a version's signature and layer graph.

Every transport's codec only translates; what it hands over is checked here, once, before anything is queued:
input names, datatypes and shapes (model inputs or cut layers), that all model inputs are given, equal batch
sizes, and the names of the outputs asked for. Embedding index ranges depend on the values alone: the batcher
checks them on each batch's joined arrays (`index_check`), and only when a batch fails, each of its requests
alone, so that a bad request is refused with its own position and never computed with the others.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

import numpy as np

from layerserve.errors import BadRequestError
from layerserve.serving.layers import LayerGraph
from layerserve.tensors import Array, TensorSpec, check_against_spec, check_batch_sizes, datatype_of

_UNSIGNED = {size: np.dtype(f"u{size}") for size in (1, 2, 4, 8)}  # integer width -> the unsigned dtype of it
_MAX_SIGNATURES = 1024  # input signatures (names, dtypes, shapes) remembered as checked, per version


def check_input(
    name: str, datatype: str, shape: tuple[int, ...], graph: LayerGraph, encoded_input: str | None
) -> TensorSpec:
    """Check one named input (a model input or a cut layer) against the version's graph; returns its spec.

    `encoded_input` (an image or text model's input) may also come as BYTES of shape [N] or [N, 1].

    Raises:
        BadRequestError: no input or layer of that name, or the datatype or shape does not fit.
    """
    spec = graph.spec(name, "input")
    if name == encoded_input and datatype == "BYTES":
        if len(shape) not in (1, 2) or shape[0] < 1 or math.prod(shape) != shape[0]:
            raise BadRequestError(f"input '{name}': encoded images need shape [N] or [N, 1], got {list(shape)}")
    else:
        check_against_spec(spec, datatype, shape)
    return spec


def check_model_inputs(inputs: Collection[str], graph: LayerGraph) -> None:
    """A request that names only model inputs must give all of them (cuts are checked by the graph).

    Raises:
        BadRequestError: naming the missing inputs.
    """
    model_inputs = [spec.name for spec in graph.signature.inputs]
    if set(inputs) <= set(model_inputs):
        missing = [name for name in model_inputs if name not in inputs]
        if missing:
            raise BadRequestError(f"missing input(s): {', '.join(missing)}")


def _base64_elements(array: Array, what: str) -> Array:
    decoded = np.empty(array.shape, dtype=object)
    try:
        for index, element in np.ndenumerate(array):
            decoded[index] = base64.b64decode(element, validate=True)
    except binascii.Error:
        raise BadRequestError(f"{what}: encoded images in JSON data must be base64 strings") from None
    return decoded


class RequestChecks:
    """The checks of one version (see the module docstring); built once when the version loads."""

    def __init__(self, graph: LayerGraph, encoded_input: str | None = None, takes_images: bool = False) -> None:
        self._graph = graph
        self._encoded_input = encoded_input
        self._takes_images = takes_images
        self._index_ranges = graph.index_ranges()
        self._passed: set[tuple[tuple[str, np.dtype[Any], tuple[int, ...]], ...]] = set()  # signatures that passed
        self._passed_outputs: set[tuple[str, ...]] = set()  # output name lists that passed

    def declared(self, name: str, datatype: str, shape: tuple[int, ...]) -> None:
        """Check one input's declared name, datatype and shape before a codec reads its data (so that a request
        of the wrong datatype is told so, not that its data has the wrong size).

        Raises:
            BadRequestError: as `check_input`.
        """
        check_input(name, datatype, shape, self._graph, self._encoded_input)

    def inputs(self, inputs: Mapping[str, Any], base64_inputs: Collection[str] = ()) -> dict[str, Array]:
        """The inputs as arrays, checked; a list takes its tensor's datatype (an array keeps its own, so a float64
        array for an FP32 input is refused); base64 text of encoded images is decoded.

        Raises:
            BadRequestError: naming the input and what was expected.
        """
        if not inputs:
            raise BadRequestError("'inputs' must be a non-empty list")
        arrays: dict[str, Array] = {
            name: value if isinstance(value, np.ndarray) else self._from_list(name, value)
            for name, value in inputs.items()
        }
        # Names, datatypes and shapes decide every check but the index ranges: a signature that passed once passes.
        # (The dtype itself, not `dtype.str`: that formats a new string each time.)
        signature = tuple((name, array.dtype, array.shape) for name, array in arrays.items())
        if signature not in self._passed:
            self._check_signature(arrays)
            if len(self._passed) >= _MAX_SIGNATURES:
                self._passed.clear()
            self._passed.add(signature)
        for name in base64_inputs:
            if name == self._encoded_input and self._takes_images and name in arrays:
                arrays[name] = _base64_elements(arrays[name], f"input '{name}'")  # texts come as plain strings
        return arrays

    def _check_signature(self, arrays: dict[str, Array]) -> None:
        """Each input's name, datatype and shape; that every model input is given; one batch size."""
        for name, array in arrays.items():
            if array.ndim == 0:
                raise BadRequestError(f"input '{name}': expected an array with a batch dimension, got a scalar")
            check_input(name, datatype_of(array.dtype), tuple(array.shape), self._graph, self._encoded_input)
        check_model_inputs(arrays, self._graph)
        check_batch_sizes(arrays)

    def _from_list(self, name: str, value: Any) -> Array:
        try:
            return np.asarray(value, dtype=self._graph.spec(name, "input").dtype)
        except (ValueError, TypeError, OverflowError):
            raise BadRequestError(f"input '{name}': data must be a (nested) list of numbers of one shape") from None

    def outputs(self, names: tuple[str, ...]) -> None:
        """Every requested output (by name) names a model output or a layer, once.

        Raises:
            NotFoundError / BadRequestError: an unknown name (with the nearest names), or a name given twice.
        """
        if names in self._passed_outputs:
            return
        for name in names:
            self._graph.spec(name, "output")
        if len(set(names)) != len(names):
            raise BadRequestError(f"output names must be unique, got {list(names)}")
        if len(self._passed_outputs) >= _MAX_SIGNATURES:
            self._passed_outputs.clear()
        self._passed_outputs.add(names)

    def check_index_ranges(self, inputs: Mapping[str, Array]) -> None:
        """`index_check` on one request's named arrays.

        Raises:
            BadRequestError: a value that indexes an Embedding is out of its range.
        """
        check = self.index_check(tuple(inputs))
        if check is not None:
            check(list(inputs.values()))

    def index_check(self, names: tuple[str, ...]) -> Callable[[list[Array]], None] | None:
        """The check of a batch's arrays of inputs `names` (in that order): values that index an Embedding must lie
        in [0, its input_dim), else BadRequestError naming the first one and its position; None when none of
        `names` indexes an Embedding."""
        ranges = [(i, name, *self._index_ranges[name]) for i, name in enumerate(names) if name in self._index_ranges]
        if not ranges:
            return None

        def check(arrays: list[Array]) -> None:
            for i, name, size, layer in ranges:
                check_index_range(arrays[i], name, size, layer)

        return check


def check_index_range(array: Array, name: str, size: int, layer: str) -> None:
    """Values of input `name` that index Embedding `layer` of `size` rows must be integers from 0 to size - 1.

    Raises:
        BadRequestError: naming the first value out of range and its position.
    """
    kind = array.dtype.kind
    if kind not in "iuf" or array.size == 0:
        return
    if kind in "iu":  # one reduction: seen unsigned, a negative value is past any size
        if array.view(_UNSIGNED[array.dtype.itemsize]).max() < size:
            return
    elif array.min() >= 0 and array.max() < size:
        return
    position = tuple(int(i) for i in np.argwhere((array < 0) | (array >= size) | np.isnan(array))[0])
    raise BadRequestError(
        f"input '{name}': value {array[position]} at position {list(position)} is out of range: it indexes "
        f"Embedding '{layer}' of {size} rows, so values must be integers from 0 to {size - 1}"
    )
