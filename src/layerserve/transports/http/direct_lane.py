"""DirectLane: a model's infer, classify and features requests answered from the server's HTTP protocol, below ASGI.

For a small model, the ASGI layers between uvicorn's protocol and the route were most of the server's own cost of a
request: the middleware stack (request boundary, tokens, compression, lane), each wrapping `send`; the answer as two
ASGI messages, each checked and turned into bytes by uvicorn; Starlette's `Response.__call__`. The server's protocol
(server.py) hands a lane request (model_lane.py's `lane_target`) to `DirectLane.serve` instead: the same route
function on a Starlette `Request` over uvicorn's own `receive`, with what the middleware would have done done here
once (tokens, metrics and access log, a request whose client left cancelled, the boundary of unexpected errors),
and the answer written in one `writelines`.

A request whose answer the app would compress (compression on, and the client accepts gzip or deflate) goes through
the app, so that there is one way to compress. Under any other ASGI server (a Ray replica's), the app's own
`ModelLane` takes these requests.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.requests import ClientDisconnect, Request
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, RequestResponseCycle

from layerserve.settings import Settings
from layerserve.transports.http.boundary import CLIENT_CLOSED, route_name
from layerserve.transports.http.middleware import (
    TokenCheck,
    accepted_encoding,
    header_value,
    log_internal_error,
    refusal,
)
from layerserve.transports.http.model_lane import Endpoint, answer, lane_target
from layerserve.transports.request_record import RequestRecorder


class LaneCall:
    """One lane request on its connection: its uvicorn cycle and task; `cancel` when its client leaves first;
    `whole_body` when its body is read whole before the route sees it (see `DirectLane.reads_whole`), its pieces
    in `parts` until then."""

    __slots__ = ("cancelled", "cycle", "parts", "task", "whole_body")

    def __init__(self, cycle: RequestResponseCycle, whole_body: bool = False) -> None:
        self.cycle = cycle
        self.whole_body = whole_body
        self.parts: list[bytes] = []
        self.cancelled = False
        self.task: asyncio.Task[None] | None = None

    def cancel(self) -> None:
        """The client left before the answer began: the request is cancelled, never computed (recorded as 499)."""
        if self.task is not None and not self.task.done() and not self.cycle.response_started:
            self.cancelled = True
            self.task.cancel()


class DirectLane:
    """Answers the lane requests of `app` (its routes, tokens and metrics) from the server's protocol."""

    def __init__(self, app: Any, settings: Settings) -> None:
        self._app = app
        has_tokens = bool(settings.admin_token or settings.api_token)
        self._tokens = TokenCheck(settings.admin_token, settings.api_token) if has_tokens else None
        self._compresses = bool(settings.compress_min_bytes)
        self._max_body_bytes = settings.max_body_bytes
        self._recorder = RequestRecorder(settings.access_log)
        self._routes: dict[Endpoint, str] = {}  # each route's name in the request metrics
        self._headers: tuple[tuple[bytes, bytes], ...] = ()  # added to every answer (add_answer_header)

    def add_answer_header(self, name: str, value: str) -> None:
        """Add `name: value` to every answer of this lane (as a middleware of the app adds it to the app's)."""
        self._headers = (*self._headers, (name.encode("latin-1"), value.encode("latin-1")))

    def target(self, scope: dict[str, Any]) -> tuple[Endpoint, dict[str, str]] | None:
        """The route and path parameters of a request this lane answers; None for one the app answers."""
        found = lane_target(scope)
        if found is None or (self._compresses and accepted_encoding(scope) is not None):
            return None
        return found

    def reads_whole(self, scope: dict[str, Any]) -> bool:
        """Whether a request's body is read whole before its route runs: its length is announced and within the
        limit (the route refuses a longer one before reading it), so buffering it costs no more than the route's
        own read; the route then takes it in one message instead of one per 64 KiB that uvicorn reads before
        pausing the connection for the app."""
        length = header_value(scope, b"content-length")
        return length is not None and length.isdigit() and int(length) <= self._max_body_bytes

    async def serve(self, call: LaneCall, endpoint: Endpoint, params: dict[str, str]) -> None:
        """Answer one lane request on its cycle, then record it."""
        cycle = call.cycle
        scope: Any = cycle.scope
        started, status = time.perf_counter(), 500
        self._recorder.start()
        try:
            refused = None if self._tokens is None else self._tokens.refusal(scope)
            if refused is not None:
                status = refused[0]
                await write_answer(cycle, status, *refusal(*refused), self._headers)
                return
            scope["app"], scope["path_params"], scope["endpoint"] = self._app, params, endpoint
            response = await answer(endpoint, Request(scope, cycle.receive))  # type: ignore[arg-type]
            status = response.status_code
            await write_answer(cycle, status, response.raw_headers, response.body, self._headers)
        except asyncio.CancelledError:
            if not call.cancelled:
                raise
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            status = CLIENT_CLOSED  # the connection is gone: nothing to answer
        except ClientDisconnect:
            status = CLIENT_CLOSED
        except Exception as error:
            message = log_internal_error(scope, error)
            if not cycle.response_started:
                status = 500
                await write_answer(cycle, 500, *refusal(500, message), self._headers)
        finally:
            seconds = time.perf_counter() - started
            route = self._routes.get(endpoint) or self._routes.setdefault(endpoint, route_name(endpoint))
            self._recorder.record(scope["method"], scope["path"], route, status, seconds)


async def write_answer(
    cycle: RequestResponseCycle, status: int, headers: list[tuple[bytes, bytes]], body: bytes | memoryview,
    extra: tuple[tuple[bytes, bytes], ...] = (),
) -> None:  # fmt: skip
    """Status line, headers (the server's defaults first, `extra` last) and body in one write, then the cycle's
    end as uvicorn's own `send` ends it (keep-alive or close, the next pipelined request)."""
    if cycle.flow.write_paused and not cycle.disconnected:
        await cycle.flow.drain()
    if cycle.disconnected:
        return
    cycle.response_started, cycle.waiting_for_100_continue = True, False
    head = [STATUS_LINE[status]]
    for name, value in (*cycle.default_headers, *headers, *extra):
        head += (name, b": ", value, b"\r\n")
    if not cycle.keep_alive:
        head.append(b"connection: close\r\n")
    head.append(b"\r\n")
    cycle.transport.writelines((b"".join(head), body))
    cycle.response_complete = True
    cycle.message_event.set()
    if not cycle.keep_alive:
        cycle.transport.close()
    cycle.on_response()
