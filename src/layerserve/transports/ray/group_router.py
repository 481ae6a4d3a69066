"""GroupRouter: on the ingress replicas, the HTTP requests for a model of a group go to that group's replicas
(through its deployment handle); the repository index, the statistics of every model and the console's overview
are the ingress's own merged with every group's (the overview's series and processes are the ingress's: its
/metrics already sums every replica). Everything else is the ingress replica's own app."""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any
from urllib.parse import unquote

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from layerserve.transports.ray.in_process import PlainRequest, PlainResponse, call_app
from layerserve.transports.ray.options import RayOptions

log = logging.getLogger(__name__)

_MODEL_PATH = re.compile(r"/v2/(?:repository/)?models/(?P<v2>[^/]+)|/v1/models/(?P<tfs>[^/:]+)")
_MERGED = {
    ("POST", "/v2/repository/index"): "index",
    ("GET", "/v2/models/stats"): "stats",
    ("GET", "/v2/overview"): "overview",
}
_RETRY_PAUSE_S = 0.2


def model_of_path(path: str) -> str | None:
    """The model a request path names (V2, repository, TF Serving), or None."""
    match = _MODEL_PATH.match(path)
    if match is None or path == "/v2/models/stats":
        return None
    return unquote(match["v2"] or match["tfs"])


def error_response(status: int, message: str) -> PlainResponse:
    """A JSON error answer."""
    body = orjson.dumps({"error": message})
    return PlainResponse(
        status, [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())], body
    )


async def forward(
    handles: dict[str, Any], group: str, method: str, *args: Any, once: bool = False, model: str = ""
) -> Any:
    """Call `method` of one replica of `group`, preferably one that holds `model` when given (see affinity.py);
    sent again once (after a pause) if that replica died, unless `once` (a request that must not run twice).

    Raises:
        Exception: the second attempt's failure (or the first's, with `once`).
    """
    handle = handles[group].options(multiplexed_model_id=model) if model else handles[group]
    for attempt in (1, 2):
        try:
            return await getattr(handle, method).remote(*args)
        except Exception as error:  # the replica died (Ray's errors), or the group has none now
            if once or attempt == 2:
                raise
            log.warning("a replica of group %s did not answer (%r); sending the request again", group, error)
            await asyncio.sleep(_RETRY_PAUSE_S)
    raise AssertionError("unreachable")


class GroupRouter:
    """Wraps the ingress replica's app (see the module docstring)."""

    def __init__(self, app: ASGIApp, options: RayOptions, handles: dict[str, Any]) -> None:
        self._app = app
        self._options = options
        self._handles = handles

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        model = model_of_path(path)
        group = self._options.group_of(model) if model else None
        merged = _MERGED.get((method, path))
        if group is None and merged is None:
            await self._app(scope, receive, send)
            return
        request = PlainRequest(
            method, path, scope.get("query_string", b""), list(scope["headers"]), await _body(receive)
        )
        if group is not None:
            is_job = method == "POST" and path.endswith("/train")
            try:
                response = await forward(self._handles, group, "handle_http", request, once=is_job, model=model or "")
            except Exception as error:  # both attempts lost their replica
                response = error_response(503, f"no replica of group {group!r} answered ({error!r}); try again")
        else:
            assert merged is not None
            response = await self._merged(request, merged)
        await _send(send, response)

    async def _merged(self, request: PlainRequest, kind: str) -> PlainResponse:
        """This replica's answer and every group's, as one (index: one list; stats: one `model_stats`)."""
        plain = PlainRequest(
            request.method, request.path, request.query_string,
            [(k, v) for k, v in request.headers if k.lower() != b"accept-encoding"], request.body,
        )  # fmt: skip
        answers = [await call_app(self._app, plain)]
        for group in self._handles:
            try:
                answers.append(await forward(self._handles, group, "handle_http", plain))
            except Exception as error:  # the group's failure is the answer
                return error_response(503, f"no replica of group {group!r} answered ({error!r}); try again")
        for answer in answers:
            if answer.status != 200:
                return answer
        bodies = [orjson.loads(answer.body) for answer in answers]
        if kind == "index":
            body: Any = sorted(
                (row for rows in bodies for row in rows), key=lambda row: (row["name"], row.get("version", ""))
            )
        elif kind == "overview":
            models = sorted((row for answer in bodies for row in answer["models"]), key=lambda row: row["name"])
            body = {**bodies[0], "models": models}
        else:
            body = {"model_stats": [row for stats in bodies for row in stats["model_stats"]]}
        content = orjson.dumps(body)
        headers = [(k, v) for k, v in answers[0].headers if k.lower() not in (b"content-length", b"content-encoding")]
        return PlainResponse(200, [*headers, (b"content-length", str(len(content)).encode())], content)


async def _body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


async def _send(send: Send, response: PlainResponse) -> None:
    await send({"type": "http.response.start", "status": response.status, "headers": response.headers})
    await send({"type": "http.response.body", "body": response.body})
