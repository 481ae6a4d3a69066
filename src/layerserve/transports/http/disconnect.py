"""CancelOnDisconnectMiddleware: a client that goes away while its request waits gets that request cancelled, so
that it leaves its queue without being computed (the batcher skips cancelled requests and counts them)."""

from __future__ import annotations

import asyncio
import contextlib

from starlette.types import ASGIApp, Message, Receive, Scope, Send

CLIENT_CLOSED = 499  # nginx's "client closed request": what the request metrics and access log record


class CancelOnDisconnectMiddleware:
    """Once the route has read the whole body, watch the connection: on `http.disconnect` before the answer
    began, cancel the route's task. The request is recorded with status 499 (nothing reaches the client)."""

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
        answering = cancelled = False

        async def watch() -> Message:
            nonlocal cancelled
            message = await receive()
            if message["type"] == "http.disconnect" and not answering:
                cancelled = True
                handler.cancel()
            return message

        async def receive_and_watch() -> Message:
            nonlocal watcher
            if watcher is not None:  # the body was read: later receives see what the watcher saw
                return await asyncio.shield(watcher)
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                watcher = asyncio.create_task(watch())
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
            if watcher is not None and not watcher.done():
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
