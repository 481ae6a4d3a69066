"""PolicyMiddleware: the request policy (transports/policy.py) for every request the ASGI app answers, whichever
server runs it (the door's own connection, or a Ray replica's uvicorn): the app's outermost middleware."""

from __future__ import annotations

from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from layerserve.transports.http.bodies import refusal_answer
from layerserve.transports.http.cycle import header_value
from layerserve.transports.http.disconnect import EXTENSION, DisconnectWatch, Watches
from layerserve.transports.policy import Exchange, Refusal, RequestPolicy, http_access


class PolicyMiddleware:
    """Runs each HTTP request under the policy: the token its path needs, metrics and the access log, and the answer
    to an error (ours: its status; anything else: a logged 500 with an id; nothing is re-raised, so the connection
    is kept). An error after the answer began cannot be answered: it is logged, and the server closes the
    connection."""

    def __init__(self, app: ASGIApp, policy: RequestPolicy) -> None:
        self.app = app
        self._policy = policy
        self._watches = Watches()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer the request under the policy."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        authorization = header_value(scope, b"authorization") if self._policy.needs_tokens else None
        traceparent = header_value(scope, b"traceparent") if self._policy.tracing is not None else None
        exchange = Exchange(scope["method"], path, "none", http_access(path), authorization, False, traceparent)
        watch = None if EXTENSION in scope.get("extensions", ()) else DisconnectWatch(receive, exchange, self._watches)
        answer = _Answer(send, exchange, watch)
        try:
            refused = await self._policy.run(exchange, self._route, scope, receive if watch is None else watch.receive,
                                             answer)  # fmt: skip
        finally:
            if watch is not None:
                await watch.stop()
        if isinstance(refused, Refusal) and not answer.started:  # (once it began, the server closes the connection)
            headers, body = refusal_answer(refused)
            await send({"type": "http.response.start", "status": refused.status, "headers": headers})
            await send({"type": "http.response.body", "body": body})

    async def _route(self, scope: Scope, receive: Receive, answer: _Answer) -> None:
        try:
            await self.app(scope, receive, answer.send)
        finally:
            answer.exchange.route = route_name(scope.get("endpoint"))


class _Answer:
    """The app's `send`: notes that the answer began, and its status."""

    __slots__ = ("_send", "_watch", "exchange", "started")

    def __init__(self, send: Send, exchange: Exchange, watch: DisconnectWatch | None) -> None:
        self._send = send
        self.exchange = exchange
        self._watch = watch
        self.started = False

    async def send(self, message: Message) -> None:
        """Pass the message on, noting the answer's status."""
        if message["type"] == "http.response.start":
            self.started = True
            self.exchange.status = message["status"]
            if self._watch is not None:
                self._watch.answered()
        await self._send(message)


def route_name(endpoint: Any) -> str:
    """`v2.infer`, `tfserving.predict`, ...: the module and function that answered; `none` if no route did."""
    if endpoint is None:
        return "none"
    module = getattr(endpoint, "__module__", "").rsplit(".", 1)[-1].removesuffix("_routes")
    return f"{module}.{getattr(endpoint, '__name__', 'endpoint')}"
