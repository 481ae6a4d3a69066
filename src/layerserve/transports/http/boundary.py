"""RequestBoundary: the outermost middleware of every HTTP request, in one frame: request metrics and the access log,
a request whose client left cancelled (never computed), and the boundary of unexpected errors.

One middleware rather than three: each layer of ASGI middleware wraps `send` once more and costs a frame and a
closure per message, which for a small model is a visible part of a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from layerserve.transports.http.middleware import log_internal_error, refuse
from layerserve.transports.request_record import RequestRecorder

CLIENT_CLOSED = 499  # nginx's "client closed request": what the request metrics and access log record
_WATCH_AFTER_S = 0.002  # answers sooner than this never start a watcher (a task per request costs ~10 us)


class _Waiting:
    """The exchanges whose body was read and whose answer has not begun, with the loop time of their last body
    message: one timer for all of them (a timer per request costs more than the request's own routing)."""

    def __init__(self) -> None:
        self.since: dict[_Exchange, float] = {}
        self._timer: asyncio.TimerHandle | None = None

    def add(self, exchange: _Exchange) -> None:
        """`exchange` waits from now."""
        loop = asyncio.get_running_loop()
        self.since[exchange] = loop.time()
        if self._timer is None:
            self._timer = loop.call_later(_WATCH_AFTER_S, self._sweep)

    def _sweep(self) -> None:
        """Watch the connection of each exchange that has waited `_WATCH_AFTER_S`; come back for the others."""
        loop = asyncio.get_running_loop()
        now, self._timer = loop.time(), None
        for exchange, since in list(self.since.items()):
            if now - since >= _WATCH_AFTER_S:
                del self.since[exchange]
                exchange.start_watching()
        if self.since:
            self._timer = loop.call_later(_WATCH_AFTER_S, self._sweep)


class _Exchange:
    """One request's state at the boundary: its status, and the watch on its connection.

    Once the route has read the whole body and has not answered within `_WATCH_AFTER_S` (it waits in a queue, say),
    a task watches the connection: on `http.disconnect` before the answer began, the route's task is cancelled.
    """

    __slots__ = ("_receive", "_send", "_waiting", "answering", "body_read", "cancelled", "handler", "status", "watcher")

    def __init__(self, receive: Receive, send: Send, waiting: _Waiting) -> None:
        self._receive = receive
        self._send = send
        self._waiting = waiting
        self.status = 500  # what is recorded when nothing was answered
        self.answering = self.body_read = self.cancelled = False
        self.handler = asyncio.current_task()
        self.watcher: asyncio.Task[Message] | None = None

    async def receive(self) -> Message:
        """The app's `receive`: a later receive, after the whole body, sees what the watcher saw."""
        if self.body_read:
            self.start_watching()
            if self.watcher is not None:
                return await asyncio.shield(self.watcher)
        message = await self._receive()
        if message["type"] == "http.request" and not message.get("more_body", False):
            self.body_read = True
            self._waiting.add(self)
        return message

    async def send(self, message: Message) -> None:
        """The app's `send`: notes that the answer began, and its status."""
        if message["type"] == "http.response.start":
            self.answering = True
            self.status = message["status"]
            self._waiting.since.pop(self, None)
        await self._send(message)

    def start_watching(self) -> None:
        """Watch the connection for the client leaving (once, and only before the answer began)."""
        if self.watcher is None and not self.answering:
            self.watcher = asyncio.create_task(self._watch())

    async def _watch(self) -> Message:
        message = await self._receive()
        if message["type"] == "http.disconnect" and not self.answering and self.handler is not None:
            self.cancelled = True
            self.handler.cancel()
        return message

    async def stop_watching(self) -> None:
        """Stop waiting, and cancel the watcher, if any."""
        self._waiting.since.pop(self, None)
        watcher = self.watcher
        if watcher is not None and not watcher.done():
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher


class RequestBoundary:
    """Counts and times every request by model, version, route and status, and writes the access log; cancels a
    request whose client went away before its answer (recorded as 499: nothing reaches the client); answers an
    unexpected exception with a 500 `{"error": "internal error <id>"}`, logged once.

    Nothing is re-raised, so the server keeps the kept-alive connection open (Starlette's own last handler re-raises
    after answering, which makes uvicorn log the error again and drop the connection). An error after the answer
    began cannot be answered: it is logged and the connection is closed by the server.
    """

    def __init__(self, app: ASGIApp, log_requests: bool) -> None:
        self.app = app
        self._recorder = RequestRecorder(log_requests)
        self._waiting = _Waiting()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer the request, then record it."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        exchange = _Exchange(receive, send, self._waiting)
        self._recorder.start()
        try:
            await self.app(scope, exchange.receive, exchange.send)
        except asyncio.CancelledError:
            if not exchange.cancelled:
                raise
            exchange.handler.uncancel()  # type: ignore[union-attr]
            exchange.status = CLIENT_CLOSED  # the connection is gone: nothing to answer
        except Exception as error:
            message = log_internal_error(scope, error)
            if not exchange.answering:
                exchange.status = 500
                await refuse(send, 500, message)
        finally:
            route, seconds = route_name(scope.get("endpoint")), time.perf_counter() - started
            # Recorded before the last await: a cancellation arriving there (the server's, once the answer is out)
            # would otherwise lose an answered request from the counts.
            self._recorder.record(scope["method"], scope["path"], route, exchange.status, seconds)
            await exchange.stop_watching()


def route_name(endpoint: Any) -> str:
    """`v2.infer`, `tfserving.predict`, ...: the module and function that answered; `none` if no route did."""
    if endpoint is None:
        return "none"
    module = getattr(endpoint, "__module__", "").rsplit(".", 1)[-1].removesuffix("_routes")
    return f"{module}.{getattr(endpoint, '__name__', 'endpoint')}"
