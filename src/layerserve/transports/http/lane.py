"""The lane: a model's POST infer, classify and features requests straight to their route, past Starlette's router,
exception handling and middleware. `DirectLane` answers them from the door's own connection (protocol.py), under the
request policy, in one write; `ModelLane` is the same shortcut inside the ASGI app, for the app's other servers (a
Ray replica's uvicorn) and for the answers the app compresses.

Every request of a model takes `POST /v2/models/{model}[/versions/{version}]/infer` (or `/classify`, `/features`);
for a fast model, what the router (a regular expression per route, in order), the middleware and `Response.__call__`
cost is a good part of the server's time per request. Both run the same route functions as the router; the routes
stay in the router too (OpenAPI).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from layerserve.transports.http import image_routes, v2_routes
from layerserve.transports.http.bodies import refusal_answer
from layerserve.transports.http.compression import accepted_encoding
from layerserve.transports.http.cycle import RequestCycle, header_value
from layerserve.transports.policy import Exchange, Refusal, RequestPolicy, http_access

Endpoint = Callable[[Request], Awaitable[Response]]
LaneTarget = tuple[Endpoint, dict[str, str], str]  # the route, its path parameters, its name in the metrics

_PREFIX = "/v2/models/"
_ENDPOINTS: dict[str, tuple[Endpoint, str]] = {
    "infer": (v2_routes.infer, "v2.infer"),
    "classify": (image_routes.classify, "image.classify"),
    "features": (image_routes.features, "image.features"),
}


def model_route(path: str) -> tuple[str, dict[str, str]] | None:
    """The action (`infer`, `classify` or `features`) and `{"model": m[, "version": v]}` of a model's lane path,
    as the router's routes would match them; else None."""
    if not path.startswith(_PREFIX):
        return None
    parts = path[len(_PREFIX) :].split("/")
    action = parts[-1]
    if action not in _ENDPOINTS:
        return None
    if len(parts) == 2 and parts[0]:
        return action, {"model": parts[0]}
    if len(parts) == 4 and parts[0] and parts[1] == "versions" and parts[2]:
        return action, {"model": parts[0], "version": parts[2]}
    return None


def lane_target(scope: Scope) -> LaneTarget | None:
    """The route, path parameters and route name of a lane request (a model's POST infer, classify or features);
    else None."""
    if scope["method"] != "POST":
        return None
    path, root = scope["path"], scope.get("root_path", "")
    found = model_route(path[len(root) :] if root and path.startswith(root) else path)
    if found is None:
        return None
    action, params = found
    endpoint, route = _ENDPOINTS[action]
    return endpoint, params, route


class DirectLane:
    """Answers lane requests from the door's connection: the route under the request policy, its answer (or the
    refusal of its error) in one write."""

    def __init__(
        self, app: Any, policy: RequestPolicy, compresses: bool, serves_model: Callable[[str], bool],
        answer_headers: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:  # fmt: skip
        self._app = app
        self._policy = policy
        self._compresses = compresses
        self._serves_model = serves_model
        self._served: dict[str, bool] = {}  # by model name (clients name the same few models again and again)
        self._max_body_bytes = policy.max_body_bytes
        self._headers = answer_headers  # added to every answer (a Ray replica's name)

    def target(self, scope: dict[str, Any]) -> LaneTarget | None:
        """What answers this request on the lane; None for one the app answers: one whose answer it would compress
        (so that there is one way to compress), or for a model this server leaves to others (a Ray group's)."""
        found = lane_target(scope)
        if found is None or (self._compresses and accepted_encoding(scope) is not None):
            return None
        model = found[1]["model"]
        served = self._served.get(model)
        if served is None:
            served = self._serves_model(model)
            if len(self._served) < 1024:
                self._served[model] = served
        return found if served else None

    def reads_whole(self, scope: dict[str, Any]) -> bool:
        """Whether a request's body is read whole before its route runs: its length is announced and within the
        limit (the route refuses a longer one before reading it), so buffering it costs no more than the route's
        own read, and the route takes it in one piece."""
        length = header_value(scope, b"content-length")
        return length is not None and length.isdigit() and int(length) <= self._max_body_bytes

    async def serve(self, cycle: RequestCycle, target: LaneTarget) -> None:
        """Answer one lane request on its cycle."""
        endpoint, params, route = target
        scope = cycle.scope
        authorization = header_value(scope, b"authorization") if self._policy.needs_tokens else None
        path = scope["path"]
        traceparent = header_value(scope, b"traceparent") if self._policy.tracing is not None else None
        exchange = Exchange(scope["method"], path, route, http_access(path), authorization, False, traceparent)
        scope["app"], scope["path_params"], scope["endpoint"] = self._app, params, endpoint
        request = Request(scope, cycle.receive)
        answer = await self._policy.run(exchange, self._answer, exchange, cycle, endpoint, request)
        if isinstance(answer, Refusal):
            headers, body = refusal_answer(answer)
            cycle.answer(answer.status, headers, body, self._headers)

    async def _answer(self, exchange: Exchange, cycle: RequestCycle, endpoint: Endpoint, request: Request) -> None:
        response = await endpoint(request)
        exchange.status = response.status_code
        cycle.answer(response.status_code, response.raw_headers, response.body, self._headers)


class ModelLane:
    """ASGI middleware: takes a model's POST infer, classify and features requests to their route directly; passes
    every other request on. Errors go up to the policy middleware, as the router's would."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer a lane request, or pass the request on."""
        target = lane_target(scope) if scope["type"] == "http" else None
        if target is None:
            await self.app(scope, receive, send)
            return
        endpoint, scope["path_params"], _ = target
        scope["endpoint"] = endpoint
        response = await endpoint(Request(scope, receive, send))
        await response(scope, receive, send)
