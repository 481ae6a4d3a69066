"""DisconnectWatch: for an ASGI server that does not cancel a request whose client went away (uvicorn, Ray Serve's
replicas), the policy middleware watches the client itself: once the route has read the whole body and has not
answered within `WATCH_AFTER_S` (it waits in a queue, say), a task reads `receive`, and `http.disconnect` before the
answer began cancels the request (recorded as 499: never computed, if still queued). The door's own connections
cancel such a request themselves and say so in the scope (extension `layerserve.cancels`): no watch there."""

from __future__ import annotations

import asyncio
import contextlib

from starlette.types import Message, Receive

from layerserve.transports.policy import CLIENT_CLOSED, Exchange

WATCH_AFTER_S = 0.002  # answers sooner than this never start a watcher (a task per request costs ~10 us)
EXTENSION = "layerserve.cancels"  # in a scope's extensions: the server cancels a request whose client left


class Watches:
    """The watches whose body was read and whose answer has not begun, with the loop time of their last body
    message: one timer for all of them (a timer per request costs more than the request's own routing)."""

    def __init__(self) -> None:
        self.since: dict[DisconnectWatch, float] = {}
        self._timer: asyncio.TimerHandle | None = None

    def add(self, watch: DisconnectWatch) -> None:
        """`watch` waits from now."""
        loop = asyncio.get_running_loop()
        self.since[watch] = loop.time()
        if self._timer is None:
            self._timer = loop.call_later(WATCH_AFTER_S, self._sweep)

    def _sweep(self) -> None:
        """Start watching for each request that has waited `WATCH_AFTER_S`; come back for the others."""
        loop = asyncio.get_running_loop()
        now, self._timer = loop.time(), None
        for watch, since in list(self.since.items()):
            if now - since >= WATCH_AFTER_S:
                del self.since[watch]
                watch.start()
        if self.since:
            self._timer = loop.call_later(WATCH_AFTER_S, self._sweep)


class DisconnectWatch:
    """One request's watch on its client (see the module)."""

    __slots__ = ("_exchange", "_receive", "_watches", "answering", "body_read", "watcher")

    def __init__(self, receive: Receive, exchange: Exchange, watches: Watches) -> None:
        self._receive = receive
        self._exchange = exchange
        self._watches = watches
        self.answering = self.body_read = False
        self.watcher: asyncio.Task[Message] | None = None

    async def receive(self) -> Message:
        """The app's `receive`: a later receive, after the whole body, sees what the watcher saw."""
        if self.body_read:
            self.start()
            if self.watcher is not None:
                return await asyncio.shield(self.watcher)
        message = await self._receive()
        if message["type"] == "http.request" and not message.get("more_body", False):
            self.body_read = True
            self._watches.add(self)
        return message

    def answered(self) -> None:
        """The answer began: nothing to watch for any more."""
        self.answering = True
        self._watches.since.pop(self, None)

    def start(self) -> None:
        """Watch the client (once, and only before the answer began)."""
        if self.watcher is None and not self.answering:
            self.watcher = asyncio.create_task(self._watch())

    async def _watch(self) -> Message:
        message = await self._receive()
        if message["type"] == "http.disconnect" and not self.answering:
            self._exchange.cancel(CLIENT_CLOSED)
        return message

    async def stop(self) -> None:
        """Stop waiting, and cancel the watcher, if any."""
        self._watches.since.pop(self, None)
        watcher = self.watcher
        if watcher is not None and not watcher.done():
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
