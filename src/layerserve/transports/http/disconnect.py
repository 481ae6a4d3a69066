"""CancelOnDisconnectMiddleware: a client that goes away while its request waits gets that request cancelled, so
that it leaves its queue without being computed (the batcher skips cancelled requests and counts them)."""

from __future__ import annotations

import asyncio
import contextlib

from starlette.types import ASGIApp, Message, Receive, Scope, Send

CLIENT_CLOSED = 499  # nginx's "client closed request": what the request metrics and access log record


_WATCH_AFTER_S = 0.002  # answers sooner than this never start a watcher (a task per request costs ~10 us)


class CancelOnDisconnectMiddleware:
    """Once the route has read the whole body and has not answered within a few milliseconds (it waits in a queue,
    say), watch the connection: on `http.disconnect` before the answer began, cancel the route's task. The request
    is recorded with status 499 (nothing reaches the client)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer the request, unless its client leaves first."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        handler = asyncio.current_task()
        assert handler is not None
        watcher: asyncio.Task[Message] | None = None
        timer: asyncio.TimerHandle | None = None
        answering = cancelled = body_read = False

        async def watch() -> Message:
            nonlocal cancelled
            message = await receive()
            if message["type"] == "http.disconnect" and not answering:
                cancelled = True
                handler.cancel()
            return message

        def start_watching() -> None:
            nonlocal watcher
            if watcher is None and not answering:
                watcher = asyncio.create_task(watch())

        async def receive_and_watch() -> Message:
            nonlocal timer, body_read
            if body_read:  # later receives see what the watcher saw
                start_watching()
                if watcher is not None:
                    return await asyncio.shield(watcher)
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                body_read = True
                timer = asyncio.get_running_loop().call_later(_WATCH_AFTER_S, start_watching)
            return message

        async def send_and_see(message: Message) -> None:
            nonlocal answering
            answering = True
            await send(message)

        try:
            await self.app(scope, receive_and_watch, send_and_see)
        except asyncio.CancelledError:
            if not cancelled:
                raise
            handler.uncancel()
            # The connection is gone, so the server drops this answer; it only tells the middleware outside.
            await send({"type": "http.response.start", "status": CLIENT_CLOSED, "headers": []})
            await send({"type": "http.response.body", "body": b""})
        finally:
            if timer is not None:
                timer.cancel()
            if watcher is not None and not watcher.done():
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
