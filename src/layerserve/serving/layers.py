"""LayerGraph: every layer of a version addressable by name (nested models as `outer/inner`), and cuts."""

from __future__ import annotations

import difflib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from layerserve.errors import BadRequestError, NotFoundError
from layerserve.lifecycle.model import Signature
from layerserve.tensors import TensorSpec, datatype_of

_MAX_SUGGESTIONS = 5


@dataclass(frozen=True)
class LayerInfo:
    """One row of the layer table: a layer (or model input) and the tensors it produces."""

    name: str
    class_name: str
    outputs: tuple[TensorSpec, ...]
    inbound: tuple[str, ...]
    input_dim: int | None = None  # an Embedding's vocabulary: its integer input must lie in [0, input_dim)

    def to_dict(self) -> dict[str, Any]:
        """The `/layers` form."""
        return {
            "name": self.name,
            "class_name": self.class_name,
            "output_shapes": [list(spec.shape) for spec in self.outputs],
            "datatype": self.outputs[0].datatype if self.outputs else "",
            "inbound": list(self.inbound),
        }

    def to_record(self) -> dict[str, Any]:
        """The stored form (see layerserve.lifecycle.prepare)."""
        outputs = [spec.to_dict() for spec in self.outputs]
        record = {"name": self.name, "class_name": self.class_name, "outputs": outputs, "inbound": list(self.inbound)}
        return record if self.input_dim is None else {**record, "input_dim": self.input_dim}

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> LayerInfo:
        """Read the stored form."""
        outputs = tuple(TensorSpec.from_dict(spec) for spec in data["outputs"])
        input_dim = data.get("input_dim")
        return cls(
            str(data["name"]), str(data["class_name"]), outputs, tuple(data["inbound"]),
            None if input_dim is None else int(input_dim),
        )  # fmt: skip


def _graph_of(model: Any) -> Any:
    """The functional graph behind a Functional or Sequential model, or None (subclassed models)."""
    graph = getattr(model, "_functional", None) or model
    return graph if hasattr(graph, "_nodes_by_depth") else None


def _spec(name: str, tensor: Any) -> TensorSpec:
    shape = tuple(-1 if dim is None else int(dim) for dim in tensor.shape)
    return TensorSpec(name=name, datatype=datatype_of(str(tensor.dtype)), shape=shape)


class _Replay:
    """Rebuilds a model's graph on fresh inputs, inlining nested models, naming every tensor."""

    def __init__(self) -> None:
        self.tensors: dict[str, Any] = {}
        self.names: dict[int, str] = {}
        self.layers: list[LayerInfo] = []

    def _register(
        self, name: str, class_name: str, outputs: list[Any], inbound: tuple[str, ...], input_dim: int | None = None
    ) -> None:
        if name in self.tensors or f"{name}:0" in self.tensors:
            return  # a shared layer called again: its first call names it
        names = [name] if len(outputs) == 1 else [f"{name}:{i}" for i in range(len(outputs))]
        for tensor_name, tensor in zip(names, outputs, strict=True):
            self.tensors[tensor_name] = tensor
            self.names.setdefault(id(tensor), tensor_name)
        specs = tuple(_spec(n, t) for n, t in zip(names, outputs, strict=True))
        self.layers.append(LayerInfo(name, class_name, specs, inbound, input_dim))

    def run(self, graph: Any, inputs: list[Any], prefix: str) -> list[Any]:
        """Replay `graph` on `inputs`; returns the new tensors standing for its outputs."""
        import keras

        values = {id(x): y for x, y in zip(keras.tree.flatten(graph.inputs), inputs, strict=True)}
        for depth in sorted(graph._nodes_by_depth, reverse=True):
            for node in graph._nodes_by_depth[depth]:
                if node.is_input:
                    continue
                args, kwargs = node.arguments.fill_in(values)
                operation = node.operation
                inner = _graph_of(operation)
                inbound = tuple(self.names.get(id(values[id(x)]), "") for x in node.input_tensors)
                if inner is not None:
                    tensors = [t for t in keras.tree.flatten((args, kwargs)) if isinstance(t, keras.KerasTensor)]
                    outputs = self.run(inner, tensors, f"{prefix}{operation.name}/")
                else:
                    outputs = keras.tree.flatten(operation(*args, **kwargs))
                for old, new in zip(node.outputs, outputs, strict=True):
                    values[id(old)] = new
                input_dim = getattr(operation, "input_dim", None) if type(operation).__name__ == "Embedding" else None
                self._register(f"{prefix}{operation.name}", type(operation).__name__, outputs, inbound, input_dim)
        return [values[id(x)] for x in keras.tree.flatten(graph.outputs)]


class LayerGraph:
    """A version's addressable tensors: model inputs and outputs, and every layer's output by name.

    Built from a Keras model, or from a stored layer table with a `load` function that gives the Keras
    model when the first cut needs its tensors (see layerserve.lifecycle.prepare).
    """

    def __init__(self, signature: Signature, model: Any = None) -> None:
        self.signature = signature
        self.layers: list[LayerInfo] = []
        self._tensors: dict[str, Any] = {}
        self._specs: dict[str, TensorSpec] = {s.name: s for s in (*signature.inputs, *signature.outputs)}
        self._load: Callable[[], Any] | None = None
        self._lock = threading.Lock()
        self.unavailable_reason = "" if model is not None else "no Keras graph"
        graph = _graph_of(model) if model is not None else None
        if model is not None and graph is None:
            self.unavailable_reason = "a subclassed model has no graph of layers: use a functional or Sequential model"
        if graph is not None:
            self._replay(graph)

    @classmethod
    def from_table(
        cls, signature: Signature, layers: tuple[LayerInfo, ...], unavailable_reason: str, load: Callable[[], Any]
    ) -> LayerGraph:
        """A graph whose names come from a stored layer table; `load` gives the model for the first cut."""
        graph = cls(signature)
        graph.layers = list(layers)
        graph._specs.update({spec.name: spec for layer in layers for spec in layer.outputs})
        graph.unavailable_reason = unavailable_reason
        graph._load = load
        return graph

    def _ensure_tensors(self) -> None:
        """Load and replay the model if this graph was built from a table and has not done so yet."""
        with self._lock:
            if self._load is None:
                return
            model = self._load()
            self._replay(_graph_of(model))
            self._load = None

    def _replay(self, graph: Any) -> None:
        import keras

        replay = _Replay()
        fresh = []
        for spec, tensor in zip(self.signature.inputs, keras.tree.flatten(graph.inputs), strict=True):
            new = keras.Input(shape=tensor.shape[1:], dtype=tensor.dtype, name=spec.name)
            replay._register(spec.name, "InputLayer", [new], ())
            fresh.append(new)
        outputs = replay.run(graph, fresh, "")
        for spec, tensor in zip(self.signature.outputs, outputs, strict=True):
            replay.tensors.setdefault(spec.name, tensor)
            replay.names.setdefault(id(tensor), spec.name)
        self.layers, self._tensors = replay.layers, replay.tensors
        self._specs.update({spec.name: spec for layer in self.layers for spec in layer.outputs})

    def index_ranges(self) -> dict[str, tuple[int, str]]:
        """Tensor name -> (the vocabulary size, the Embedding layer) for every tensor that feeds an Embedding: its
        values must lie in [0, size). A tensor feeding several Embeddings gets the smallest."""
        ranges: dict[str, tuple[int, str]] = {}
        for layer in self.layers:
            if layer.input_dim is None:
                continue
            for name in layer.inbound:
                if name and (name not in ranges or layer.input_dim < ranges[name][0]):
                    ranges[name] = (layer.input_dim, layer.name)
        return ranges

    @property
    def names(self) -> list[str]:
        """Every addressable tensor name, in graph order."""
        return list(self._specs)

    def spec(self, name: str, role: str) -> TensorSpec:
        """The spec of a named tensor (`role` is 'input' or 'output', for the message).

        Raises:
            BadRequestError: no such tensor; lists up to 5 close names.
        """
        try:
            return self._specs[name]
        except KeyError:
            raise BadRequestError(self.unknown_message(name, role)) from None

    def unknown_message(self, name: str, role: str) -> str:
        """`unknown <role> 'x'` with the closest layer names, or why layers are not available."""
        close = difflib.get_close_matches(name, self.names, n=_MAX_SUGGESTIONS, cutoff=0.5)
        if close:
            hint = f"close layer names: {', '.join(close)}"
        else:
            defaults = self.signature.inputs if role == "input" else self.signature.outputs
            hint = f"the model's {role}s are: {', '.join(s.name for s in defaults)}"
            if not self.unavailable_reason:
                hint += f", or any layer by name (its /layers route lists all {len(self.names)})"
        if self.unavailable_reason:
            hint += f" (layer outputs unavailable: {self.unavailable_reason})"
        return f"unknown {role} '{name}'; {hint}"

    def is_full_model(self, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> bool:
        """Whether the model's own call answers this request (model inputs in, model outputs out)."""
        model_outputs = {s.name for s in self.signature.outputs}
        return set(inputs) == {s.name for s in self.signature.inputs} and set(outputs) <= model_outputs

    def check_cut(self, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> None:
        """Check a cut against the layer table: known names, and outputs computable from the inputs (where the
        table tells; a shared layer's second call has no name of its own, and Keras checks such cuts).

        Raises:
            BadRequestError: an unknown name, or outputs that depend on a tensor not given (named in the message).
            NotFoundError: the model has no layer graph.
        """
        if self.unavailable_reason:
            raise NotFoundError(f"layer outputs unavailable: {self.unavailable_reason}")
        for name in inputs:
            self.spec(name, "input")
        for name in outputs:
            self.spec(name, "output")
        missing = self.missing(inputs, outputs)
        if missing:
            raise BadRequestError(
                f"outputs {', '.join(outputs)} also need {', '.join(missing)}, which the request does not give; "
                f"add it to 'inputs' (cut there too) or cut elsewhere"
            )

    def missing(self, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> list[str] | None:
        """Names of tensors the outputs need that cannot be computed from the inputs (empty: none), from the layer
        table; None where the table cannot tell."""
        producers = {spec.name: layer.inbound for layer in self.layers for spec in layer.outputs}
        given = set(inputs)
        computable: dict[str, bool] = {}
        parents: dict[str, tuple[str, ...]] = {}
        stack = list(outputs)
        while stack:
            name = stack[-1]
            if name in computable:
                stack.pop()
            elif name in given:
                computable[name] = True
                stack.pop()
            elif name not in parents:
                if name not in producers:
                    return None  # a model output that is no layer's, or an unnamed tensor
                parents[name] = producers[name]
                stack.extend(parent for parent in parents[name] if parent not in computable)
            else:
                computable[name] = bool(parents[name]) and all(computable[parent] for parent in parents[name])
                stack.pop()
        frontier = {
            parent
            for ins in parents.values()
            if any(computable[p] for p in ins)
            for parent in ins
            if not computable[parent]
        }
        if not frontier:
            frontier = {name for name, ins in parents.items() if not ins}
        return sorted(frontier)

    def build_cut(self, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> Any:
        """A Keras model from the named tensors to the named outputs (sharing the version's weights).

        Raises:
            BadRequestError: see check_cut; also outputs that Keras finds depend on a tensor not given.
            NotFoundError: the model has no layer graph.
        """
        import keras

        self.check_cut(inputs, outputs)
        self._ensure_tensors()
        given = [self._tensors[name] for name in inputs]
        wanted = [self._tensors[name] for name in outputs]
        try:  # Single tensors rather than 1-lists, so that calling the cut with one array matches its structure.
            return keras.Model(inputs=given[0] if len(given) == 1 else given, outputs=wanted)
        except ValueError as error:  # a path the table could not follow: Keras' own word on what is missing
            raise BadRequestError(f"outputs {', '.join(outputs)} cannot be computed from {', '.join(inputs)}: "
                                  f"{error}") from None  # fmt: skip

    def layer_values(self, batch: list[Any]) -> dict[str, Any]:
        """Every layer output's value for a batch of the model's inputs, by tensor name (Keras: in the preparer's
        child)."""
        import keras

        self._ensure_tensors()
        names = [spec.name for layer in self.layers for spec in layer.outputs]
        inputs = [self._tensors[spec.name] for spec in self.signature.inputs]
        probe = keras.Model(inputs=inputs[0] if len(inputs) == 1 else inputs, outputs=[self._tensors[n] for n in names])
        values = probe(batch[0] if len(batch) == 1 else batch)
        return {name: np.asarray(value) for name, value in zip(names, values, strict=True)}
