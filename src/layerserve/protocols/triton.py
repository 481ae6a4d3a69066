"""Triton's model configuration (the JSON of `GET /v2/models/{m}/config`) of a loaded version, and the
server extensions layerserve answers."""

from __future__ import annotations

from typing import Any

from layerserve.messages import ModelMetadata
from layerserve.settings import VersionPolicy
from layerserve.tensors import TensorSpec

# The server extensions layerserve answers (Triton's names, and its own layer outputs).
EXTENSIONS = [
    "binary_tensor_data",
    "classification",
    "model_repository",
    "statistics",
    "model_configuration",
    "logging",
    "layer_outputs",
]

SHARED_MEMORY_UNSUPPORTED = (
    "shared memory is not supported by layerserve; send tensors in the request body (binary tensor data)"
)
TRACE_SETTINGS_UNSUPPORTED = (
    "Triton's trace settings are not supported by layerserve: it sends OpenTelemetry traces to the collector at the "
    "setting otlp_endpoint, sampled per trace_sampling_ratio (set at start)"
)


def triton_datatype(datatype: str) -> str:
    """A V2 datatype as Triton's config spells it: `FP32` -> `TYPE_FP32`, `BYTES` -> `TYPE_STRING`."""
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def _tensor(spec: TensorSpec, is_batched: bool) -> dict[str, Any]:
    dims = list(spec.shape[1:] if is_batched else spec.shape)
    return {"name": spec.name, "data_type": triton_datatype(spec.datatype), "dims": dims}


def _version_policy(policy: VersionPolicy) -> dict[str, Any]:
    if policy.all:
        return {"all": {}}
    if policy.specific is not None:
        return {"specific": {"versions": sorted(policy.specific)}}
    return {"latest": {"num_versions": policy.latest or 1}}


def model_config(version: ModelMetadata) -> dict[str, Any]:
    """The Triton model configuration of one version: its signature, batching and version policy.

    `max_batch_size` is 0 (and dims are whole shapes) when an input has no free batch dimension.
    """
    batching = version.batching
    is_batched = all(spec.shape and spec.shape[0] == -1 for spec in version.inputs)
    delay_ms = batching["max_delay_ms"]
    assert isinstance(delay_ms, float)
    return {
        "name": version.name,
        "platform": "keras_tensorflow",
        "backend": "onnxruntime" if version.engine == "onnx" else "keras",
        "version_policy": _version_policy(version.version_policy),
        "max_batch_size": batching["max_batch_size"] if is_batched else 0,
        "input": [_tensor(spec, is_batched) for spec in version.inputs],
        "output": [_tensor(spec, is_batched) for spec in version.outputs],
        "dynamic_batching": {
            "preferred_batch_size": [],
            "max_queue_delay_microseconds": round(delay_ms * 1000),
            "preserve_ordering": False,
            "default_queue_policy": {"max_queue_size": batching["max_queue_size"], "timeout_action": "REJECT"},
        },
        "instance_group": [{"name": f"{version.name}_0", "kind": "KIND_MODEL", "count": 1}],
        "parameters": {"description": {"string_value": version.description}},
    }
