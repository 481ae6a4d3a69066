"""Call: one RPC on a gRPC door's connection: its handler's task, its request messages, its deadline, and the
CallContext its handler gets (metadata, deadline, abort, write, peer).

A streaming request's messages wait in a queue until its handler takes them: while many wait, the call holds its
connection's reading (backpressure); while its handler waits for the client's window (the client does not take the
answers) the call cannot hold reading (the window update is behind the client's bytes), so a client that keeps
sending meanwhile has the call refused. Compressed messages are inflated off the event loop, in order."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import Executor
from typing import Any, NoReturn, Protocol

import grpc

from layerserve.transports.grpc import wire
from layerserve.transports.grpc.context import Metadata
from layerserve.transports.grpc.http2 import GrpcHttp2
from layerserve.transports.grpc.wire import CallError

log = logging.getLogger(__name__)

_OK = grpc.StatusCode.OK
_END = object()  # ends a streaming request's messages
_MAX_PARKED_BYTES = 256 << 10  # a streaming answer waits while more than this waits for the client's window
# A streaming request's unconsumed messages: from HOLD_* on, its connection stops reading (until half are taken);
# from REFUSE_* on, while its handler waits for the client's window, the call is refused.
HOLD_MESSAGES, HOLD_BYTES = 32, 4 << 20
REFUSE_MESSAGES, REFUSE_BYTES = 128, 16 << 20
_IN_A_ROW = 8  # a streaming handler lets the loop turn after taking this many waiting messages
Message = bytes | asyncio.Future[bytes]  # a compressed one is a future of its inflated bytes


class Link(Protocol):
    """What a call asks of its connection."""

    http2: GrpcHttp2
    loop: asyncio.AbstractEventLoop
    peer: str
    inflater: Executor | None

    def hold(self, holder: object) -> None:
        """Stop reading until `release(holder)`."""

    def release(self, holder: object) -> None:
        """Read again, unless something else holds reading."""

    def refuse(self, call: Call) -> None:
        """Refuse the call (RST_STREAM ENHANCE_YOUR_CALM) and forget it."""

    def answered(self, call: Call) -> None:
        """A call has sent its status (or is gone): forget it; write now or with this loop turn's other answers."""

    def flush_soon(self) -> None:
        """Write what is held at the end of this loop turn."""

    async def window_opened(self) -> None:
        """Wait for the client's next window update (or the connection's end)."""

    async def drained(self) -> None:
        """Wait while the transport's write buffer is full."""


class Call:
    """One RPC (see the module)."""

    __slots__ = (
        "_awaiting_window", "_deadline", "_expired", "_handler", "_headers", "_holding", "_link", "_message",
        "_messages", "_metadata", "_queued_bytes", "_timer", "closed", "stream_id", "task",
    )  # fmt: skip

    def __init__(
        self, link: Link, stream_id: int, handler: Any, headers: list[tuple[bytes, bytes]], timeout_s: float | None
    ) -> None:
        self._link = link
        self.stream_id = stream_id
        self._handler = handler
        self._headers = headers
        self._message: Message | None = None
        self._messages: asyncio.Queue[tuple[int, Any]] | None = asyncio.Queue() if handler.request_streaming else None
        self._queued_bytes = 0  # of the messages in `_messages`
        self._holding = False  # holds the connection's reading
        self._awaiting_window = False
        self._metadata: Metadata | None = None
        self._deadline: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._expired = False
        self.closed = False  # answered, reset by the client, or the connection is gone: nothing more is sent
        self.task: asyncio.Task[None] | None = None
        if timeout_s is not None:
            self._deadline = link.loop.time() + timeout_s
            self._timer = link.loop.call_at(self._deadline, self._expire)
        if self._messages is not None:  # a streaming request's handler starts now, a unary one's with its message
            self.task = link.loop.create_task(self._run(None), name="grpc")

    # What the connection tells the call.

    def received(self, message: Message, size: int = 0) -> None:
        """One request message (`size`: its bytes as sent, for a compressed one).

        Raises:
            CallError: a second message of a unary request.
        """
        messages = self._messages
        if messages is not None:
            size = size or len(message)  # type: ignore[arg-type]  # bytes when no size is given
            messages.put_nowait((size, message))
            self._queued_bytes += size
            if messages.qsize() >= HOLD_MESSAGES or self._queued_bytes >= HOLD_BYTES:
                self._backlogged(messages.qsize())
        elif self._message is None:
            self._message = message
        else:
            raise CallError(grpc.StatusCode.INTERNAL, "a unary call's request must be exactly one message")

    def received_compressed(self, message: bytes, encoding: bytes | None) -> None:
        """One compressed request message: inflated in the link's inflater, taken by the handler in order.

        Raises:
            CallError: a second message of a unary request.
        """
        link = self._link
        limit = link.http2.max_message_bytes
        inflated = link.loop.run_in_executor(link.inflater, wire.decompress, message, encoding, limit)
        inflated.add_done_callback(_retrieve)
        self.received(inflated, len(message) or 1)

    def _backlogged(self, waiting: int) -> None:
        """Many messages wait: hold the connection's reading, or refuse the call if its client takes no answers."""
        if not self._awaiting_window:
            if not self._holding:
                self._holding = True
                self._link.hold(self)
        elif waiting >= REFUSE_MESSAGES or self._queued_bytes >= REFUSE_BYTES:
            self._link.refuse(self)  # which cancels the call

    def _taken(self, size: int) -> None:
        """The handler took a message: release the connection's reading once half of the backlog is gone."""
        self._queued_bytes -= size
        if (
            self._holding and self._messages is not None
            and self._messages.qsize() < HOLD_MESSAGES // 2 and self._queued_bytes < HOLD_BYTES // 2
        ):  # fmt: skip
            self._holding = False
            self._link.release(self)

    def ended(self) -> None:
        """The request is complete: a unary handler starts, a streaming one's messages end.

        Raises:
            CallError: a unary request without its message.
        """
        if self._messages is not None:
            self._messages.put_nowait((0, _END))
            return
        if self._message is None:
            raise CallError(grpc.StatusCode.INTERNAL, "a unary call's request must be exactly one message")
        self.task = self._link.loop.create_task(self._run(self._message), name="grpc")
        self._message = None

    def cancel(self) -> None:
        """The client reset the call or the connection is gone: nothing is sent; the handler is cancelled."""
        self.closed = True
        self._stop_timer()
        if self.task is not None:
            self.task.cancel()

    def shut_down(self) -> None:
        """The door stops and cannot wait longer: the handler is cancelled, the call answered UNAVAILABLE."""
        if self.task is not None and not self.closed:
            self.task.cancel()

    def _expire(self) -> None:
        self._timer = None
        if self.closed:
            return
        if self.task is None:  # still receiving its request
            self.finish(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        else:
            self._expired = True
            self.task.cancel()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # Running the handler.

    async def _run(self, message: Message | None) -> None:
        code, details = _OK, ""
        try:
            await self._invoke(message)
        except CallError as error:
            code, details = error.code, error.details
        except asyncio.CancelledError:
            if not self._expired:
                if not self.closed:  # cancelled by the door's shutdown
                    self.finish(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
                return
            code, details = grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
        except Exception:  # the handlers of grpcio's services; ours answer their errors as statuses
            log.exception("unexpected error in gRPC handler of stream %d", self.stream_id)
            code, details = grpc.StatusCode.UNKNOWN, "Unexpected error in the RPC handler"
        self.finish(code, details)

    async def _invoke(self, message: Message | None) -> None:
        handler = self._handler
        if message is not None and not isinstance(message, bytes):
            message = await message  # inflated
        request: Any = self._requests() if message is None else self._parse(message)
        if handler.response_streaming:
            method = handler.stream_stream if handler.request_streaming else handler.unary_stream
            answers = method(request, self)
            if hasattr(answers, "__aiter__"):
                async for answer in answers:
                    await self.write(answer)
            else:
                await answers
        else:
            method = handler.stream_unary if handler.request_streaming else handler.unary_unary
            self._send(await method(request, self))

    def _parse(self, message: bytes) -> Any:
        deserializer = self._handler.request_deserializer
        if deserializer is None:  # a handler of bytes
            return message
        try:
            return deserializer(message)
        except Exception as error:
            raise CallError(grpc.StatusCode.INVALID_ARGUMENT, f"the request message does not parse: {error}") from None

    async def _requests(self) -> AsyncIterator[Any]:
        messages = self._messages
        assert messages is not None
        in_a_row = 0  # messages taken without waiting: a backlog of tiny ones must not hold the loop
        while True:
            if messages.empty():
                in_a_row = 0
            elif (in_a_row := in_a_row + 1) == _IN_A_ROW:
                in_a_row = 0
                await asyncio.sleep(0)
            size, message = await messages.get()
            if message is _END:
                return
            self._taken(size)
            if not isinstance(message, bytes):
                message = await message  # inflated
            yield self._parse(message)

    def _send(self, answer: Any) -> None:
        serializer = self._handler.response_serializer
        payload = answer if serializer is None else serializer(answer)
        if self.closed:
            return
        self._link.http2.send_message(self.stream_id, payload)
        if self._handler.response_streaming:  # a unary answer leaves with its status (finish)
            self._link.flush_soon()

    def finish(self, code: grpc.StatusCode, details: str) -> None:
        """Send the status and forget the call."""
        if self.closed:
            return
        self.closed = True
        self._stop_timer()
        self._link.http2.end_call(self.stream_id, code, details)
        self._link.answered(self)

    # grpc.aio's ServicerContext, as far as handlers use it (CallContext).

    def invocation_metadata(self) -> Metadata:
        """The call's metadata: (key, value) pairs, values of `-bin` keys as bytes."""
        if self._metadata is None:
            self._metadata = wire.metadata(self._headers)
        return self._metadata

    def time_remaining(self) -> float | None:
        """Seconds to the call's deadline, or None without one."""
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - self._link.loop.time())

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Iterable[Any] = ()) -> NoReturn:
        """End the call with `code` and `details`."""
        raise CallError(code, details)

    async def write(self, message: Any) -> None:
        """Send one message of a streaming answer; wait while the client is slow to take the earlier ones."""
        self._send(message)
        link = self._link
        if not self.closed and link.http2.pending_bytes(self.stream_id) > _MAX_PARKED_BYTES:
            self._awaiting_window = True  # reading must go on, for the client's window update
            if self._holding:
                self._holding = False
                link.release(self)
            try:
                while not self.closed and link.http2.pending_bytes(self.stream_id) > _MAX_PARKED_BYTES:
                    await link.window_opened()
            finally:
                self._awaiting_window = False
        await link.drained()

    def peer(self) -> str:
        """The client's address, as grpc writes it."""
        return self._link.peer

    def cancelled(self) -> bool:
        """Whether the client went away before the answer."""
        return self.closed and self.task is not None and self.task.cancelled()

    def done(self) -> bool:
        """Whether the call has ended."""
        return self.closed


def _retrieve(inflated: asyncio.Future[bytes]) -> None:
    """Mark an inflation's error as seen: the call it was for may be gone (its handler then never awaits it)."""
    if not inflated.cancelled():
        inflated.exception()
