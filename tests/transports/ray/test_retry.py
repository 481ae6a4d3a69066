"""RetryLostReplica around an ASGI app that loses requests as Ray's proxy does when a replica dies: sent again up to
twice with the same body, a third loss is a 503 with Retry-After, a training job's submission is never sent twice."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from layerserve.transports.ray.affinity import NameModel
from layerserve.transports.ray.replica import REPLICA_HEADER
from layerserve.transports.ray.retry import RETRY_AFTER_S, RetryLostReplica, proxy_middlewares

pytestmark = pytest.mark.anyio


class LosingApp:
    """Loses the first `losses` requests as Ray's proxy does when their replica dies: `how` is "silent" (ended
    without an answer), "500" (a 500 no replica wrote), "start" (a replica's start, then no body) or "raise"."""

    def __init__(self, losses: int, how: str = "silent") -> None:
        self.losses, self.how = losses, how
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.bodies.append((await receive())["body"])
        start = {"type": "http.response.start", "status": 200, "headers": [(REPLICA_HEADER.encode(), b"n/r")]}
        if len(self.bodies) <= self.losses:
            if self.how == "500":
                await send({"type": "http.response.start", "status": 500, "headers": []})
                await send({"type": "http.response.body", "body": b"Internal Server Error"})
            elif self.how == "start":
                await send(start)
            elif self.how == "raise":
                raise RuntimeError("the replica's actor died")
            return
        await send(start)
        await send({"type": "http.response.body", "body": b"answer"})


async def _call(app: LosingApp, method: str = "POST", path: str = "/v2/models/m/infer") -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []
    chunks = [{"type": "http.request", "body": b"{\"in", "more_body": True},
              {"type": "http.request", "body": b"puts\": []}", "more_body": False}]  # fmt: skip

    async def receive() -> dict[str, Any]:
        return chunks.pop(0) if chunks else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await RetryLostReplica(app)({"type": "http", "method": method, "path": path}, receive, send)
    return sent


@pytest.mark.parametrize("how", ["silent", "500", "start", "raise"])
async def test_a_lost_request_is_sent_again_with_its_body(how: str) -> None:
    app = LosingApp(2, how)  # lost twice, answered the third time
    sent = await _call(app)
    assert app.bodies == [b'{"inputs": []}'] * 3
    assert [m.get("status") for m in sent if m["type"] == "http.response.start"] == [200]
    assert sent[-1]["body"] == b"answer"


async def test_three_losses_are_a_503_with_retry_after_and_an_answer_passes_through() -> None:
    app = LosingApp(3, "start")
    sent = await _call(app)
    assert len(app.bodies) == 3  # never more: a request that kills its replica takes three with it at most
    assert [m.get("status") for m in sent if m["type"] == "http.response.start"] == [503]
    assert (b"retry-after", str(RETRY_AFTER_S).encode()) in sent[0]["headers"]
    assert "died" in orjson.loads(sent[1]["body"])["error"]
    assert [m["type"] for m in await _call(LosingApp(0))] == ["http.response.start", "http.response.body"]


async def test_a_training_job_submission_is_never_sent_twice() -> None:
    app = LosingApp(1)
    sent = await _call(app, path="/v2/models/reviews/train")
    assert len(app.bodies) == 1 and sent[0]["status"] == 503
    assert (b"retry-after", str(RETRY_AFTER_S).encode()) in sent[0]["headers"]
    assert "/v2/jobs" in orjson.loads(sent[1]["body"])["error"]


def test_the_proxy_retries_and_a_replicas_own_server_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.serve import context

    # Ray's proxy (no replica context): the retry, and the model's name for the router (affinity.py)
    assert [m.cls for m in proxy_middlewares()] == [RetryLostReplica, NameModel]
    # Direct ingress: Ray Serve builds each replica's own HTTP server from the same callback, in the replica, once
    # its context is set; a retry there would only send the request to the replica that lost it.
    monkeypatch.setattr(context, "_INTERNAL_REPLICA_CONTEXT", object())
    assert proxy_middlewares() == []
