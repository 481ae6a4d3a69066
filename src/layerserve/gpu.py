"""GPU settings: device selection and memory per process, for TensorFlow and ONNX Runtime.

They travel as environment variables, set once at start-up, so that worker processes, the preparer's
child and training jobs (all started later) get them too. On a machine without a GPU they change nothing.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from layerserve.settings import Settings

log = logging.getLogger(__name__)

MEMORY_LIMIT_VARIABLE = "LAYERSERVE_GPU_MEMORY_LIMIT_MB"  # also the setting's own variable
_configured = threading.Event()
_lock = threading.Lock()


def apply_settings(settings: Settings) -> None:
    """Export the GPU settings to this process's environment (before TensorFlow or ORT start)."""
    if settings.gpu_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = settings.gpu_devices
    os.environ["TF_FORCE_GPU_ALLOW_GROWTH"] = "true" if settings.gpu_memory_growth else "false"
    os.environ[MEMORY_LIMIT_VARIABLE] = str(settings.gpu_memory_limit_mb)


def memory_limit_mb() -> int:
    """The per-process, per-device GPU memory limit in force (0: none)."""
    try:
        return max(0, int(os.environ.get(MEMORY_LIMIT_VARIABLE, "0")))
    except ValueError:
        return 0


def configure_tensorflow() -> None:
    """Apply the memory limit to every GPU TensorFlow sees, once, before its first use (no-op without GPUs)."""
    if _configured.is_set():
        return
    with _lock:
        if _configured.is_set():
            return
        from layerserve.logs import import_tensorflow_quietly

        import_tensorflow_quietly()  # the first import of TensorFlow in most processes: none of its notices
        import tensorflow as tf

        limit = memory_limit_mb()
        for device in tf.config.list_physical_devices("GPU"):
            try:
                if limit:
                    config = tf.config.LogicalDeviceConfiguration(memory_limit=limit)
                    tf.config.set_logical_device_configuration(device, [config])
            except RuntimeError as error:  # TensorFlow was initialised before: it keeps its own settings
                log.warning("GPU settings not applied to %s: %s", device.name, error)
        _configured.set()


def onnx_providers(available: list[str]) -> list[Any]:
    """ONNX Runtime execution providers: CUDA first (with the memory limit) when this build has it, then CPU."""
    providers: list[Any] = []
    if "CUDAExecutionProvider" in available:
        options = {"gpu_mem_limit": str(memory_limit_mb() << 20)} if memory_limit_mb() else {}
        providers.append(("CUDAExecutionProvider", options))
    providers.append("CPUExecutionProvider")
    return providers
