"""How uvicorn runs the app: its options (`uvicorn_options`) and HttpProtocol, uvicorn's httptools protocol whose
answers leave in one send instead of two, and which answers a model's requests below ASGI (direct_lane.py).

uvicorn writes an answer's status line and headers as soon as the app sends `http.response.start`, then the body
at `http.response.body`: two `send` system calls, and on loopback two TCP segments, per answer; for a small model
they were the largest single cost of a request (docs/design.md). `CoalescingTransport` holds a write until the
next one, or until the event loop's next turn if none comes first, and sends both with one `writelines` (one
`writev` in uvloop).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from layerserve.settings import Settings
from layerserve.transports.http.direct_lane import DirectLane, LaneCall


class CoalescingTransport:
    """A transport whose writes leave in pairs: a write waits for the next one, or for the loop's next turn.

    Everything but `write`, `writelines`, `close` and `write_eof` is the wrapped transport's own; those flush the
    held write first, so that nothing is reordered or lost. What uvicorn calls for every request is delegated by a
    method of its own: an attribute found through `__getattr__` first fails the normal lookup, which builds an
    `AttributeError` each time.
    """

    __slots__ = ("_flush_handle", "_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._flush_handle: asyncio.Handle | None = None

    def write(self, data: bytes) -> None:
        """Hold `data` if nothing is held; else send the held data and `data` together."""
        held = self._held
        if held is None:
            self._held = data
            if self._flush_handle is None:
                self._flush_handle = self._loop.call_soon(self._flush_soon)
            return
        self._held = None
        self._transport.writelines((held, data))

    def writelines(self, chunks: Any) -> None:
        """Send what is held, then `chunks`, in one call."""
        held, self._held = self._held, None
        self._transport.writelines((held, *chunks) if held is not None else chunks)

    def flush(self) -> None:
        """Send what is held now."""
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def _flush_soon(self) -> None:
        self._flush_handle = None
        self.flush()

    def is_closing(self) -> bool:
        """Whether the transport is closing (uvicorn asks after every answer: here, not through `__getattr__`)."""
        return self._transport.is_closing()

    def pause_reading(self) -> None:
        """Stop reading from the socket (uvicorn's flow control)."""
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        """Read from the socket again (uvicorn's flow control)."""
        self._transport.resume_reading()

    def write_eof(self) -> None:
        """Flush, then close the write side."""
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        """Flush, then close (the transport sends what it buffered before it closes)."""
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class HttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol over a `CoalescingTransport` (the server's `http` option); a model's infer,
    classify and features requests go to the app's `DirectLane` instead of through ASGI."""

    _lane: DirectLane | None = None
    _lane_call: LaneCall | None = None  # the connection's lane request now answering (one at a time: see pipeline)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Wrap the connection's transport, then set up the connection as uvicorn does."""
        super().connection_made(CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]
        # The app's lane; none when uvicorn wrapped the app (trace logging) or the app is not layerserve's.
        self._lane = getattr(getattr(self.app, "state", None), "direct_lane", None)

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        """Start the request's lane task, or (not a lane request) its ASGI task as uvicorn does."""
        lane = self._lane
        target = None if lane is None or app is not self.app else lane.target(cycle.scope)  # type: ignore[arg-type]
        if target is None:
            super()._start_asgi_task(cycle, app)
            return
        call = self._lane_call = LaneCall(cycle, lane.reads_whole(cycle.scope))  # type: ignore[union-attr, arg-type]
        # A Task named here: one left unnamed formats its default name ("Task-<n>") as it is created.
        call.task = task = asyncio.Task(lane.serve(call, *target), loop=self.loop, name="lane")  # type: ignore[union-attr]
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    def on_body(self, body: bytes) -> None:
        """As uvicorn, except for a lane request whose body is read whole: its pieces kept without waking the route,
        which takes them when the message is complete, and without pausing the connection at every 64 KiB."""
        call, cycle = self._lane_call, self.cycle
        if call is None or not call.whole_body or call.cycle is not cycle or cycle.response_complete:
            super().on_body(body)
        elif not self.parser.should_upgrade():
            call.parts.append(body)

    def on_message_complete(self) -> None:
        """As uvicorn, after joining a whole-read body's pieces: one copy for a body read in several, none for one
        read at once (uvicorn grows a bytearray, then copies it into the message's bytes)."""
        call = self._lane_call
        if call is not None and call.parts and call.cycle is self.cycle:
            parts, call.parts = call.parts, []
            if not self.cycle.response_complete:  # else answered already (refused before its body was read)
                self.cycle.body = parts[0] if len(parts) == 1 else b"".join(parts)  # type: ignore[assignment]
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        """As uvicorn, and a lane request whose answer has not begun is cancelled: nobody is left to answer."""
        super().connection_lost(exc)
        if self._lane_call is not None:
            self._lane_call.cancel()
        if self.timeout_keep_alive_task is not None:
            self.timeout_keep_alive_task.cancel()
            self.timeout_keep_alive_task = None

    # Keep-alive: uvicorn makes a timer after every answer and cancels it when the next request's data comes (a
    # timer made and cancelled per request). Here a connection's timer is made when it turns idle with none armed;
    # data coming only marks it busy, and a timer that finds the connection busy or idle for less than the timeout
    # when it fires is made again for what is left (or by the next answer).
    _idle_since: float | None = None  # the loop's time of the last answer, while no data has come since

    def _unset_keepalive_if_required(self) -> None:
        """Data came: the connection is not idle."""
        self._idle_since = None

    def on_response_complete(self) -> None:
        """As uvicorn: start the next pipelined request, or else the connection is idle from now."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        self._idle_since = self.loop.time()
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self._keep_alive_expired)

    def _keep_alive_expired(self) -> None:
        """Close the connection if it has been idle for the keep-alive timeout; else wait for what is left."""
        self.timeout_keep_alive_task = None
        if self._idle_since is None:
            return  # busy: its next answer arms the timer
        left = self._idle_since + self.timeout_keep_alive - self.loop.time()
        if left > 0:
            self.timeout_keep_alive_task = self.loop.call_later(left, self._keep_alive_expired)
        else:
            self.timeout_keep_alive_handler()


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """The options `uvicorn.run` / `uvicorn.Config` serve the app with (host, port, loop, protocol, timeouts)."""
    return {
        "host": settings.host, "port": settings.port, "log_level": settings.log_level, "log_config": None,
        "loop": "uvloop", "http": f"{__name__}:HttpProtocol", "access_log": False, "proxy_headers": False,
        "timeout_graceful_shutdown": settings.shutdown_timeout_s,
        # Longer than clients' own keep-alive expiry (httpx: 5 s, uvicorn's default too): when the server closes
        # an idle connection first, a request the client sends on it at that moment is reset.
        "timeout_keep_alive": settings.keep_alive_timeout_s,
    }  # fmt: skip
