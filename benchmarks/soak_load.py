"""The soak's requests: one builder per kind (each with a check of its answer), the tally, the closed loops."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np

from corpora import package_dir

KINDS = ("v2_json", "v2_binary", "v2_layer", "image_classify", "image_features", "text_classify")
PHOTOS = ("chelsea.png", "coffee.png", "astronaut.png", "rocket.jpg", "motorcycle_left.png")
TEXTS = ("房间很干净，服务很好，下次还会再来。", "质量太差了，非常失望。", "还可以吧，价格有点贵。")
TEXT_MODEL = "reviews"


Check = Callable[[httpx.Response], str]  # raises on a malformed answer, else returns its model_version
Request = tuple[str, dict[str, Any], Check]


def _tokens(rng: np.random.Generator) -> tuple[int, np.ndarray]:
    rows = int(rng.integers(1, 5))
    return rows, rng.integers(0, 1000, (rows, 64), dtype=np.int32)


def _json_infer(rng: np.random.Generator, output: str, width: int) -> Request:
    rows, tokens = _tokens(rng)
    body = {
        "inputs": [{"name": "tokens", "shape": [rows, 64], "datatype": "INT32", "data": tokens.ravel().tolist()}],
        "outputs": [{"name": output}],
    }

    def check(response: httpx.Response) -> str:
        body = response.json()
        (answer,) = body["outputs"]
        assert answer["name"] == output and answer["shape"] == [rows, width] and len(answer["data"]) == rows * width
        return str(body["model_version"])

    return "/v2/models/token_classifier/infer", {"json": body}, check


def v2_json(rng: np.random.Generator) -> Request:
    """V2 JSON infer of 1-4 rows of the token classifier."""
    return _json_infer(rng, "scores", 4)


def v2_layer(rng: np.random.Generator) -> Request:
    """V2 JSON infer asking for an inner layer of the token classifier (`pool`, 64 values a row)."""
    return _json_infer(rng, "pool", 64)


def v2_binary(rng: np.random.Generator) -> Request:
    """V2 infer with binary tensor data in and out (Triton's extension), 1-4 rows."""
    rows, tokens = _tokens(rng)
    size = {"binary_data_size": rows * 256}
    inputs = [{"name": "tokens", "shape": [rows, 64], "datatype": "INT32", "parameters": size}]
    outputs = [{"name": "scores", "parameters": {"binary_data": True}}]
    header = json.dumps({"inputs": inputs, "outputs": outputs}).encode()
    headers = {"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"}

    def check(response: httpx.Response) -> str:
        length = int(response.headers["Inference-Header-Content-Length"])
        head = json.loads(response.content[:length])
        (answer,) = head["outputs"]
        assert answer["shape"] == [rows, 4] and answer["parameters"]["binary_data_size"] == rows * 16
        scores = np.frombuffer(response.content[length:], dtype="<f4").reshape(rows, 4)
        assert np.allclose(scores.sum(axis=1), 1.0, atol=1e-3)
        return str(head["model_version"])

    body = header + tokens.astype("<i4").tobytes()
    return "/v2/models/token_classifier/infer", {"content": body, "headers": headers}, check


@functools.cache
def photo_bytes(name: str) -> bytes:
    """One of scikit-image's photos, as its file's bytes (ASSETS.md)."""
    return (package_dir("skimage") / "data" / name).read_bytes()


def _photo(rng: np.random.Generator) -> tuple[bytes, dict[str, str], str]:
    name = PHOTOS[int(rng.integers(len(PHOTOS)))]
    media = "image/jpeg" if name.endswith(".jpg") else "image/png"
    cache = "&cache=false" if rng.random() < 0.25 else ""
    return photo_bytes(name), {"Content-Type": media}, cache


def image_classify(rng: np.random.Generator) -> Request:
    """A photo to EfficientNet's /classify (top 3)."""
    photo, headers, cache = _photo(rng)

    def check(response: httpx.Response) -> str:
        answer = response.json()
        (top,) = answer["predictions"]
        assert len(top) == 3 and all(0.0 <= p["score"] <= 1.0 for p in top)
        return str(answer["model_version"])

    return f"/v2/models/efficientnet_lite0/classify?top_k=3{cache}", {"content": photo, "headers": headers}, check


def image_features(rng: np.random.Generator) -> Request:
    """A photo to EfficientNet's /features of its `avg_pool` layer (1280 values)."""
    photo, headers, cache = _photo(rng)

    def check(response: httpx.Response) -> str:
        answer = response.json()
        assert answer["shape"] == [1, 1280] and len(answer["features"][0]) == 1280
        return str(answer["model_version"])

    path = f"/v2/models/efficientnet_lite0/features?layer=avg_pool{cache}"
    return path, {"content": photo, "headers": headers}, check


class Tally:
    """Every answer counted by (kind of request, status); failures and the first 503/504s kept with their body."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.counts: dict[str, Counter[str]] = {}
        self.failures: list[dict[str, Any]] = []  # the first 100
        self.failure_count = 0
        self.designed: list[dict[str, Any]] = []  # the first 20 answers 503 or 504
        self.versions: dict[str, Counter[str]] = {}  # per kind: the model versions that answered

    def count(self, kind: str, label: str, body: str = "", failed: bool = False) -> None:
        """Count one answer, keeping its body when it failed or was a 503/504."""
        self.counts.setdefault(kind, Counter())[label] += 1
        entry = {"t_s": round(time.monotonic() - self.started, 1), "route": kind, "status": label, "body": body[:500]}
        if failed:
            self.failure_count += 1
            if len(self.failures) < 100:
                self.failures.append(entry)
        elif label[0] in "45" and len(self.designed) < 20:
            self.designed.append(entry)

    def answer(self, kind: str, response: httpx.Response, check: Check | None) -> None:
        """Count an HTTP answer: 2xx must pass `check`; 503 with Retry-After and 504 are expected."""
        status = response.status_code
        if 200 <= status < 300:
            try:
                version = check(response) if check is not None else None
            except (AssertionError, KeyError, ValueError, TypeError, IndexError) as error:
                self.count(kind, f"{status} malformed", f"{error!r}: {response.text}", failed=True)
                return
            self.count(kind, str(status))
            if version is not None:
                self.versions.setdefault(kind, Counter())[version] += 1
        else:
            designed = status == 504 or (status == 503 and "retry-after" in response.headers)
            self.count(kind, str(status), response.text, failed=not designed)


async def request(client: httpx.AsyncClient, tally: Tally, kind: str, method: str, path: str,
                  check: Check | None = None, **kwargs: Any) -> httpx.Response | None:  # fmt: skip
    """Send one request and count its answer (a transport error is a failure)."""
    try:
        response = await client.request(method, path, **kwargs)
    except httpx.TransportError as error:
        tally.count(kind, f"transport {type(error).__name__}", str(error), failed=True)
        await asyncio.sleep(0.1)
        return None
    tally.answer(kind, response, check)
    return response


async def closed_loop(url: str, tally: Tally, kind: str, seed: int, stop_at: float, think_s: float,
                      reconnect_s: float) -> None:  # fmt: skip
    """Send requests of one kind, `think_s` apart, until `stop_at`, waiting out a 503's Retry-After (at most
    1 s); a new connection every `reconnect_s`, so that every worker gets every kind of request."""
    rng, build = np.random.default_rng(seed), BUILDERS[kind]
    while time.monotonic() < stop_at:
        reconnect_at = time.monotonic() + reconnect_s
        async with httpx.AsyncClient(base_url=url, timeout=120.0) as client:
            while time.monotonic() < min(stop_at, reconnect_at):
                path, kwargs, check = build(rng)
                response = await request(client, tally, kind, "POST", path, check, **kwargs)
                if response is not None and response.status_code == 503:
                    await asyncio.sleep(min(float(response.headers.get("retry-after", 1)), 1.0))
                await asyncio.sleep(think_s)


async def prewarm(client: httpx.AsyncClient, tally: Tally, count: int) -> None:
    """Each kind of request `count` times, each on a new connection: every worker then has loaded what each
    kind needs (TensorFlow for cuts, sessions, caches) before memory is watched."""
    rng = np.random.default_rng(0)
    for _ in range(count):
        for kind, build in BUILDERS.items():
            path, kwargs, check = build(rng)
            kwargs["headers"] = {**kwargs.get("headers", {}), "Connection": "close"}
            await request(client, tally, kind, "POST", path, check, **kwargs)


def text_classify(rng: np.random.Generator) -> Request:
    """1-3 texts to the text model's /classify."""
    texts = [TEXTS[int(i)] for i in rng.integers(len(TEXTS), size=int(rng.integers(1, 4)))]

    def check(response: httpx.Response) -> str:
        answer = response.json()
        assert len(answer["predictions"]) == len(texts)
        return str(answer["model_version"])

    return f"/v2/models/{TEXT_MODEL}/classify", {"json": {"texts": texts}}, check


BUILDERS: dict[str, Callable[[np.random.Generator], Request]] = {
    "v2_json": v2_json, "v2_binary": v2_binary, "v2_layer": v2_layer,
    "image_classify": image_classify, "image_features": image_features, "text_classify": text_classify,
}  # fmt: skip
