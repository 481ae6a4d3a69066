"""GrpcConnection: the IO of one client's connection to the gRPC door: the bytes it reads go to its GrpcHttp2 core
(http2.py), whose events start, feed and cancel calls (calls.py); what the core holds is written once per loop
turn, so that the answers one batch finishes on one connection share a write (an answer leaves at once when its
call was the connection's last in flight)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from layerserve.transports.grpc.calls import Call
from layerserve.transports.grpc.http2 import (
    CallClosed,
    CallStarted,
    ConnectionEnded,
    GrpcHttp2,
    MessageReceived,
    RequestEnded,
    WindowOpened,
)
from layerserve.transports.grpc.wire import CallError

log = logging.getLogger(__name__)


class GrpcConnection(asyncio.Protocol):
    """One client connection: its calls by stream, the handlers by path (see the module)."""

    def __init__(
        self, handlers: dict[bytes, Any], max_message_bytes: int, connections: set[GrpcConnection],
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:  # fmt: skip
        self.loop = loop or asyncio.get_running_loop()
        self.http2 = GrpcHttp2(max_message_bytes)
        self.peer = ""
        self._handlers = handlers
        self._connections = connections
        self._transport: asyncio.Transport | None = None
        self._calls: dict[int, Call] = {}
        self._flush_handle: asyncio.Handle | None = None
        self._writable: asyncio.Future[None] | None = None
        self._window: asyncio.Future[None] | None = None
        self._idle: asyncio.Future[None] | None = None
        self._close_when_sent = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Register the connection; the server's preface goes once the client's first bytes show it speaks HTTP/2."""
        self._transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio's classes
        self._connections.add(self)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            host, port = peer[:2]
            self.peer = f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"

    def connection_lost(self, exc: Exception | None) -> None:
        """Cancel the calls still running."""
        self._connections.discard(self)
        for call in list(self._calls.values()):
            call.cancel()
        self._calls.clear()
        for waiter in (self._writable, self._window, self._idle):
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def data_received(self, data: bytes) -> None:
        """Feed the core; act on its events; write what it holds at once (acknowledgements, refusals)."""
        for event in self.http2.receive_data(data):
            kind = type(event)
            if kind is MessageReceived:
                self._step(event.stream_id, Call.received, event.message)  # type: ignore[union-attr]
            elif kind is CallStarted:
                self._start(event)  # type: ignore[arg-type]
            elif kind is RequestEnded:
                self._step(event.stream_id, Call.ended)  # type: ignore[union-attr]
            elif kind is CallClosed:
                call = self._calls.pop(event.stream_id, None)  # type: ignore[union-attr]
                if call is not None:
                    call.cancel()
                    self._removed()
            elif kind is WindowOpened:
                if self._window is not None and not self._window.done():
                    self._window.set_result(None)
                self._window = None
            elif kind is ConnectionEnded:
                log.warning("gRPC connection from %s closed: %s", self.peer, event.reason)  # type: ignore[union-attr]
                self._flush()
                self.close()
                return
        self._flush()
        if self._close_when_sent and not self.http2.has_pending_send():
            self.close()

    def _start(self, event: CallStarted) -> None:
        handler = self._handlers.get(event.path)
        if handler is None:
            self.http2.end_call(event.stream_id, grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {event.path!r}")
            return
        self._calls[event.stream_id] = Call(self, event.stream_id, handler, event.headers, event.timeout_s)

    def _step(self, stream_id: int, step: Any, *args: Any) -> None:
        """Tell a call what came; a request that breaks its rules ends the call with the status."""
        call = self._calls.get(stream_id)
        if call is None or call.closed:
            return
        try:
            step(call, *args)
        except CallError as error:
            call.finish(error.code, error.details)
            if call.task is not None:
                call.task.cancel()

    # What calls use (calls.Link).

    def answered(self, call: Call) -> None:
        """A call has sent its status: the last in flight writes now, others at the end of this loop turn."""
        self._calls.pop(call.stream_id, None)
        self._removed()
        if self._calls:
            self.flush_soon()
        else:
            self._flush()

    def flush_soon(self) -> None:
        """Write what the core holds at the end of this loop turn, with whatever else is written in it."""
        if self._flush_handle is None:
            self._flush_handle = self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_handle = None
        data = self.http2.data_to_send()
        if data and self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    async def window_opened(self) -> None:
        """Wait for the client's next WINDOW_UPDATE (or the connection's end)."""
        if self._window is None:
            self._window = self.loop.create_future()
        await asyncio.shield(self._window)

    async def drained(self) -> None:
        """Wait while the transport's write buffer is over its high-water mark."""
        if self._writable is not None:
            await asyncio.shield(self._writable)

    def pause_writing(self) -> None:
        """The transport's buffer is full: streaming writers wait."""
        if self._writable is None:
            self._writable = self.loop.create_future()

    def resume_writing(self) -> None:
        """The transport's buffer drained."""
        if self._writable is not None:
            self._writable.set_result(None)
            self._writable = None

    # Shutdown.

    def _removed(self) -> None:
        """After a call left: wake who waits for the connection to be idle; one going away closes once idle and once
        what the core holds for the client's window is sent."""
        if self._calls:
            return
        if self._idle is not None and not self._idle.done():
            self._idle.set_result(None)
        if self.http2.going_away:
            self.loop.call_soon(self._close_once_sent)

    def _close_once_sent(self) -> None:
        if self.http2.has_pending_send():
            self._close_when_sent = True  # data_received closes it once window updates let the rest out
        else:
            self.close()

    def go_away(self) -> None:
        """GOAWAY: no new calls; those in flight finish, then the connection closes."""
        self.http2.go_away()
        self._flush()
        self._removed()

    async def idle(self) -> None:
        """Wait until no call is in flight (or the connection is gone)."""
        if not self._calls or self._transport is None or self._transport.is_closing():
            return
        if self._idle is None or self._idle.done():
            self._idle = self.loop.create_future()
        await asyncio.shield(self._idle)

    def cancel_calls(self) -> None:
        """Cancel the handlers still running (they answer UNAVAILABLE)."""
        for call in list(self._calls.values()):
            call.shut_down()

    def close(self) -> None:
        """Close the connection (calls still running are cancelled by `connection_lost`)."""
        if self._transport is not None and not self._transport.is_closing():
            self._flush()
            self._transport.close()
