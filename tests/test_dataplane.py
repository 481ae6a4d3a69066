"""The data plane as Python calls (Runtime.infer, classify, features) and BlockingRuntime from many threads:
answers equal Keras, bad calls raise our errors."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from layerserve.blocking import BlockingRuntime
from layerserve.errors import BadRequestError, NotFoundError
from layerserve.messages import ClassifyRequest, InferRequest
from layerserve.runtime import Runtime
from layerserve.settings import Settings
from tests.models import load_reference

pytestmark = pytest.mark.anyio


@pytest.fixture
async def runtime(settings: Settings) -> AsyncIterator[Runtime]:
    started = Runtime(settings.model_copy(update={"reload_interval_s": 0}))
    await started.start()
    await started.registry.wait_settled()
    yield started
    await started.close()


async def test_infer_equals_keras_for_outputs_and_layers(runtime: Runtime, repository: Path) -> None:
    reference = load_reference(repository, "multi", 1)
    rng = np.random.default_rng(3)
    features = rng.normal(size=(5, 4)).astype(np.float32)
    tokens = rng.integers(0, 10, (5, 3)).astype(np.int32)
    result = await runtime.data.infer(InferRequest("multi", {"features": features, "tokens": tokens}))
    assert result.model == "multi" and result.version == 1 and set(result.outputs) == {"regression", "probs"}
    expected = reference([features, tokens])
    np.testing.assert_allclose(result.outputs["regression"], np.asarray(expected[0]), atol=1e-5)
    np.testing.assert_allclose(result.outputs["probs"], np.asarray(expected[1]), atol=1e-5)
    lists = await runtime.data.infer(
        InferRequest("multi", {"features": features.tolist(), "tokens": tokens.tolist()}, ["joined"])
    )
    import keras

    joined = keras.Model(reference.inputs, reference.get_layer("joined").output)([features, tokens])
    np.testing.assert_allclose(lists.outputs["joined"], np.asarray(joined), atol=1e-5)


async def test_bad_calls_raise_errors_that_name_the_problem(runtime: Runtime) -> None:
    x = np.zeros((1, 10), np.float32)
    with pytest.raises(NotFoundError, match="unknown model 'nope'"):
        await runtime.data.infer(InferRequest("nope", {"x": x}))
    with pytest.raises(BadRequestError, match="unknown input 'y'"):
        await runtime.data.infer(InferRequest("mlp", {"y": x}))
    with pytest.raises(BadRequestError, match="FP32"):
        await runtime.data.infer(InferRequest("mlp", {"x": x.astype(np.float64)}))
    with pytest.raises(BadRequestError, match="unknown output 'nothing'"):
        await runtime.data.infer(InferRequest("mlp", {"x": x}, ["nothing"]))
    with pytest.raises(BadRequestError, match="Embedding 'embedding' of 10 rows"):
        await runtime.data.infer(
            InferRequest("multi", {"features": np.zeros((1, 4), np.float32), "tokens": [[1, 2, 10]]})
        )
    with pytest.raises(BadRequestError, match=r"images .* or texts"):
        await runtime.data.classify(ClassifyRequest("mlp", [b"png", "text"]))


async def test_a_bad_value_is_named_at_its_place_in_the_request_when_its_other_rows_are_cached(
    settings: Settings, repository: Path, tmp_path: Path
) -> None:
    shutil.copytree(repository / "multi", tmp_path / "multi")
    (tmp_path / "multi" / "config.yaml").write_text("cache: true\n")
    runtime = Runtime(settings.model_copy(update={"model_repository": tmp_path, "reload_interval_s": 0}))
    await runtime.start()
    try:
        await runtime.registry.wait_settled()
        features = np.zeros((3, 4), np.float32)
        tokens = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 10]], np.int32)
        await runtime.data.infer(InferRequest("multi", {"features": features[:2], "tokens": tokens[:2]}))  # now cached
        with pytest.raises(BadRequestError, match=r"value 10 at position \[2, 2\]"):  # not [0, 2] of the misses
            await runtime.data.infer(InferRequest("multi", {"features": features, "tokens": tokens}))
    finally:
        await runtime.close()


def test_blocking_runtime_answers_many_threads_as_keras(settings: Settings, repository: Path) -> None:
    reference = load_reference(repository, "mlp", 2)
    rng = np.random.default_rng(4)
    batches = [rng.normal(size=(int(rng.integers(1, 4)), 10)).astype(np.float32) for _ in range(64)]
    with BlockingRuntime(settings.model_copy(update={"reload_interval_s": 0})) as runtime:
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda x: runtime.infer(InferRequest("mlp", {"x": x})).outputs["probs"], batches))
        with pytest.raises(NotFoundError):
            runtime.infer(InferRequest("mlp", {"x": batches[0]}, version=9))
    for x, probs in zip(batches, results, strict=True):
        np.testing.assert_allclose(probs, np.asarray(reference(x)), atol=1e-5)
