"""Layers inside a verified ONNX export: where each layer's output lives in the graph (found once, in the preparer's
child, by matching Keras' values on the probe batch), and cuts taken out of the export by those tensor names, so
that the server runs a new cut without TensorFlow and without a new export.

tf2onnx keeps most layers' outputs as tensors of their own; convolutions may run channels-first inside (a
transpose at the graph's edges). A convolution whose batch normalization it folded in has no tensor of its own, but
the normalization's output is the convolution's times a per-channel scale plus a shift: such a layer is located at
that tensor with the inverse scale and shift (fitted on the probe batch), which a cut applies at its edge.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from layerserve.engines.base import CACHE_FILE_MODE, graph_name, max_difference
from layerserve.errors import ModelLoadError
from layerserve.tensors import Array, TensorSpec

_TO_CHANNELS_FIRST = (0, 3, 1, 2)
_TO_CHANNELS_LAST = (0, 2, 3, 1)


@dataclass(frozen=True)
class TensorPlace:
    """Where a layer's output is in the exported graph: a tensor, channels-first when the layer's is last, and for a
    layer folded away the per-channel `scale` and `shift` (of the layer's last axis) that give its output from the
    tensor: `layer = tensor * scale + shift`."""

    tensor: str
    channels_first: bool = False
    scale: tuple[float, ...] | None = None
    shift: tuple[float, ...] | None = None

    def to_record(self) -> list[Any]:
        """The stored form."""
        if self.scale is None or self.shift is None:
            return [self.tensor, self.channels_first]
        return [self.tensor, self.channels_first, list(self.scale), list(self.shift)]

    @classmethod
    def from_record(cls, data: list[Any]) -> TensorPlace:
        """Read the stored form."""
        if len(data) == 4:
            return cls(str(data[0]), bool(data[1]), tuple(map(float, data[2])), tuple(map(float, data[3])))
        return cls(str(data[0]), bool(data[1]))


class CutNotExtractableError(ModelLoadError):
    """The export's graph does not compute the cut's outputs from its inputs alone (export it instead)."""


def locate_layers(onnx_file: Path, feed: dict[str, Array], expected: dict[str, Array], atol: float) -> dict[str, Any]:
    """(child) Each layer output of `expected` (Keras' values on the probe `feed`, by tensor name) -> the graph
    tensor holding the same values, as records; the graph inputs by name. Layers with no such tensor are left out."""
    import onnx
    import onnxruntime as ort

    model = onnx.load(str(onnx_file))
    produced = [name for node in model.graph.node for name in node.output if name]
    del model.graph.output[:]
    model.graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in produced)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # every tensor as exported
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    inputs = {graph.name: graph for graph in session.get_inputs()}
    # The graph's inputs first: where a node merely copies an input (a Cast to the same type, say), the input
    # layer is located at the graph input itself, which every cut from it starts at.
    values = {name: feed[name] for name in inputs}
    values.update(zip(produced, session.run(None, {name: feed[name] for name in inputs}), strict=True))
    candidates: dict[tuple[int, ...], list[tuple[str, bool]]] = {}
    for name, value in values.items():
        candidates.setdefault(value.shape, []).append((name, False))
        if value.ndim == 4:
            candidates.setdefault(np.transpose(value, _TO_CHANNELS_LAST).shape, []).append((name, True))
    located: dict[str, Any] = {}
    for layer, reference in expected.items():
        best: tuple[float, str, bool] | None = None
        for name, channels_first in candidates.get(reference.shape, []):
            value = values[name]
            if value.dtype != reference.dtype:
                continue
            difference = max_difference(
                [reference], [np.transpose(value, _TO_CHANNELS_LAST) if channels_first else value]
            )
            if difference <= atol and (best is None or (difference, channels_first) < (best[0], best[2])):
                best = (difference, name, channels_first)
        if best is not None:
            located[layer] = TensorPlace(best[1], best[2]).to_record()
        elif reference.dtype.kind == "f" and reference.ndim >= 2:
            affine = _affine_place(reference, candidates.get(reference.shape, []), values, atol)
            if affine is not None:
                located[layer] = affine.to_record()
    return located


def _affine_place(
    reference: Array, candidates: list[tuple[str, bool]], values: dict[str, Array], atol: float
) -> TensorPlace | None:
    """The candidate tensor from which `reference` is one scale and shift per channel (its last axis), fitted by
    least squares; the closest within `atol` (relative to the reference's magnitude above 1), or None."""
    channels = reference.shape[-1]
    target = reference.astype(np.float64).reshape(-1, channels)
    tolerance = atol * max(1.0, float(np.max(np.abs(target))))
    best: tuple[float, TensorPlace] | None = None
    for name, channels_first in candidates:
        value = values[name]
        if value.dtype.kind != "f":
            continue
        laid = np.transpose(value, _TO_CHANNELS_LAST) if channels_first else value
        source = laid.astype(np.float64).reshape(-1, channels)
        centred = source - source.mean(axis=0)
        spread = (centred**2).sum(axis=0)
        # A channel constant on the probe (a filter of zeros, say) gets scale 1: the error check below then asks
        # the layer's channel to be constant too.
        constant = spread <= len(source) * (1e-6 * max(1.0, float(np.max(np.abs(source))))) ** 2
        covariance = (centred * (target - target.mean(axis=0))).sum(axis=0)
        scale = np.where(constant, 1.0, covariance / np.where(constant, 1.0, spread))
        shift = target.mean(axis=0) - scale * source.mean(axis=0)
        if np.any(np.abs(scale) < 1e-6):  # not invertible: a cut could not start from this layer
            continue
        error = float(np.max(np.abs(source * scale + shift - target)))
        if error <= tolerance and (best is None or error < best[0]):
            best = (error, TensorPlace(name, channels_first, tuple(scale.tolist()), tuple(shift.tolist())))
    return None if best is None else best[1]


def extract_cut(
    onnx_file: Path, inputs: list[tuple[TensorSpec, TensorPlace]], outputs: list[tuple[str, TensorPlace]], target: Path
) -> None:
    """Write the part of the export that computes `outputs` from `inputs` as a graph of its own, whose inputs and
    outputs are named and laid out as the layers' (channels-last, as Keras has them), to `target` atomically.

    Raises:
        CutNotExtractableError: that part needs a tensor the inputs do not give (a shape computed from the model's
            input, say).
    """
    import onnx

    model = onnx.load(str(onnx_file))
    graph = model.graph
    given = {place.tensor for _, place in inputs}
    wanted = [place.tensor for _, place in outputs]
    producer = {name: node for node in graph.node for name in node.output}
    constants = {tensor.name for tensor in graph.initializer}
    kept: dict[int, Any] = {}
    seen: set[str] = set()
    stack = list(wanted)
    while stack:
        name = stack.pop()
        if name in seen or name in given or name in constants or not name:
            continue
        seen.add(name)
        node = producer.get(name)
        if node is None:
            raise CutNotExtractableError(f"the exported graph computes these outputs from '{name}' too")
        if id(node) not in kept:
            kept[id(node)] = node
            stack.extend(node.input)
    nodes = [node for node in graph.node if id(node) in kept]  # the graph's own (topological) order
    affine: list[Any] = []  # the scales and shifts of folded layers at the cut's edges
    entry = [edge for index, (spec, place) in enumerate(inputs) for edge in _input_edges(index, spec, place, affine)]
    exit_ = [edge for index, (_, place) in enumerate(outputs) for edge in _output_edges(index, place, affine)]
    graph_inputs = [_value_info(graph_name(spec.name), spec) for spec, _ in inputs]
    graph_outputs = [onnx.helper.make_empty_tensor_value_info(f"cut_output_{index}") for index in range(len(outputs))]
    used = {name for node in nodes for name in node.input}
    initializers = [tensor for tensor in graph.initializer if tensor.name in used] + affine
    cut = onnx.helper.make_graph(entry + nodes + exit_, "cut", graph_inputs, graph_outputs, initializers)
    extracted = onnx.helper.make_model(cut, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    _write_atomically(extracted.SerializeToString(), target)


def _input_edges(index: int, spec: TensorSpec, place: TensorPlace, affine: list[Any]) -> list[Any]:
    """The nodes from the cut's input `index` (channels-last, as the layer's) to its tensor in the export."""
    import onnx

    name, edges = graph_name(spec.name), []
    if place.scale is not None and place.shift is not None:  # the tensor = (layer - shift) / scale
        shifted, unscaled = f"cut_input_{index}_shifted", f"cut_input_{index}_unscaled"
        shift = _constant(f"cut_input_{index}_shift", place.shift, spec.dtype, affine)
        scale = _constant(f"cut_input_{index}_scale", place.scale, spec.dtype, affine)
        edges.append(onnx.helper.make_node("Sub", [name, shift], [shifted]))
        edges.append(onnx.helper.make_node("Div", [shifted, scale], [unscaled]))
        name = unscaled
    if place.channels_first:
        edges.append(onnx.helper.make_node("Transpose", [name], [place.tensor], perm=list(_TO_CHANNELS_FIRST)))
    elif name != place.tensor:  # a model input keeps its name
        edges.append(onnx.helper.make_node("Identity", [name], [place.tensor]))
    return edges


def _output_edges(index: int, place: TensorPlace, affine: list[Any]) -> list[Any]:
    """The nodes from an output's tensor in the export to the cut's output `index` (channels-last)."""
    import onnx

    name = f"cut_output_{index}"
    perm = {"perm": list(_TO_CHANNELS_LAST)} if place.channels_first else {}
    if place.scale is None or place.shift is None:
        return [onnx.helper.make_node("Transpose" if perm else "Identity", [place.tensor], [name], **perm)]
    laid, scaled = f"cut_output_{index}_laid", f"cut_output_{index}_scaled"  # the layer = tensor * scale + shift
    scale = _constant(f"cut_output_{index}_scale", place.scale, np.float32, affine)
    shift = _constant(f"cut_output_{index}_shift", place.shift, np.float32, affine)
    return [
        onnx.helper.make_node("Transpose" if perm else "Identity", [place.tensor], [laid], **perm),
        onnx.helper.make_node("Mul", [laid, scale], [scaled]),
        onnx.helper.make_node("Add", [scaled, shift], [name]),
    ]


def _constant(name: str, values: tuple[float, ...], dtype: Any, initializers: list[Any]) -> str:
    """Add a 1-D initializer of `values` as `dtype` to `initializers`; its name."""
    import onnx

    initializers.append(onnx.numpy_helper.from_array(np.asarray(values, dtype=dtype), name))
    return name


def _value_info(name: str, spec: TensorSpec) -> Any:
    import onnx

    element = onnx.helper.np_dtype_to_tensor_dtype(spec.dtype)
    return onnx.helper.make_tensor_value_info(name, element, [None if dim < 0 else dim for dim in spec.shape])


def _write_atomically(content: bytes, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(suffix=".onnx.tmp", dir=target.parent)
    try:
        os.fchmod(handle, CACHE_FILE_MODE)
        with os.fdopen(handle, "wb") as file:
            file.write(content)
        Path(temporary).replace(target)
    finally:
        Path(temporary).unlink(missing_ok=True)
