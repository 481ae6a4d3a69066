"""Reading request bodies within the size limit, and writing JSON answers."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from layerserve.errors import BadRequestError, PayloadTooLargeError


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused as soon as it grows past `limit` bytes.

    Raises:
        PayloadTooLargeError: the body (or its announced length) exceeds the limit.
        BadRequestError: the Content-Length header is not an integer.
    """
    announced = request.headers.get("content-length")
    if announced is not None:
        if not announced.isdigit():
            raise BadRequestError(f"Content-Length must be an integer, got {announced!r}")
        if int(announced) > limit:
            raise PayloadTooLargeError(f"body of {announced} bytes is over the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(f"body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


class JSONResponse(Response):
    """A JSON answer encoded by orjson (numpy arrays allowed, text never ASCII-escaped)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        """Encode the content."""
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)
