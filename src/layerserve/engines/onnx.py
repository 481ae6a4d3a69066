"""OnnxEngine: an ONNX Runtime session over a version's exported graph; export and verification against Keras."""

from __future__ import annotations

import logging
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

from layerserve.engines.base import CACHE_FILE_MODE, EngineKind, Verdict, graph_name, max_difference
from layerserve.engines.keras import KerasEngine, tf_spec
from layerserve.errors import ModelLoadError
from layerserve.gpu import onnx_providers
from layerserve.tensors import Array, TensorSpec

log = logging.getLogger(__name__)


class OnnxEngine:
    """An ONNX Runtime session over an exported graph."""

    name = EngineKind.ONNX
    in_process = True

    def __init__(self, path: Path, inputs: tuple[TensorSpec, ...], threads: int, shared_arena: bool = False) -> None:
        """Open the session; with `shared_arena`, its activations in the process's arena (`share_arena`)."""
        import onnxruntime as ort

        self.path, self.inputs, self.threads = path, inputs, threads
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        # Idle ORT threads otherwise spin for a while after each call, taking the cores HTTP needs.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if shared_arena:
            options.add_session_config_entry("session.use_env_allocators", "1")
        providers = onnx_providers(ort.get_available_providers())
        self._session: Any = ort.InferenceSession(str(path), options, providers=providers)
        names = [i.name for i in self._session.get_inputs()]
        if len(names) != len(inputs):
            raise ModelLoadError(f"exported graph has {len(names)} inputs, the model {len(inputs)}")
        wanted = [graph_name(spec.name) for spec in inputs]
        # tf2onnx keeps the TensorSpec names; fall back to position if it renamed them.
        self._input_names = wanted if sorted(names) == sorted(wanted) else names

    def run(self, inputs: list[Array]) -> list[Array]:
        """Compute the outputs for one batch."""
        return list(self._session.run(None, dict(zip(self._input_names, inputs, strict=True))))

    def run_and_shrink(self, inputs: list[Array]) -> list[Array]:
        """`run`, then give the CPU arena's free chunks back to the system (ORT's run option
        `memory.enable_memory_arena_shrinkage`): a session freed in a process whose arena it shares leaves its
        activations' chunks there otherwise, for good."""
        import onnxruntime as ort

        options = ort.RunOptions()
        options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        return list(self._session.run(None, dict(zip(self._input_names, inputs, strict=True)), options))

    def with_threads(self, threads: int) -> OnnxEngine:
        """The same graph in a new session with `threads` intra-op threads."""
        return OnnxEngine(self.path, self.inputs, threads)

    def resident(self) -> tuple[int, int]:
        """Nothing in another process: (0, 0)."""
        return 0, 0

    def close(self) -> None:
        """Free the session now: a closed version's objects may wait in reference cycles for the garbage collector,
        and its weights must not (a memory budget counts them gone)."""
        self._session = None


_runtime_started = False


def start_runtime() -> None:
    """Open and run one tiny session, once per process: ONNX Runtime's one-time set-up (its environment, default
    allocators and kernels' registries, ~10 MB) is then not counted as the memory of whichever version loads first."""
    global _runtime_started
    if _runtime_started:
        return
    import numpy as np
    import onnx
    import onnxruntime as ort

    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Relu", ["x"], ["y"])], "start",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [None, 4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [None, 4])],
    )  # fmt: skip
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 13)], ir_version=8)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    session.run(None, {"x": np.zeros((2, 4), np.float32)})
    _runtime_started = True


def share_arena() -> None:
    """Register one CPU arena for the process, which sessions opened with `shared_arena` use instead of one each.

    Each session's own arena grows to its largest batch's activations (~100 MB for EfficientNet-Lite0 at batch
    8) and keeps them; sessions that share a process share one arena, so an added model costs little more than
    its weights.
    """
    import onnxruntime as ort

    memory = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
    ort.create_and_register_allocator(memory, ort.OrtArenaCfg(0, -1, -1, -1))  # ORT's defaults


def export_onnx(model: Any, inputs: tuple[TensorSpec, ...], target: Path) -> None:
    """Export the model's call to an ONNX file, written atomically (temporary name, then rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    signature = [tf_spec(spec) for spec in inputs]
    handle, temporary = tempfile.mkstemp(suffix=".onnx.tmp", dir=target.parent)
    os.close(handle)
    Path(temporary).chmod(CACHE_FILE_MODE)
    try:
        with warnings.catch_warnings():
            # tf2onnx and Keras' exporter warn about NumPy 2 aliases they patch themselves.
            warnings.simplefilter("ignore")
            model.export(
                temporary,
                format="onnx",
                verbose=False,
                input_signature=[signature] if len(signature) > 1 else signature,
            )
        Path(temporary).replace(target)
    finally:
        Path(temporary).unlink(missing_ok=True)


def export_and_verify(model: Any, inputs: tuple[TensorSpec, ...], cache_file: Path, probe: list[Array]) -> Verdict:
    """Export the model to `cache_file` (unless it is there) and compare ONNX Runtime with Keras on `probe`."""
    expected = KerasEngine(model, inputs).run(probe)
    try:
        if not cache_file.exists():
            export_onnx(model, inputs, cache_file)
        difference = max_difference(expected, OnnxEngine(cache_file, inputs, 1).run(probe))
    except ModelLoadError as error:
        return Verdict(None, f"ONNX export unusable: {error.message}")
    except OSError as error:  # the cache cannot be written, most likely: the message says where, no traceback needed
        log.warning("ONNX export failed for %s: %s", cache_file.name, error)
        return Verdict(None, f"ONNX export failed: {error}", lasting=False)
    except Exception as error:  # tf2onnx and ORT raise many kinds for unsupported ops.
        log.warning("ONNX export failed for %s", cache_file.name, exc_info=True)
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return Verdict(None, f"ONNX export failed: {first[:300]}")
    return Verdict(difference)
