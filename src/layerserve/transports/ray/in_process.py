"""An ASGI app driven in process, without a server: its lifespan, and one HTTP request as plain values (what a
group's replica answers for the ingress, see group_router.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message


@dataclass(frozen=True)
class PlainRequest:
    """One HTTP request: what crosses from the ingress to a group's replica."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes


@dataclass
class PlainResponse:
    """One HTTP answer, whole."""

    status: int = 500
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""


class Lifespan:
    """Runs an app's lifespan: `start()` returns once startup completed, `stop()` once shutdown did."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app
        self._inbox: asyncio.Queue[Message] = asyncio.Queue()
        self._outbox: asyncio.Queue[Message] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Run the startup (the runtime loads every model).

        Raises:
            RuntimeError: the startup failed.
        """
        self._task = asyncio.create_task(self._run())
        await self._inbox.put({"type": "lifespan.startup"})
        message = await self._outbox.get()
        if message["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"the replica did not start: {message.get('message', message['type'])}")

    async def _run(self) -> None:
        await self._app({"type": "lifespan", "asgi": {"version": "3.0"}}, self._inbox.get, self._outbox.put)

    async def stop(self) -> None:
        """Run the shutdown."""
        if self._task is None:
            return
        await self._inbox.put({"type": "lifespan.shutdown"})
        await self._outbox.get()
        await self._task


async def call_app(app: ASGIApp, request: PlainRequest) -> PlainResponse:
    """Answer `request` with `app`; the client counts as connected until the answer is complete."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
        "scheme": "http", "path": request.path, "raw_path": request.path.encode(), "root_path": "",
        "query_string": request.query_string, "headers": request.headers, "client": ("ray-ingress", 0),
        "server": ("layerserve", 0),
    }  # fmt: skip
    response, answered, sent = PlainResponse(), asyncio.Event(), False
    chunks: list[bytes] = []

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await answered.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            response.status, response.headers = message["status"], list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                answered.set()

    try:
        await app(scope, receive, send)
    finally:
        answered.set()
    response.body = b"".join(chunks)
    return response
