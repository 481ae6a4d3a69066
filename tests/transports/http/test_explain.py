"""Explanations over HTTP: a real photo of a cat pasted at a known place on a plain canvas, explained by the demo
EfficientNet and by a head trained on its pooled layer (with the README's curl lines, as written): most of the
heatmap's mass lies on the cat; PNG overlays, occlusion for a model without a spatial layer, and the errors."""

from __future__ import annotations

import io
import json
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from layerserve.demo import write_demo_photos
from layerserve.settings import Settings
from tests.demo.test_demo import package_file
from tests.live_server import LiveServer, executions, start_server
from tests.models import build_flat_image, build_mlp, build_tiny_image, save_model
from tests.redis_server import RedisServer

CANVAS, CAT_AT, CAT_SIZE = 448, (128, 192), (288, 192)  # the cat's box on the canvas: left, top; width, height
INPUT = 224  # EfficientNet's input: the square canvas is resized by half


def skimage_photo(name: str) -> Image.Image:
    return Image.open(io.BytesIO(package_file("skimage", f"data/{name}").read_bytes())).convert("RGB")


def png(image: Image.Image) -> bytes:
    encoded = io.BytesIO()
    image.save(encoded, format="PNG")
    return encoded.getvalue()


def composite() -> bytes:
    """scikit-image's cat (chelsea.png) pasted on a plain light canvas, in its lower part."""
    canvas = Image.new("RGB", (CANVAS, CANVAS), (236, 236, 232))
    canvas.paste(skimage_photo("chelsea.png").resize(CAT_SIZE, Image.Resampling.BILINEAR), CAT_AT)
    return png(canvas)


def mass_inside_the_cat(heatmap: list[list[float]]) -> float:
    """The share of the heatmap's mass (upsampled to the model's input) inside the cat's box."""
    heat = np.asarray(
        Image.fromarray(np.array(heatmap, np.float32), mode="F").resize((INPUT, INPUT), Image.Resampling.BILINEAR)
    )
    scale = INPUT / CANVAS
    left, top = round(CAT_AT[0] * scale), round(CAT_AT[1] * scale)
    right, bottom = round((CAT_AT[0] + CAT_SIZE[0]) * scale), round((CAT_AT[1] + CAT_SIZE[1]) * scale)
    return float(heat[top:bottom, left:right].sum() / heat.sum())


@pytest.fixture(scope="module")
def explain_server(demo_repository: Path, demo_engine_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> (
    Iterator[tuple[LiveServer, Path]]
):  # fmt: skip
    repo = tmp_path_factory.mktemp("explain") / "repo"
    shutil.copytree(demo_repository, repo)  # a job writes a model into it
    save_model(build_mlp(1), repo / "mlp" / "1", "model.keras")
    save_model(build_tiny_image(), repo / "tiny" / "1", "model.keras")
    (repo / "tiny" / "config.yaml").write_text("input: image\nresize: squash\nlabels: labels.txt\nmax_batch_size: 16\n")
    (repo / "tiny" / "labels.txt").write_text("red\ngreen\nblue\n")
    save_model(build_flat_image(), repo / "flat" / "1", "model.keras")
    (repo / "flat" / "config.yaml").write_text("input: image\nresize: squash\n")
    settings = Settings(model_repository=repo, engine_cache_dir=demo_engine_cache, reload_interval_s=0.5)
    live = start_server(settings)
    yield live, repo
    live.stop()


def explain(live: LiveServer, model: str, image: bytes, query: str = "") -> httpx.Response:
    return httpx.post(
        f"{live.url}/v2/models/{model}/explain{query}", content=image, headers={"Content-Type": "image/png"},
        timeout=120,
    )  # fmt: skip


def test_efficientnet_sees_the_egyptian_cat_where_it_was_pasted(explain_server: tuple[LiveServer, Path]) -> None:
    live, _ = explain_server
    answer = explain(live, "efficientnet_lite0", composite(), "?class=Egyptian%20cat")
    assert answer.status_code == 200, answer.text
    found = answer.json()
    assert found["method"] == "score-cam" and found["class"]["label"] == "Egyptian cat"
    assert (found["rows"], found["columns"]) == (7, 7) and found["layer"]
    share = mass_inside_the_cat(found["heatmap"])
    assert share > 0.5, share  # the box is 27.5% of the image; a 7x7 map spreads a cell past it (measured: 0.64)
    top = explain(live, "efficientnet_lite0", composite())  # the top class by default: a cat one
    assert top.json()["class"]["label"] in ("Egyptian cat", "tabby", "tiger cat"), top.json()["class"]
    overlay = explain(live, "efficientnet_lite0", composite(), "?class=285&format=png")
    assert overlay.status_code == 200 and overlay.headers["content-type"] == "image/png"
    assert Image.open(io.BytesIO(overlay.content)).size == (INPUT, INPUT)


def readme_story() -> list[list[str]]:
    """The README's "Teach it your classes" commands, as argument lists (continued lines joined, comments gone)."""
    readme = (Path(__file__).parents[3] / "README.md").read_text()
    section = readme.split("## Teach it your classes", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [shlex.split(line, comments=True) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def curl(args: list[str], live: LiveServer, folder: Path) -> bytes:
    """Run a README curl line in `folder` (where .demo-photos is) against `live` instead of localhost:8000."""
    assert args[0] == "curl", args
    done = subprocess.run(
        [arg.replace("localhost:8000", live.host_port) for arg in args], cwd=folder, capture_output=True, timeout=120,
        check=True,
    )  # fmt: skip
    return done.stdout


def test_the_readmes_story_trains_a_head_on_efficientnet_that_sees_the_cat_too(
    explain_server: tuple[LiveServer, Path], tmp_path: Path
) -> None:
    if shutil.which("curl") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("curl is missing: the README's examples use it")
        pytest.skip("curl is not installed")
    live, _ = explain_server
    write_demo_photos(tmp_path / ".demo-photos")  # what scripts/demo writes: classes.zip, cat.png, face.jpg
    train, job_line, classify, explain_json, explain_png = readme_story()
    job_id = json.loads(curl(train, live, tmp_path))["job_id"]
    deadline = time.monotonic() + 600
    while (job := json.loads(curl([a.replace("<job_id>", job_id) for a in job_line], live, tmp_path)))["state"] in (
        "queued", "running",
    ):  # fmt: skip
        assert time.monotonic() < deadline, job
        time.sleep(0.5)
    assert job["state"] == "succeeded", job["error"]
    assert json.loads(curl(classify, live, tmp_path))["predictions"][0][0]["label"] == "cat"
    assert json.loads(curl(explain_json, live, tmp_path))["class"]["label"] == "Egyptian cat"
    curl(explain_png, live, tmp_path)
    with Image.open(tmp_path / "why.png") as why:
        assert (why.format, why.size) == ("PNG", (INPUT, INPUT))

    classified = httpx.post(
        f"{live.url}/v2/models/cat_or_not/classify?top_k=1", content=composite(), headers={"Content-Type": "image/png"}
    )
    assert classified.json()["predictions"][0][0]["label"] == "cat", classified.text
    answer = explain(live, "cat_or_not", composite(), "?class=cat")
    assert answer.status_code == 200, answer.text
    found = answer.json()
    assert found["method"] == "score-cam" and found["layer"] == "head_relu", {**found, "heatmap": "..."}
    share = mass_inside_the_cat(found["heatmap"])
    assert share > 0.5, share


def test_occlusion_and_bad_explain_requests(explain_server: tuple[LiveServer, Path]) -> None:
    live, _ = explain_server
    red = png(Image.new("RGB", (8, 8), (230, 20, 20)))
    tiny = explain(live, "tiny", red, "?class=red")  # its map is 6x6 of an 8x8 image: Score-CAM over it
    assert tiny.status_code == 200 and tiny.json()["method"] == "score-cam", tiny.text
    calls = executions(live.url, "tiny")
    occluded = explain(live, "tiny", red, "?method=occlusion&class=2")
    assert occluded.status_code == 200, occluded.text
    assert executions(live.url, "tiny") == calls + 1 + 4  # the image, then 64 occluded copies in batches of 16
    found = occluded.json()
    assert (found["method"], found["layer"], found["rows"], found["columns"]) == ("occlusion", None, 8, 8)
    assert found["class"] == {"label": "blue", "index": 2, "score": pytest.approx(found["class"]["score"])}
    flat = explain(live, "flat", red)  # no map of 2x2 or more to weigh: occlusion, without being asked
    assert flat.status_code == 200, flat.text
    assert (flat.json()["method"], flat.json()["layer"], flat.json()["rows"]) == ("occlusion", None, 8)
    cases = [
        ("tiny", red, "?method=gradients", 400, "method must be one of score-cam, occlusion"),
        ("tiny", red, "?class=purple", 400, "expected one of its 3 labels (the first: 'red', 'green', 'blue') or an"),
        ("tiny", red, "?class=bleu", 400, "(close ones: 'blue') or an index from 0 to 2"),
        ("flat", red, "?class=cat", 400, "class 'cat' is not an index; this model has no labels"),
        ("tiny", red, "?class=7", 400, "class 7 is out of range"),
        ("tiny", red, "?layer=nope", 400, "unknown layer 'nope'"),
        ("tiny", red, "?layer=pool", 400, "Score-CAM needs a map"),
        ("tiny", red, "?channels=0", 400, "query 'channels' must be a positive integer"),
        ("tiny", red, "?channels=9999", 400, "channels must be an integer from 1 to 512"),
        ("tiny", red, "?format=svg", 400, "query 'format' must be json or png"),
        ("tiny", b"not an image", "", 422, "not a decodable image"),
        ("mlp", red, "", 415, ""),
        ("nothing", red, "", 404, "nothing"),
    ]
    for model, image, query, status, message in cases:
        response = explain(live, model, image, query)
        assert response.status_code == status and message in response.json()["error"], (query, response.text)
    assert httpx.get(f"{live.url}/v2/health/ready").status_code == 200


def test_explanations_are_kept_in_the_feature_cache_that_every_server_of_a_redis_shares(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    save_model(build_tiny_image(), repo / "tiny" / "1", "model.keras")
    (repo / "tiny" / "config.yaml").write_text("input: image\nresize: squash\n")
    redis = RedisServer()
    redis.start()
    servers = []
    try:
        settings = Settings(model_repository=repo, engine_cache_dir=tmp_path / "cache", redis_url=redis.url)
        servers = [start_server(settings), start_server(settings)]
        image = png(Image.new("RGB", (8, 8), (30, 200, 60)))

        def cache_hits(live: LiveServer) -> int:
            stats = httpx.get(f"{live.url}/v2/models/tiny/stats").json()["model_stats"][0]
            return int(stats["inference_stats"]["cache_hit"]["count"])

        first = explain(servers[0], "tiny", image, "?class=1")
        assert first.status_code == 200 and cache_hits(servers[0]) == 0, first.text
        again = explain(servers[1], "tiny", image, "?class=1")  # another server (a worker, a replica): computed once
        assert again.json() == first.json() and cache_hits(servers[1]) == 1
        other = explain(servers[1], "tiny", image, "?class=1&channels=2")  # asked otherwise: computed
        assert other.status_code == 200 and cache_hits(servers[1]) == 1
    finally:
        for live in servers:
            live.stop()
        redis.kill()
