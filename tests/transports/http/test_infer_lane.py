"""InferLane: infer paths parsed as the router's routes would match them; what it does not take reaches the router."""

from __future__ import annotations

import httpx
import pytest

from layerserve.transports.http.infer_lane import infer_path_params
from tests.live_server import LiveServer


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/v2/models/mlp/infer", {"model": "mlp"}),
        ("/v2/models/mlp/versions/2/infer", {"model": "mlp", "version": "2"}),
        ("/v2/models/a b/versions/x/infer", {"model": "a b", "version": "x"}),  # the route checks the version
        ("/v2/models//infer", None),
        ("/v2/models/mlp/versions//infer", None),
        ("/v2/models/mlp/labels/stable/infer", None),
        ("/v2/models/mlp/infer/", None),
        ("/v2/models/mlp/classify", None),
        ("/v2/models/infer", None),
    ],
)
def test_infer_paths(path: str, expected: dict[str, str] | None) -> None:
    assert infer_path_params(path) == expected


def test_the_lane_answers_as_the_route_and_leaves_the_rest_to_the_router(server: LiveServer) -> None:
    bad_version = httpx.post(f"{server.url}/v2/models/mlp/versions/x/infer", content=b"{}")
    assert bad_version.status_code == 400 and "version must be a positive integer" in bad_version.json()["error"]
    unknown = httpx.post(f"{server.url}/v2/models/nope/infer", content=b"{}")
    assert unknown.status_code == 404 and "unknown model 'nope'" in unknown.json()["error"]
    wrong_method = httpx.get(f"{server.url}/v2/models/mlp/infer")
    assert wrong_method.status_code == 405 and "allowed: POST" in wrong_method.json()["error"]
    no_route = httpx.post(f"{server.url}/v2/models/mlp/versions/1/infer/more", content=b"{}")
    assert no_route.status_code == 404 and "no route" in no_route.json()["error"]
