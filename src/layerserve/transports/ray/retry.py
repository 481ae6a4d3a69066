"""RetryLostReplica: the Ray Serve proxy's middleware that sends a request again when the replica that held it died
(inference is idempotent), so that a replica killed under load, or a node lost with its replicas, fails no request.

Ray Serve installs a proxy's middlewares from `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`, read where the proxy
runs: `layerserve ray serve` gives it to the Serve controller, whose proxies inherit it (launch.py); an application
deployed otherwise (KubeRay) needs it in the environment of every node.
"""

from __future__ import annotations

import asyncio
import logging

import orjson
from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from layerserve.transports.ray.affinity import NameModel
from layerserve.transports.ray.replica import REPLICA_HEADER

log = logging.getLogger(__name__)

PROXY_CALLBACK_VARIABLE = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "layerserve.transports.ray.retry:proxy_middlewares"

# A lost request is sent again after these pauses (long enough for the proxy's router to hear that the replica died,
# and pick another): tried on three replicas at most, so that a request that kills its replica (out of memory) does
# not take every replica with it.
_PAUSES_S = (0.2, 1.0)
RETRY_AFTER_S = 1  # a lost request the client may send again, in a second (the Retry-After of its 503)


class RetryLostReplica:
    """Wraps the proxy's app: a request whose replica died before it answered is sent again, up to twice. Ray's proxy
    ends such a request without starting an answer, with a 500 that no replica wrote (no `layerserve-replica`
    header), with an answer's start and no body (the replica died between the two), or by raising. If every try
    is lost, the client gets a 503 with Retry-After saying so; a training job's submission is never sent twice (its
    503 tells the client to look at its jobs first). The request body is read whole first (it may be sent again);
    an answer is passed on from its first body part, as it comes.
    """

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        body = await _read_body(receive)
        for pause in _PAUSES_S:
            if not await self._attempt(scope, body, receive, send):
                return
            if _starts_a_job(scope):  # sent twice, it could start two jobs
                await _send_lost(
                    send, "the replica serving this request died; see GET /v2/jobs for whether the job started"
                )
                return
            log.warning("the replica of %s %s died; sending it again", scope["method"], scope["path"])
            await asyncio.sleep(pause)
        if await self._attempt(scope, body, receive, send):
            again = len(_PAUSES_S)
            await _send_lost(send, f"the replica serving this request died, and so did the {again} it went to next")

    async def _attempt(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> bool:
        """Run the request once; True when its replica died and nothing was sent (so it may be sent again).

        The answer's start is held until its first body part arrives: a replica can die between the two (its
        node removed), and a start passed on alone would leave the client a header with no body."""
        sent_body, held, passing, lost = False, list[Message](), False, False

        async def replay() -> Message:
            nonlocal sent_body
            if sent_body:
                return await receive()  # after the body: the client's disconnect, when it leaves
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def watch(message: Message) -> None:
            nonlocal passing, lost
            if passing:
                await send(message)
                return
            if message["type"] == "http.response.start":
                lost = _is_lost(message)  # Ray's own 500: nothing of it goes out
            if lost:
                return
            held.append(message)
            if message["type"] == "http.response.body":
                passing = True
                for part in held:
                    await send(part)

        try:
            await self._app(scope, replay, watch)
        except Exception:
            if passing:
                raise
            log.warning("the proxy failed %s %s before answering", scope["method"], scope["path"], exc_info=True)
        return not passing


async def _send_lost(send: Send, message: str) -> None:
    body = orjson.dumps({"error": message})
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"retry-after", str(RETRY_AFTER_S).encode())]  # fmt: skip
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def proxy_middlewares() -> list[Middleware]:
    """The middlewares of Ray Serve's HTTP proxy (its callback, named by PROXY_CALLBACK): RetryLostReplica, and
    NameModel (a request's model, for the router: affinity.py). None on a replica's own HTTP server (direct
    ingress, behind HAProxy), where Ray Serve installs them too: a request there shares its replica's fate, so there
    is nothing to send again nor a replica to choose, and the wrappers would only cost every request their time."""
    from ray.serve.context import _get_internal_replica_context

    if _get_internal_replica_context() is not None:  # type: ignore[no-untyped-call]
        return []
    return [Middleware(RetryLostReplica), Middleware(NameModel)]


def _starts_a_job(scope: Scope) -> bool:
    """A training job's submission (POST /v2/models/{model}/train), the one call not sent twice."""
    path: str = scope["path"]
    return scope["method"] == "POST" and path.rstrip("/").endswith("/train")


def _is_lost(start: Message) -> bool:
    """Ray's 500 for a request whose replica died: no replica wrote it."""
    headers = {key.lower() for key, _ in start.get("headers", [])}
    return start["status"] == 500 and REPLICA_HEADER.encode() not in headers


async def _read_body(receive: Receive) -> bytes:
    parts, more = [], True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        parts.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(parts)
