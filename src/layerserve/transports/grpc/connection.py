"""GrpcConnection: the IO of one client's connection to the gRPC door: the bytes it reads go to its GrpcHttp2 core
(http2.py), whose events start, feed and cancel calls (calls.py); what the core holds is written once per loop
turn, so that the answers one batch finishes on one connection share a write (an answer leaves at once when its
call was the connection's last in flight).

Against hostile clients: the core gets at most READ_SLICE_BYTES per loop turn (one connection's frames cannot hold
the loop); reading stops while the client does not read (the transport's buffer is full) and while a call holds it
(its request messages wait unconsumed: zttp returns flow-control credit as it reads, so not reading is how credit is
withheld); a connection without its preface in time, or without a call for `idle_timeout_s`, is closed."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from concurrent.futures import Executor
from typing import Any

import grpc

from layerserve.transports.grpc.calls import Call
from layerserve.transports.grpc.http2 import (
    CallClosed,
    CallStarted,
    CompressedMessageReceived,
    ConnectionEnded,
    GrpcHttp2,
    MessageReceived,
    RequestEnded,
    WindowOpened,
)
from layerserve.transports.grpc.wire import CallError

log = logging.getLogger(__name__)

READ_SLICE_BYTES = 16_384  # what the core parses per loop turn: a run of 1-byte DATA frames costs ~2 ms of it
PREFACE_TIMEOUT_S = 10.0  # a connection says it speaks HTTP/2 within this (or within its idle timeout if shorter)
_WRITING = "writing"  # holds reading while the transport's buffer is full


class GrpcConnection(asyncio.Protocol):
    """One client connection: its calls by stream, the handlers by path (see the module)."""

    def __init__(
        self, handlers: dict[bytes, Any], max_message_bytes: int, connections: set[GrpcConnection],
        loop: asyncio.AbstractEventLoop | None = None, idle_timeout_s: float = 300.0, inflater: Executor | None = None,
    ) -> None:  # fmt: skip
        self.loop = loop or asyncio.get_running_loop()
        self.http2 = GrpcHttp2(max_message_bytes)
        self.inflater = inflater  # where compressed messages are inflated (None: the loop's default executor)
        self.peer = ""
        self._idle_timeout_s = idle_timeout_s
        self._timer: asyncio.TimerHandle | None = None
        self._started_calls = 0
        self._started_seen = 0  # `_started_calls` when the idle timer last looked
        self._holders: set[object] = set()  # what holds reading: _WRITING, calls whose messages wait
        self._reading = True
        self._unread: deque[bytes] = deque()  # read from the socket, not yet given to the core (no copies)
        self._unread_at = 0  # how much of the first is given
        self._read_handle: asyncio.Handle | None = None
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
        self._timer = self.loop.call_later(min(PREFACE_TIMEOUT_S, self._idle_timeout_s), self._check_preface)

    def connection_lost(self, exc: Exception | None) -> None:
        """Cancel the calls still running."""
        self._connections.discard(self)
        for handle in (self._timer, self._read_handle):
            if handle is not None:
                handle.cancel()
        self._unread.clear()
        for call in list(self._calls.values()):
            call.cancel()
        self._calls.clear()
        for waiter in (self._writable, self._window, self._idle):
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def data_received(self, data: bytes) -> None:
        """Feed the core (a slice per loop turn, none while reading is held); act on its events; write what it
        holds at once (acknowledgements, refusals)."""
        if len(data) > READ_SLICE_BYTES or self._unread or self._holders:
            self._unread.append(data)
            self._update_reading()
            return
        self._feed(data)

    def _read_on(self) -> None:
        """Feed the core the next slice of what was read; the rest waits for the next loop turn."""
        self._read_handle = None
        if self._holders or self._transport is None or self._transport.is_closing():
            return
        first, at = self._unread[0], self._unread_at
        data, self._unread_at = first[at : at + READ_SLICE_BYTES], at + READ_SLICE_BYTES
        if self._unread_at >= len(first):
            self._unread.popleft()
            self._unread_at = 0
        self._feed(data)
        self._update_reading()

    def _update_reading(self) -> None:
        """Read from the socket unless held or while what was read waits; feed what waits, a slice a turn."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        reading = not self._holders and not self._unread
        if reading != self._reading:
            self._reading = reading
            transport.resume_reading() if reading else transport.pause_reading()
        if self._unread and not self._holders and self._read_handle is None:
            self._read_handle = self.loop.call_soon(self._read_on)

    def hold(self, holder: object) -> None:
        """Stop reading until `release(holder)`."""
        if holder not in self._holders:
            self._holders.add(holder)
            self._update_reading()

    def release(self, holder: object) -> None:
        """Read again, unless something else holds reading."""
        if holder in self._holders:
            self._holders.discard(holder)
            self._update_reading()

    def _feed(self, data: bytes) -> None:
        for event in self.http2.receive_data(data):
            kind = type(event)
            if kind is MessageReceived:
                self._step(event.stream_id, Call.received, event.message)  # type: ignore[union-attr]
            elif kind is CompressedMessageReceived:
                self._step(event.stream_id, Call.received_compressed, event.message, event.encoding)  # type: ignore[union-attr]
            elif kind is CallStarted:
                self._start(event)  # type: ignore[arg-type]
            elif kind is RequestEnded:
                self._step(event.stream_id, Call.ended)  # type: ignore[union-attr]
            elif kind is CallClosed:
                self._closed(event.stream_id)  # type: ignore[union-attr]
            elif kind is WindowOpened:
                if self._window is not None and not self._window.done():
                    self._window.set_result(None)
                self._window = None
            elif kind is ConnectionEnded:
                log.debug("gRPC connection from %s closed: %s", self.peer, event.reason)  # type: ignore[union-attr]
                self._flush()
                if event.abort and self._transport is not None:  # type: ignore[union-attr]
                    self._transport.abort()
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
        self._started_calls += 1
        self._calls[event.stream_id] = Call(self, event.stream_id, handler, event.headers, event.timeout_s)

    def _closed(self, stream_id: int) -> None:
        call = self._calls.pop(stream_id, None)
        if call is not None:
            call.cancel()
            self.release(call)
            self._removed()

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
        if self._holders:
            self.release(call)
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

    def refuse(self, call: Call) -> None:
        """Refuse a call whose client sends faster than it takes the answers (RST_STREAM ENHANCE_YOUR_CALM)."""
        log.debug("gRPC call on stream %d from %s refused: its client does not take its answers", call.stream_id,
                 self.peer)  # fmt: skip
        self.http2.refuse_call(call.stream_id)
        self._closed(call.stream_id)
        self.flush_soon()

    def pause_writing(self) -> None:
        """The transport's buffer is full: streaming writers wait, reading stops."""
        if self._writable is None:
            self._writable = self.loop.create_future()
        self.hold(_WRITING)

    def resume_writing(self) -> None:
        """The transport's buffer drained."""
        if self._writable is not None:
            self._writable.set_result(None)
            self._writable = None
        self.release(_WRITING)

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

    def _check_preface(self) -> None:
        """Close a connection that has not said it speaks HTTP/2; watch the others for idleness."""
        if not self.http2.preface_received:
            self._timer = None
            log.debug("gRPC connection from %s closed: no HTTP/2 preface", self.peer)
            self.close()
            return
        waited = min(PREFACE_TIMEOUT_S, self._idle_timeout_s)
        self._timer = self.loop.call_later(self._idle_timeout_s - waited, self._check_idle)

    def _check_idle(self) -> None:
        """GOAWAY to a connection without a call since the timer's last look (within two timeouts of its last)."""
        self._timer = None
        if self._calls or self._started_calls != self._started_seen:
            self._started_seen = self._started_calls
            self._timer = self.loop.call_later(self._idle_timeout_s, self._check_idle)
            return
        log.debug("gRPC connection from %s closed: idle", self.peer)
        self.go_away()

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
        """Close the connection (calls still running are cancelled by `connection_lost`); one whose client does not
        read what is held for it is aborted."""
        if self._transport is not None and not self._transport.is_closing():
            self._flush()
            if self._writable is None:
                self._transport.close()
            else:
                self._transport.abort()
