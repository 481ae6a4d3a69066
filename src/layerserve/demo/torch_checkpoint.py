"""Read a legacy (pre-zip) PyTorch checkpoint into numpy arrays, without torch and without pickle's trust."""

from __future__ import annotations

import pickle
import struct
from collections import OrderedDict
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from numpy.typing import NDArray

_STORAGE_DTYPES: dict[str, np.dtype[Any]] = {
    "FloatStorage": np.dtype("<f4"),
    "DoubleStorage": np.dtype("<f8"),
    "HalfStorage": np.dtype("<f2"),
    "LongStorage": np.dtype("<i8"),
    "IntStorage": np.dtype("<i4"),
    "ShortStorage": np.dtype("<i2"),
    "CharStorage": np.dtype("i1"),
    "ByteStorage": np.dtype("u1"),
    "BoolStorage": np.dtype("?"),
}


class CheckpointError(ValueError):
    """The file is not a legacy PyTorch checkpoint this reader accepts."""


class _StorageType:
    """Stands for a torch storage class: only its element dtype matters."""

    def __init__(self, name: str) -> None:
        self.dtype = _STORAGE_DTYPES[name]


class _Storage:
    """A storage announced by the pickle; its bytes follow the pickle in the file."""

    def __init__(self, dtype: np.dtype[Any], numel: int) -> None:
        self.dtype = dtype
        self.numel = numel
        self.data: NDArray[Any] | None = None


class _LazyTensor:
    """A tensor whose storage bytes are not read yet."""

    def __init__(self, storage: _Storage, offset: int, size: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.storage, self.offset, self.size, self.stride = storage, offset, tuple(size), tuple(stride)

    def to_numpy(self) -> NDArray[Any]:
        """The tensor as a contiguous numpy array."""
        assert self.storage.data is not None
        flat = self.storage.data
        item = flat.itemsize
        view = np.lib.stride_tricks.as_strided(
            flat[self.offset :],
            shape=self.size,
            strides=tuple(s * item for s in self.stride),
        )
        return np.ascontiguousarray(view)


def _rebuild_tensor_v2(storage: _Storage, offset: int, size: Any, stride: Any, *_: Any) -> _LazyTensor:
    return _LazyTensor(storage, offset, size, stride)


class _RestrictedUnpickler(pickle.Unpickler):
    """Accepts tensor-rebuild globals and OrderedDict only; refuses every other global."""

    def __init__(self, file: BinaryIO) -> None:
        super().__init__(file)
        self.storages: dict[str, _Storage] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor_v2
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(name)
        raise CheckpointError(f"checkpoint refers to {module}.{name}, which this reader does not accept")

    def persistent_load(self, pid: Any) -> Any:
        if not isinstance(pid, tuple) or pid[0] != "storage":
            raise CheckpointError(f"unsupported persistent id {pid!r:.80}")
        storage_type, key, _location, numel, view = pid[1:6]
        if view is not None or not isinstance(storage_type, _StorageType):
            raise CheckpointError("storage views are not supported")
        if key not in self.storages:
            self.storages[key] = _Storage(storage_type.dtype, int(numel))
        return self.storages[key]


def _plain_load(file: BinaryIO) -> Any:
    return _RestrictedUnpickler(file).load()


def load_state_dict(path: Path) -> dict[str, NDArray[Any]]:
    """Read a legacy torch `.pth` state dict as name -> numpy array (float weights and int buffers)."""
    with path.open("rb") as file:
        if file.read(2)[:1] != b"\x80":
            raise CheckpointError(f"{path} is not a legacy PyTorch checkpoint")
        file.seek(0)
        _plain_load(file)  # magic number
        _plain_load(file)  # protocol version
        _plain_load(file)  # system info
        unpickler = _RestrictedUnpickler(file)
        state = unpickler.load()
        keys = _plain_load(file)
        for key in keys:
            storage = unpickler.storages[key]
            (count,) = struct.unpack("<q", file.read(8))
            if count != storage.numel:
                raise CheckpointError(f"storage {key}: {count} elements on disk, {storage.numel} announced")
            raw = file.read(count * storage.dtype.itemsize)
            storage.data = np.frombuffer(raw, dtype=storage.dtype)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} does not hold a state dict")
    return {name: tensor.to_numpy() for name, tensor in state.items() if isinstance(tensor, _LazyTensor)}
