"""Image classifiers trained on a base model's layer: the photo datasets (archives, folders, base64) and their
errors, the train API's checks, and a job end to end: features from the served base (kept in the feature store and
reused), the head trained in the job's process, the new version served as one model and equal to Keras."""

from __future__ import annotations

import base64
import io
import json
import os
import tarfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import keras
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from PIL import Image

from corpora import GCOMPRIS_CATEGORIZATION, gcompris_photos
from layerserve.errors import BadRequestError
from layerserve.settings import Settings
from layerserve.training.image_data import (
    LabelledPhoto,
    check_photos,
    photos_from_archive,
    photos_from_folder,
    photos_from_json,
)
from layerserve.training.image_recipe import split_photos
from tests.live_server import LiveServer, executions, start_server
from tests.models import build_mlp, build_tiny_image, load_reference, save_model
from tests.training.test_jobs import wait_for

TINY_CONFIG = "input: image\nresize: squash\npreprocess: raw\nmax_batch_size: 16\nversion_policy: all\n"
COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220)}


def photo(colour: str, seed: int, size: int = 16) -> bytes:
    """A PNG of a colour with noise, different for each seed."""
    rng = np.random.default_rng(seed)
    pixels = np.clip(np.array(COLOURS[colour]) + rng.normal(0, 25, (size, size, 3)), 0, 255).astype(np.uint8)
    encoded = io.BytesIO()
    Image.fromarray(pixels).save(encoded, format="PNG")
    return encoded.getvalue()


def photo_set(per_class: int, seed: int = 0) -> dict[str, bytes]:
    """{"photos/red/0.png": ..., ...}: `per_class` photos of each colour under a wrapper folder."""
    return {
        f"photos/{colour}/{n}.png": photo(colour, seed * 1000 + i * 100 + n)
        for i, colour in enumerate(COLOURS)
        for n in range(per_class)
    }


def zipped(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def tarred(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_photo_datasets_from_archives_folders_and_base64_and_their_errors(tmp_path: Path) -> None:
    files = {**photo_set(2), "photos/.DS_Store": b"junk", "__MACOSX/photos/red/._0.png": b"fork"}
    for photos in (photos_from_archive(zipped(files), "p.zip"), photos_from_archive(tarred(files), "p.tar.gz")):
        assert [(p.name, p.label) for p in photos] == [
            ("photos/blue/0.png", "blue"), ("photos/blue/1.png", "blue"),
            ("photos/red/0.png", "red"), ("photos/red/1.png", "red"),
        ]  # fmt: skip
        assert check_photos(photos, 10**8) == ["blue", "red"]
    for name, data in photo_set(2).items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    assert [p.label for p in photos_from_folder(tmp_path / "photos")] == ["blue", "blue", "red", "red"]
    encoded = [{"b64": base64.b64encode(data).decode()} for data in photo_set(2).values()]
    assert [p.label for p in photos_from_json(encoded, ["a", "a", "b", "b"])] == ["a", "a", "b", "b"]

    broken = LabelledPhoto("blue/bad.png", b"\x89PNG broken", "blue")
    refused = [
        (lambda: photos_from_archive(b"not an archive", "x.zip"), "not a readable zip or tar archive"),
        (lambda: photos_from_archive(zipped({"red.png": photo("red", 1)}), "x.zip"), "red.png is in no class folder"),
        (lambda: photos_from_archive(zipped({"red/notes.txt": b"hi"}), "x.zip"), "red/notes.txt is not a photo"),
        (lambda: photos_from_json(encoded, ["a"]), "4 images but 1 labels"),
        (lambda: photos_from_json([{"b64": "%%%"}], ["a"]), "image 0 is not valid base64"),
        (lambda: photos_from_json(["x"], ["a"]), 'image 0 must be {"b64"'),
        (lambda: check_photos([], 10**8), "no photos"),
        (lambda: check_photos([LabelledPhoto("a.png", photo("red", 1), "red")] * 3, 10**8), "single class 'red'"),
        (lambda: check_photos(_labelled(("red", 3), ("blue", 1)), 10**8), "class 'blue' has 1 photo"),
        (lambda: check_photos([*_labelled(("red", 2), ("blue", 2)), broken], 10**8), "blue/bad.png is not a readable"),
        (
            lambda: check_photos(_labelled(("red", 2), ("blue", 2)), 200),
            "has 16x16 pixels, over the server's max_image",
        ),
        (
            lambda: check_photos(
                [*_labelled(("red", 2)), *(LabelledPhoto(f"{n}.png", photo("blue", n), "a\nb") for n in range(2))],
                10**8,
            ),
            "a label is one non-empty line",
        ),
    ]
    for call, message in refused:
        with pytest.raises(BadRequestError, match=message.replace("(", r"\(").replace("{", r"\{")):
            call()


def _labelled(*counts: tuple[str, int]) -> list[LabelledPhoto]:
    return [LabelledPhoto(f"{c}/{n}.png", photo(c, n), c) for c, count in counts for n in range(count)]


def test_the_split_holds_out_some_of_every_class_and_never_a_classs_last_photo() -> None:
    labels = ["a"] * 10 + ["b"] * 2 + ["c"] * 5
    training, validation = split_photos(labels, 0.2, seed=3)
    assert sorted(training + validation) == list(range(17))
    held = [labels[i] for i in validation]
    assert held.count("a") == 2 and held.count("b") == 1 and held.count("c") == 1
    assert split_photos(labels, 0.2, seed=3) == (training, validation)  # seeded
    assert split_photos(labels, 0.0, seed=3) == (list(range(17)), [])


@pytest.fixture(scope="module")
def image_jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, Settings]]:
    root = tmp_path_factory.mktemp("image-jobs")
    repo, data = root / "repo", root / "data"
    save_model(build_tiny_image(), repo / "tiny" / "1", "model.keras")
    (repo / "tiny" / "config.yaml").write_text(TINY_CONFIG)
    save_model(build_mlp(1), repo / "mlp" / "1", "model.keras")
    for name, photo_bytes in photo_set(6).items():
        (data / name).parent.mkdir(parents=True, exist_ok=True)
        (data / name).write_bytes(photo_bytes)
    settings = Settings(model_repository=repo, engine_cache_dir=root / "cache", data_dir=data, reload_interval_s=0.5)
    live = start_server(settings, grpc=True)
    yield live, settings
    live.stop()


def _train(url: str, model: str, files: dict[str, bytes], params: dict[str, Any], apply: bool = True) -> httpx.Response:
    return httpx.post(
        f"{url}/v2/models/{model}/train", files={"file": ("photos.zip", zipped(files), "application/zip")},
        data={"params": json.dumps(params), "apply": str(apply).lower()}, timeout=60,
    )  # fmt: skip


def test_bad_image_train_requests_are_refused_before_any_job(image_jobs: tuple[LiveServer, Settings]) -> None:
    live, settings = image_jobs
    good = photo_set(3)
    one_class = {name: data for name, data in good.items() if "/red/" in name}
    lone_blue = {**one_class, "photos/blue/0.png": good["photos/blue/0.png"]}
    broken = {**good, "photos/blue/broken.png": b"\x89PNG\r\n\x1a\n not really"}
    cases = [
        (good, {"base": "tiny", "epochz": 3}, "param 'epochz'"),
        (good, {}, "param 'base'"),
        (one_class, {"base": "tiny"}, "single class 'red'"),
        (lone_blue, {"base": "tiny"}, "class 'blue' has 1 photo"),
        (broken, {"base": "tiny"}, "photos/blue/broken.png is not a readable image"),
        (good, {"base": "mlp"}, "model 'mlp' is not an image model"),
        (good, {"base": "nothing"}, "params.base: "),
        (good, {"base": "tiny", "layer": "nope"}, "unknown layer 'nope'"),
        (good, {"base": "tiny", "layer": "image"}, "is the base model's input"),
        (good, {"base": "tiny", "base_version": 7}, "params.base: "),
    ]
    for files, params, message in cases:
        response = _train(live.url, "colours", files, params)
        assert response.status_code == 400 and message in response.json()["error"], (params, response.text)
    as_tar = httpx.post(  # a tar.gz upload and base64 JSON reach the same checks
        f"{live.url}/v2/models/colours/train", files={"file": ("p.tar.gz", tarred(one_class), "application/gzip")},
        data={"params": json.dumps({"base": "tiny"})},
    )  # fmt: skip
    assert as_tar.status_code == 400 and "single class 'red'" in as_tar.json()["error"], as_tar.text
    lone = [(name.split("/")[1], data) for name, data in lone_blue.items()]
    inline = {"images": [{"b64": base64.b64encode(data).decode()} for _, data in lone], "labels": [c for c, _ in lone]}
    as_json = httpx.post(f"{live.url}/v2/models/colours/train", json={"dataset": inline, "params": {"base": "tiny"}})
    assert as_json.status_code == 400 and "class 'blue' has 1 photo" in as_json.json()["error"], as_json.text
    into_base = _train(live.url, "tiny", good, {"base": "tiny"})
    assert into_base.status_code == 400 and "is the base" in into_base.json()["error"]
    into_text_less = _train(live.url, "mlp", good, {"base": "tiny"})
    assert into_text_less.status_code == 400 and "not an image model" in into_text_less.json()["error"]
    assert httpx.get(f"{live.url}/v2/jobs").json()["jobs"] == []
    assert not (settings.model_repository / "colours").exists()


def _succeeded(url: str, started: httpx.Response) -> dict[str, Any]:
    """The job `started` answered for, once it ended; it must have succeeded."""
    assert started.status_code == 202, started.text
    job = wait_for(url, started.json()["job_id"], {"succeeded", "failed", "cancelled"})
    assert job["state"] == "succeeded", job["error"]
    return job


def _features(job: dict[str, Any]) -> list[int]:
    """[computed, reused]: the job's features, by where they came from."""
    return [job["progress"]["features"][key] for key in ("computed", "reused")]


def _check_history(job: dict[str, Any], params: dict[str, Any], written: dict[str, Any]) -> None:
    """One history entry per epoch with the validation loss; early stopping kept the best epoch's weights."""
    history = job["history"]
    assert [entry["epoch"] for entry in history] == list(range(1, len(history) + 1))
    assert all({"loss", "val_loss", "accuracy"} <= set(entry) for entry in history), history[0]
    best = min(range(len(history)), key=lambda n: history[n]["val_loss"]) + 1
    assert job["progress"]["best_epoch"] == written["best_epoch"] == best
    assert len(history) in (params["epochs"], best + params["patience"]), (len(history), best)
    assert written["history"]["val_loss"] == [entry["val_loss"] for entry in history]


def _v2_pool(url: str, model: str, version: int, pixels: np.ndarray) -> np.ndarray:
    """The `pool` layer's output of a version over V2 (NaNs while it is not served)."""
    inputs = [{"name": "image", "datatype": "FP32", "shape": list(pixels.shape), "data": pixels.ravel().tolist()}]
    answer = httpx.post(
        f"{url}/v2/models/{model}/versions/{version}/infer", json={"inputs": inputs, "outputs": [{"name": "pool"}]},
        timeout=30,
    )  # fmt: skip
    if answer.status_code != 200:
        return np.full((len(pixels), 4), np.nan, np.float32)
    output = answer.json()["outputs"][0]
    return np.array(output["data"], np.float32).reshape(output["shape"])


def _check_standard_clients(
    live: LiveServer, reference: Any, pixels: np.ndarray, photos: dict[str, list[bytes]]
) -> None:
    """The base's image input over gRPC (tritonclient) and TF Serving's :classify, as any image model."""
    client = grpcclient.InferenceServerClient(live.grpc_target)
    image = grpcclient.InferInput("image", list(pixels.shape), "FP32")
    image.set_data_from_numpy(pixels)
    scores = client.infer("colours", [image], model_version="1").as_numpy(reference.output_names[0])
    np.testing.assert_allclose(scores, reference.predict(pixels, verbose=0), rtol=1e-4, atol=1e-5)
    client.close()
    examples = [{"image": {"b64": base64.b64encode(p).decode()}} for colour in COLOURS for p in photos[colour][:2]]
    classified = httpx.post(f"{live.url}/v1/models/colours/versions/1:classify", json={"examples": examples})
    assert classified.status_code == 200, classified.text
    assert [result[0][0] for result in classified.json()["results"]] == ["red", "red", "blue", "blue"]


def test_an_image_classifier_trained_on_a_layer_serves_as_one_model_equal_to_keras(
    image_jobs: tuple[LiveServer, Settings],
) -> None:
    live, settings = image_jobs
    params = {"base": "tiny", "hidden": 8, "epochs": 120, "patience": 30, "learning_rate": 0.02, "seed": 1}
    job = _succeeded(live.url, _train(live.url, "colours", photo_set(6), params))
    assert job["params"]["layer"] == "pool" and job["params"]["base_version"] == 1  # the defaults, resolved
    assert job["rows"] == 12 and job["model_version"] == "1"
    # 10 training photos, each with a flipped and a cropped copy, and 2 held out: all computed by the base
    assert _features(job) == [32, 0] and job["progress"]["features"]["seconds"] > 0
    written = json.loads((settings.model_repository / "colours" / "1" / "metrics.json").read_text())
    assert written["base"] == {"model": "tiny", "version": 1, "layer": "pool"}
    assert written["photos"] == {"blue": 6, "red": 6}
    _check_history(job, params, written)

    fresh = {colour: [photo(colour, 90_000 + n) for n in range(4)] for colour in COLOURS}
    for colour, photos in fresh.items():
        images = [("image", ("p.png", p, "image/png")) for p in photos]
        answer = httpx.post(f"{live.url}/v2/models/colours/classify?top_k=1", files=images, timeout=30)
        assert answer.status_code == 200, answer.text
        assert [row[0]["label"] for row in answer.json()["predictions"]] == [colour] * 4

    reference = load_reference(settings.model_repository, "colours", 1)
    assert reference.get_layer("pool") is not None and reference.output_shape == (None, 2)
    pixels = np.random.default_rng(5).uniform(0, 255, (3, 8, 8, 3)).astype(np.float32)
    body = {
        "inputs": [{"name": "image", "datatype": "FP32", "shape": list(pixels.shape), "data": pixels.ravel().tolist()}],
        "outputs": [{"name": "pool"}, {"name": "head_hidden"}, {"name": reference.output_names[0]}],
    }
    calls_before = executions(live.url, "colours"), executions(live.url, "tiny")
    answer = httpx.post(f"{live.url}/v2/models/colours/infer", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    # One graph: the base's part and the head's come from one engine call, and the base model is not asked.
    assert (executions(live.url, "colours"), executions(live.url, "tiny")) == (calls_before[0] + 1, calls_before[1])
    outputs = {o["name"]: np.array(o["data"], np.float32).reshape(o["shape"]) for o in answer.json()["outputs"]}
    inner = keras.Model(reference.inputs, [reference.get_layer(n).output for n in ("pool", "head_hidden")])
    expected_pool, expected_hidden = (np.asarray(a) for a in inner.predict(pixels, verbose=0))
    np.testing.assert_allclose(outputs["pool"], expected_pool, rtol=1e-4, atol=1e-5)  # the base's part
    np.testing.assert_allclose(outputs["head_hidden"], expected_hidden, rtol=1e-4, atol=1e-5)  # the head's
    np.testing.assert_allclose(
        outputs[reference.output_names[0]], reference.predict(pixels, verbose=0), rtol=1e-4, atol=1e-5
    )
    base = load_reference(settings.model_repository, "tiny", 1)
    np.testing.assert_allclose(  # the base cut at its layer, its weights as trained on
        expected_pool, keras.Model(base.inputs, base.get_layer("pool").output).predict(pixels, verbose=0), rtol=1e-5
    )
    _check_standard_clients(live, reference, pixels, fresh)

    # The same photos again, from the data folder: every feature comes from the feature store.
    from_folder = {"dataset": {"path": "photos"}, "params": params, "apply": True}
    job = _succeeded(live.url, httpx.post(f"{live.url}/v2/models/colours/train", json=from_folder, timeout=60))
    assert job["model_version"] == "2" and _features(job) == [0, 32]

    # The base gets other weights, as a new version and in version 1's folder written again: the head's versions
    # keep the base weights they were trained on, and a job on the rewritten version 1 computes its features again.
    changed = load_reference(settings.model_repository, "tiny", 1)
    kernel, bias = changed.get_layer("conv").get_weights()
    changed.get_layer("conv").set_weights([kernel * -2.0, bias + 0.5])
    for version in (2, 1):
        save_model(changed, settings.model_repository / "tiny" / str(version), "model.keras")
    deadline = time.monotonic() + 120
    while not all(np.isfinite(found).all() and not np.allclose(found, expected_pool, atol=1e-3)
                  for found in (_v2_pool(live.url, "tiny", v, pixels) for v in (1, 2))):  # fmt: skip
        assert time.monotonic() < deadline, "the base's new weights did not load"
        time.sleep(0.2)
    np.testing.assert_allclose(_v2_pool(live.url, "colours", 2, pixels), expected_pool, rtol=1e-4, atol=1e-5)
    from_folder["params"] = {**params, "base_version": 1}
    job = _succeeded(live.url, httpx.post(f"{live.url}/v2/models/colours/train", json=from_folder, timeout=60))
    assert _features(job) == [32, 0]


def test_gcompris_ships_labelled_photos_that_read_from_its_resource_bundle() -> None:
    if not GCOMPRIS_CATEGORIZATION.is_file():
        if os.environ.get("CI") == "true":
            pytest.fail(f"{GCOMPRIS_CATEGORIZATION} is missing: scripts/install installs gcompris-qt-data (as root)")
        pytest.skip("Debian's gcompris-qt-data is not installed (scripts/install installs it as root)")
    photos = gcompris_photos()
    assert {label: len(found) for label, found in photos.items()} == {
        "fishes": 28, "monuments": 27, "renewable": 29, "tools": 39,
    }  # fmt: skip
    for label, found in photos.items():
        for name, data in found:
            with Image.open(io.BytesIO(data)) as image:
                image.load()
                assert image.format == "WEBP" and min(image.size) >= 110, (label, name)
    assert ("tajMahal.webp" in [name for name, _ in photos["monuments"]]) and len({d for _, d in photos["tools"]}) == 39
