"""KerasEngine: the model's call compiled once as a `tf.function` (the fallback where ONNX cannot serve)."""

from __future__ import annotations

from typing import Any

import numpy as np

from layerserve.engines.base import EngineKind, graph_name
from layerserve.tensors import Array, TensorSpec


def tf_spec(spec: TensorSpec) -> Any:
    """The TensorFlow input spec of a tensor, with a free batch dimension where the model has one."""
    import tensorflow as tf

    shape = [None if dim == -1 else dim for dim in spec.shape]
    dtype = tf.string if spec.datatype == "BYTES" else tf.as_dtype(spec.dtype)
    return tf.TensorSpec(shape=shape, dtype=dtype, name=graph_name(spec.name))


class KerasEngine:
    """The model's call compiled once as a `tf.function` with a free batch dimension."""

    name = EngineKind.KERAS
    in_process = True

    def __init__(self, model: Any, inputs: tuple[TensorSpec, ...]) -> None:
        import keras
        import tensorflow as tf

        self._flatten = keras.tree.flatten
        signature = [tf_spec(spec) for spec in inputs]
        single = len(inputs) == 1

        def call(*tensors: Any) -> Any:
            return model(tensors[0] if single else list(tensors), training=False)

        self._function = tf.function(call, input_signature=signature, autograph=False)
        # Called as its one concrete function: TensorFlow's retracing detector, which a tf.function's calls go
        # through, counts the engines of one model's cuts (one `call` each, each traced once) as one function
        # traced again and again, and warned "5 out of the last 5 calls ... triggered tf.function retracing".
        self._concrete: Any = None

    def run(self, inputs: list[Array]) -> list[Array]:
        """Compute the outputs for one batch."""
        if self._concrete is None:
            self._concrete = self._function.get_concrete_function()
        return [np.asarray(t) for t in self._flatten(self._concrete(*inputs))]

    def resident(self) -> tuple[int, int]:
        """Nothing in another process: (0, 0)."""
        return 0, 0

    def close(self) -> None:
        """Nothing to do: the function is freed with the object."""
