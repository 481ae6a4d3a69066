"""Call: one RPC on a gRPC door's connection: its handler's task, its request messages, its deadline, and the
CallContext its handler gets (metadata, deadline, abort, write, peer)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any, NoReturn, Protocol

import grpc

from layerserve.transports.grpc import wire
from layerserve.transports.grpc.context import Metadata
from layerserve.transports.grpc.http2 import GrpcHttp2
from layerserve.transports.grpc.wire import CallError

log = logging.getLogger(__name__)

_OK = grpc.StatusCode.OK
_END = object()  # ends a streaming request's messages
_MAX_PARKED_BYTES = 1 << 20  # a streaming answer waits while more than this waits for the client's window


class Link(Protocol):
    """What a call asks of its connection."""

    http2: GrpcHttp2
    loop: asyncio.AbstractEventLoop
    peer: str

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
        "_deadline", "_expired", "_handler", "_headers", "_link", "_message", "_messages", "_metadata", "_timer",
        "closed", "stream_id", "task",
    )  # fmt: skip

    def __init__(
        self, link: Link, stream_id: int, handler: Any, headers: list[tuple[bytes, bytes]], timeout_s: float | None
    ) -> None:
        self._link = link
        self.stream_id = stream_id
        self._handler = handler
        self._headers = headers
        self._message: bytes | None = None
        self._messages: asyncio.Queue[Any] | None = asyncio.Queue() if handler.request_streaming else None
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

    def received(self, message: bytes) -> None:
        """One request message.

        Raises:
            CallError: a second message of a unary request.
        """
        if self._messages is not None:
            self._messages.put_nowait(message)
        elif self._message is None:
            self._message = message
        else:
            raise CallError(grpc.StatusCode.INTERNAL, "a unary call's request must be exactly one message")

    def ended(self) -> None:
        """The request is complete: a unary handler starts, a streaming one's messages end.

        Raises:
            CallError: a unary request without its message.
        """
        if self._messages is not None:
            self._messages.put_nowait(_END)
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

    async def _run(self, message: bytes | None) -> None:
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

    async def _invoke(self, message: bytes | None) -> None:
        handler = self._handler
        request: Any = self._requests() if message is None else self._parse(message)
        if handler.response_streaming:
            method = handler.stream_stream if handler.request_streaming else handler.unary_stream
            answers = method(request, self)
            if hasattr(answers, "__aiter__"):
                async for answer in answers:
                    self._send(answer)
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
        assert self._messages is not None
        while (message := await self._messages.get()) is not _END:
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
        while not self.closed and link.http2.pending_bytes(self.stream_id) > _MAX_PARKED_BYTES:
            await link.window_opened()
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
