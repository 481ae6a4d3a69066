"""Finding, checking and loading model files; reading signatures."""

from __future__ import annotations

from pathlib import Path

import keras
import pytest

from layerserve.errors import ModelLoadError
from layerserve.lifecycle.model import file_digest, find_model_file, load_model, read_signature
from tests.models import build_lambda, build_multi, build_sequential


def test_find_model_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="holds no model file"):
        find_model_file(tmp_path)
    (tmp_path / "model.hdf5").write_bytes(b"")
    assert find_model_file(tmp_path).name == "model.hdf5"
    (tmp_path / "model.keras").write_bytes(b"")
    assert find_model_file(tmp_path).name == "model.keras"


def test_signature_of_multi_io_and_sequential(tmp_path: Path) -> None:
    signature = read_signature(build_multi())
    assert [(s.name, s.datatype, s.shape) for s in signature.inputs] == [
        ("features", "FP32", (-1, 4)),
        ("tokens", "INT32", (-1, 3)),
    ]
    assert [s.name for s in signature.outputs] == ["regression", "probs"]
    sequential = read_signature(build_sequential())
    assert sequential.inputs[0].shape == (-1, 6) and sequential.outputs[0].shape == (-1, 2)


def test_lambda_is_refused_unless_trusted(tmp_path: Path) -> None:
    for name in ("model.h5", "model.keras"):
        path = tmp_path / name
        build_lambda().save(path)
        with pytest.raises(ModelLoadError, match="Lambda"):
            load_model(path, trust=False)
        assert load_model(path, trust=True) is not None


def test_unknown_layer_and_corrupt_file_fail_with_reason(tmp_path: Path) -> None:
    @keras.saving.register_keras_serializable(package="tests")
    class Custom(keras.layers.Layer):  # type: ignore[misc]
        def call(self, x: object) -> object:
            return x

    x = keras.Input((2,))
    path = tmp_path / "model.keras"
    keras.Model(x, Custom()(x)).save(path)
    keras.saving.get_custom_objects().pop("tests>Custom")
    with pytest.raises(ModelLoadError, match=r"cannot load model\.keras"):
        load_model(path, trust=False)
    path.write_bytes(b"garbage")
    with pytest.raises(ModelLoadError, match=r"not a \.keras archive"):
        load_model(path, trust=False)


def test_digest_changes_with_content(tmp_path: Path) -> None:
    path = tmp_path / "model.keras"
    path.write_bytes(b"a")
    first = file_digest(path)
    path.write_bytes(b"b")
    assert file_digest(path) != first
