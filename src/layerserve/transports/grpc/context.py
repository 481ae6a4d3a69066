"""CallContext: what the RPC handlers (our servicer, grpcio's health and reflection services) ask of a call's
context: the part of grpc.aio's ServicerContext they use. Every host of the servicer implements it: the gRPC door's
calls (calls.py) and the Ray Serve gRPC ingress (transports/ray/grpc_ingress.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn, Protocol

import grpc

Metadata = Sequence[tuple[str, str | bytes]]


class CallContext(Protocol):
    """One RPC as its handler sees it."""

    def invocation_metadata(self) -> Metadata | None:
        """The call's metadata: (key, value) pairs, values of `-bin` keys as bytes."""

    def time_remaining(self) -> float | None:
        """Seconds to the call's deadline, or None without one."""

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        """End the call with `code` and `details` (raises)."""

    async def write(self, message: Any) -> None:
        """Send one message of a streaming answer."""


def authorization(context: CallContext) -> bytes | None:
    """The call's `authorization` metadata value, or None."""
    return metadata_value(context, "authorization")


def metadata_value(context: CallContext, name: str) -> bytes | None:
    """The value of the call's metadata `name` (lower case), or None."""
    for key, value in context.invocation_metadata() or ():
        if key == name:
            return value if isinstance(value, bytes) else str(value).encode()
    return None
