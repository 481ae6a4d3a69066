"""ModelLane: a model's infer, classify and features paths parsed as the router's routes would match them; what it
does not take reaches the router."""

from __future__ import annotations

import httpx
import pytest

from layerserve.transports.http.model_lane import model_route
from tests.live_server import LiveServer


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/v2/models/mlp/infer", ("infer", {"model": "mlp"})),
        ("/v2/models/mlp/versions/2/infer", ("infer", {"model": "mlp", "version": "2"})),
        ("/v2/models/a b/versions/x/infer", ("infer", {"model": "a b", "version": "x"})),  # the route checks it
        ("/v2/models/mlp/classify", ("classify", {"model": "mlp"})),
        ("/v2/models/mlp/versions/3/features", ("features", {"model": "mlp", "version": "3"})),
        ("/v2/models//infer", None),
        ("/v2/models/mlp/versions//infer", None),
        ("/v2/models/mlp/labels/stable/infer", None),
        ("/v2/models/mlp/infer/", None),
        ("/v2/models/mlp/features/batch", None),
        ("/v2/models/mlp/ready", None),
        ("/v2/models/infer", None),
        ("/v1/models/mlp:predict", None),
    ],
)
def test_lane_paths(path: str, expected: tuple[str, dict[str, str]] | None) -> None:
    assert model_route(path) == expected


def test_the_lane_answers_as_the_route_and_leaves_the_rest_to_the_router(server: LiveServer) -> None:
    bad_version = httpx.post(f"{server.url}/v2/models/mlp/versions/x/infer", content=b"{}")
    assert bad_version.status_code == 400 and "version must be a positive integer" in bad_version.json()["error"]
    unknown = httpx.post(f"{server.url}/v2/models/nope/infer", content=b"{}")
    assert unknown.status_code == 404 and "unknown model 'nope'" in unknown.json()["error"]
    wrong_method = httpx.get(f"{server.url}/v2/models/mlp/infer")
    assert wrong_method.status_code == 405 and "allowed: POST" in wrong_method.json()["error"]
    no_route = httpx.post(f"{server.url}/v2/models/mlp/versions/1/infer/more", content=b"{}")
    assert no_route.status_code == 404 and "no route" in no_route.json()["error"]


def test_classify_and_features_take_the_lane_with_the_route_s_answers(server: LiveServer) -> None:
    unknown = httpx.post(f"{server.url}/v2/models/nope/classify", json={"texts": ["x"]})
    assert unknown.status_code == 404 and "unknown model 'nope'" in unknown.json()["error"]
    tensors_only = httpx.post(f"{server.url}/v2/models/mlp/versions/1/features?layer=d1", json={"texts": ["x"]})
    assert tensors_only.status_code == 415 and "/infer" in tensors_only.json()["error"]
    wrong_method = httpx.get(f"{server.url}/v2/models/mlp/classify")
    assert wrong_method.status_code == 405 and "allowed: POST" in wrong_method.json()["error"]
    metrics = httpx.get(f"{server.url}/metrics").text  # counted under the route's own name, as the router would
    assert 'route="image.features",status="415"' in metrics.replace('model="mlp",', "")
