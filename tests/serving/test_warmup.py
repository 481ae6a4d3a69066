"""A version's own warm-up requests: TF Serving's file (written by TensorFlow) and warmup/*.json, run at every batch
size before READY; a bad one fails the version, naming its file and record, and the server serves the others."""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
import tensorflow as tf
from PIL import Image

from layerserve.lifecycle.model import Signature
from layerserve.serving.input_codec import InputCodec
from layerserve.serving.layers import LayerGraph
from layerserve.serving.request_checks import RequestChecks
from layerserve.serving.warmup import WarmupTarget, batch_sizes, run_warmup
from layerserve.settings import Settings
from layerserve.tensors import Array, TensorSpec
from layerserve.training.tokenizer import Tokenizer
from tests.live_server import LiveServer, start_server
from tests.models import build_mlp, build_tiny_image, build_tiny_text, save_model
from tests.protocols.test_tfserving_warmup import examples_log, field, predict_log

TF_FILE = Path("assets.extra") / "tf_serving_warmup_requests"


def write_tf_warmup(folder: Path, records: list[bytes]) -> Path:
    """TF Serving's warm-up file in `folder`, written by TensorFlow."""
    path = folder / TF_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with tf.io.TFRecordWriter(str(path)) as writer:
        for record in records:
            writer.write(record)
    return path


def v2_body(x: Array) -> bytes:
    """A V2 infer body for the mlp's input `x`."""
    return orjson.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.tolist()}]})


def png(color: tuple[int, int, int]) -> bytes:
    """A 12x10 PNG of one colour."""
    out = io.BytesIO()
    Image.new("RGB", (12, 10), color).save(out, format="PNG")
    return out.getvalue()


def test_reading_and_running_warmup_requests_imports_no_tensorflow(tmp_path: Path) -> None:
    write_tf_warmup(tmp_path, [predict_log({"x": np.ones((1, 10), np.float32)})])
    code = (
        "import sys; from pathlib import Path; from layerserve.serving.warmup import read_requests, WarmupTarget\n"
        "from layerserve.lifecycle.model import Signature; from layerserve.serving.layers import LayerGraph\n"
        "from layerserve.serving.request_checks import RequestChecks; from layerserve.tensors import TensorSpec\n"
        "from layerserve.serving.input_codec import InputCodec\n"
        "s = Signature((TensorSpec('x', 'FP32', (-1, 10)),), (TensorSpec('p', 'FP32', (-1, 3)),)); g = LayerGraph(s)\n"
        "t = WarmupTarget(g, RequestChecks(g), InputCodec('m', s, 'p'), lambda i, o: {}, 4, 100)\n"
        "requests = list(read_requests(Path(sys.argv[1]), 'm', t))\n"
        "print(len(requests), 'tensorflow' in sys.modules)"
    )
    answer = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    assert answer.stdout.split() == ["1", "False"]


def test_batch_sizes_are_every_size_the_batcher_may_send_and_the_requests_own() -> None:
    assert batch_sizes(2, 4) == [1, 2, 3, 4]
    assert batch_sizes(6, 4) == [1, 2, 3, 4, 6]
    assert batch_sizes(3, 1) == [3]


def test_each_request_runs_at_each_batch_size_with_its_rows_repeated(tmp_path: Path) -> None:
    x = np.arange(20, dtype=np.float32).reshape(2, 10)
    write_tf_warmup(tmp_path, [predict_log({"x": x}, ("probs",))])
    (tmp_path / "warmup").mkdir()
    (tmp_path / "warmup" / "b.json").write_bytes(v2_body(x[:1] + 100))
    signature = Signature((TensorSpec("x", "FP32", (-1, 10)),), (TensorSpec("probs", "FP32", (-1, 3)),))
    graph = LayerGraph(signature)
    batches: list[tuple[Array, tuple[str, ...]]] = []

    def run(inputs: dict[str, Array], outputs: tuple[str, ...]) -> dict[str, Array]:
        batches.append((inputs["x"], outputs))
        return {name: np.zeros((len(inputs["x"]), 3), np.float32) for name in outputs}

    target = WarmupTarget(graph, RequestChecks(graph), InputCodec("m", signature, "probs"), run, 3, 10**6)
    assert run_warmup(tmp_path, "m", target) == 2
    assert [len(batch) for batch, _ in batches] == [1, 2, 3, 1, 2, 3]
    assert [outputs for _, outputs in batches] == [("probs",)] * 6
    assert batches[2][0].tolist() == [x[0].tolist(), x[1].tolist(), x[0].tolist()]
    assert batches[5][0].tolist() == [(x[0] + 100).tolist()] * 3


@pytest.fixture(scope="module")
def warm_server(tmp_path_factory: pytest.TempPathFactory, engine_cache: Path) -> Iterator[tuple[LiveServer, Path]]:
    """A server over versions with good and bad warm-up requests of each form, and one without."""
    repo = tmp_path_factory.mktemp("warmup-repository")
    mlp_file = save_model(build_mlp(1), repo / "plain" / "1", "model.keras")
    x = np.random.default_rng(0).normal(size=(2, 10)).astype(np.float32)
    folders = {}
    for name in ("warm_tf", "warm_json", "bad_shape", "bad_crc", "bad_json", "session_run"):
        folders[name] = repo / name / "1"
        folders[name].mkdir(parents=True)
        shutil.copy(mlp_file, folders[name] / "model.keras")  # one file: exported to ONNX once
    (repo / "warm_tf" / "config.yaml").write_text("max_batch_size: 4\n")
    classify = examples_log(2, [{"x": row.tolist()} for row in x])  # a classify log: tf.train.Examples
    write_tf_warmup(folders["warm_tf"], [predict_log({"x": x}), predict_log({"x": x[:1]}, ("probs",)), classify])
    (folders["warm_json"] / "warmup").mkdir()
    (folders["warm_json"] / "warmup" / "rows.json").write_bytes(v2_body(x))
    write_tf_warmup(folders["bad_shape"], [predict_log({"x": x}), predict_log({"x": x[:, :9]})])
    path = write_tf_warmup(folders["bad_crc"], [predict_log({"x": x})])
    corrupt = bytearray(path.read_bytes())
    corrupt[20] ^= 0xFF
    path.write_bytes(bytes(corrupt))
    (folders["bad_json"] / "warmup").mkdir()
    (folders["bad_json"] / "warmup" / "a.json").write_bytes(v2_body(x))
    (folders["bad_json"] / "warmup" / "b.json").write_bytes(v2_body(x).replace(b'"x"', b'"y"'))
    write_tf_warmup(folders["session_run"], [predict_log({"x": x}), field(5, b"")])
    image = save_model(build_tiny_image(), repo / "image" / "1", "model.keras").parent
    (repo / "image" / "config.yaml").write_text("input: image\nresize: squash\nmax_batch_size: 2\n")
    colors = np.array([png((255, 0, 0)), png((0, 0, 255))], dtype=object)
    write_tf_warmup(image, [predict_log({"image": colors})])
    tokenizer = Tokenizer(sequence_length=6).fit(["good great fine", "bad awful poor"])
    text = save_model(build_tiny_text(tokenizer.size, 6), repo / "text" / "1", "model.keras").parent
    tokenizer.save(text)
    (repo / "text" / "config.yaml").write_text("input: text\nmax_batch_size: 3\n")
    (text / "warmup").mkdir()
    texts = {"name": "tokens", "datatype": "BYTES", "shape": [2], "data": ["good fine", "awful"]}
    (text / "warmup" / "texts.json").write_bytes(orjson.dumps({"inputs": [texts]}))
    live = start_server(Settings(model_repository=repo, engine_cache_dir=engine_cache))
    yield live, repo
    live.stop()


def _index(live: LiveServer) -> dict[str, dict[str, str]]:
    rows = httpx.post(f"{live.url}/v2/repository/index", timeout=30).json()
    return {row["name"]: row for row in rows}


@pytest.mark.slow
def test_versions_with_good_warmup_requests_serve_and_bad_ones_fail_naming_the_file(
    warm_server: tuple[LiveServer, Path],
) -> None:
    live, _ = warm_server
    rows = _index(live)
    for name in ("plain", "warm_tf", "warm_json", "image", "text"):
        assert rows[name]["state"] == "READY", rows[name]
    assert rows["bad_shape"]["state"] == "FAILED"
    assert "warm-up request assets.extra/tf_serving_warmup_requests record 1: input 'x'" in rows["bad_shape"]["reason"]
    assert rows["bad_crc"]["state"] == "FAILED"
    assert rows["bad_crc"]["reason"].startswith(
        "warm-up file assets.extra/tf_serving_warmup_requests: record 0: the CRC of its data does not match"
    )
    assert rows["bad_json"]["state"] == "FAILED"
    assert rows["bad_json"]["reason"].startswith("warm-up file warmup/b.json: ")
    assert "'y'" in rows["bad_json"]["reason"]
    assert rows["session_run"]["state"] == "FAILED"
    assert "record 1: session_run_log" in rows["session_run"]["reason"]


@pytest.mark.slow
def test_a_warmed_version_answers_as_keras_does(warm_server: tuple[LiveServer, Path]) -> None:
    live, _ = warm_server
    x = np.random.default_rng(1).normal(size=(3, 10)).astype(np.float32)
    answer = httpx.post(f"{live.url}/v2/models/warm_tf/infer", content=v2_body(x), timeout=30)
    assert answer.status_code == 200
    expected = build_mlp(1)(x).numpy()
    got = np.array(answer.json()["outputs"][0]["data"], np.float32).reshape(expected.shape)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    failed = httpx.post(f"{live.url}/v2/models/bad_shape/infer", content=v2_body(x), timeout=30)
    assert failed.status_code == 503 and "record 1" in failed.json()["error"]
