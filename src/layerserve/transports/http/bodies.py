"""Reading request bodies within the size limit, and writing JSON answers."""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncGenerator
from typing import Any

import orjson
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.responses import Response

from layerserve.errors import BadRequestError, ClientClosedError, PayloadTooLargeError, UnsupportedMediaTypeError
from layerserve.features.images import IMAGE_MEDIA_TYPES
from layerserve.protocols.v2 import load_json_object
from layerserve.transports.http.cycle import header_value
from layerserve.transports.http.services import services
from layerserve.transports.policy import Refusal

_MAX_FORM_FILES = 256
NPY_MEDIA_TYPE = "application/x-npy"


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused as soon as it grows past `limit` bytes; a `Content-Encoding: gzip` or `deflate`
    body is decompressed, and refused as soon as its decompressed size grows past `limit`.

    Raises:
        PayloadTooLargeError: the body (or its announced length, or its decompressed size) exceeds the limit.
        BadRequestError: the Content-Length header is not an integer, or the compressed data is corrupt.
        UnsupportedMediaTypeError: another Content-Encoding.
        ClientClosedError: the client went away before the whole body came.
    """
    # The scope's own header list (header_value), not Starlette's Headers (built per request, a few microseconds).
    length, coding = header_value(request.scope, b"content-length"), header_value(request.scope, b"content-encoding")
    announced = None if length is None else length.decode("latin-1")
    encoding = "identity" if coding is None else coding.decode("latin-1").strip().lower()
    if encoding not in _WBITS and encoding != "identity":
        raise UnsupportedMediaTypeError(
            f"Content-Encoding {encoding!r} is not supported; expected gzip, deflate or identity"
        )
    raw = await _read_raw(request, announced, limit)
    if encoding not in _WBITS or not raw:
        return raw
    inflation = _Inflation(raw, _WBITS[encoding], encoding, limit)
    if not inflation.run(_INLINE_BYTES):
        # Off the event loop (zlib releases the GIL): a small bomb inflates to the limit in hundreds of milliseconds.
        await asyncio.get_running_loop().run_in_executor(services(request).inflater, inflation.run, limit + 1)
    parts = inflation.parts
    return parts[0] if len(parts) == 1 else b"".join(parts)


_INLINE_BYTES = 256 * 1024  # decompressed on the event loop up to this (about 0.1 ms); the rest in a thread
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


class _Inflation:
    """A compressed body being decompressed, never past `limit` bytes: what is left of it and what came out."""

    def __init__(self, data: bytes, wbits: int, encoding: str, limit: int) -> None:
        self.data, self.wbits, self.encoding, self.limit = data, wbits, encoding, limit
        self.parts: list[bytes] = []
        self.size = 0
        self.inflater: Any = None  # zlib's decompressor object of the member being read

    def run(self, budget: int) -> bool:
        """Decompress until the body ends (True) or `budget` more bytes came out (False).

        Raises:
            PayloadTooLargeError: it decompresses past the limit.
            BadRequestError: corrupt or truncated data.
        """
        stop = self.size + budget
        while self.size < stop:
            if self.inflater is None:
                if not self.data:
                    return True
                self.inflater = zlib.decompressobj(self.wbits)  # gzip bodies may hold several members
            inflater, wanted = self.inflater, min(self.limit + 1, stop) - self.size
            try:
                part = inflater.decompress(self.data, wanted)
            except zlib.error as error:
                raise BadRequestError(f"the body is not valid {self.encoding} data: {error}") from None
            self.size += len(part)
            if self.size > self.limit:
                raise PayloadTooLargeError(f"decompressed body is over the limit of {self.limit} bytes")
            if part:
                self.parts.append(part)
            self.data = inflater.unconsumed_tail
            if inflater.eof:
                self.data, self.inflater = inflater.unused_data, None
            elif not self.data and len(part) < wanted:
                raise BadRequestError(f"the {self.encoding} body is truncated")
        return False


async def _read_raw(request: Request, announced: str | None, limit: int) -> bytes:
    if announced is not None:
        if not (announced.isascii() and announced.isdigit()):
            raise BadRequestError(f"Content-Length must be an integer, got {announced!r}")
        if int(announced) > limit:
            raise PayloadTooLargeError(f"body of {announced} bytes is over the limit of {limit} bytes")
    # The ASGI messages themselves: Starlette's request.stream() is an async generator, a few microseconds a body.
    chunks, size = [], 0
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientClosedError("the client went away before the whole body came")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(f"body is over the limit of {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def npy_bytes(array: Any) -> bytes:
    """An array in the `.npy` format (dtype and shape kept, never pickled)."""
    import io

    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def wants_npy(request: Request) -> bool:
    """Whether the client asked for `.npy` (Accept: application/x-npy)."""
    return NPY_MEDIA_TYPE in request.headers.get("accept", "")


class JSONResponse(Response):
    """A JSON answer encoded by orjson (numpy arrays allowed, text never ASCII-escaped)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        """Encode the content."""
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


async def read_images(request: Request, limit: int) -> list[bytes]:
    """Encoded images from a raw image body or from the `image` fields of a multipart form.

    Raises:
        UnsupportedMediaTypeError: another content type, or a form without `image` files.
        PayloadTooLargeError: the body exceeds the limit.
    """
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    body = await read_body(request, limit)
    if media_type in IMAGE_MEDIA_TYPES:
        return [body]
    if media_type == "multipart/form-data":
        return await _form_images(request, body)
    expected = ", ".join(IMAGE_MEDIA_TYPES)
    raise UnsupportedMediaTypeError(f"expected an image body ({expected}) or multipart/form-data, got {media_type!r}")


async def parse_form(request: Request, body: bytes) -> FormData:
    """A multipart form from a body already read (within its limit); the caller closes it.

    Raises:
        BadRequestError: a malformed form.
    """

    async def stream() -> AsyncGenerator[bytes, None]:
        yield body

    try:
        return await MultiPartParser(request.headers, stream(), max_files=_MAX_FORM_FILES).parse()
    except MultiPartException as error:
        raise BadRequestError(f"malformed multipart body: {error.message}") from None


async def _form_images(request: Request, body: bytes) -> list[bytes]:
    form = await parse_form(request, body)
    files = [item for item in form.getlist("image") if isinstance(item, UploadFile)]
    if not files:
        raise UnsupportedMediaTypeError("the multipart form has no 'image' file field")
    images = [await item.read() for item in files]
    await form.close()
    return images


_MAX_TEXTS = 10_000


async def read_texts(request: Request, limit: int) -> list[str]:
    """The `texts` of a JSON body `{"texts": ["...", ...]}`.

    Raises:
        BadRequestError: not that shape.
        PayloadTooLargeError: the body exceeds the limit.
    """
    body = load_json_object(await read_body(request, limit), "the request body")
    texts = body.get("texts")
    if (
        not isinstance(texts, list)
        or not texts
        or len(texts) > _MAX_TEXTS
        or not all(isinstance(t, str) for t in texts)
    ):
        raise BadRequestError(f'expected a JSON body {{"texts": ["...", ...]}} with 1 to {_MAX_TEXTS} strings')
    return texts


def refusal_answer(refusal: Refusal) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """The headers and body of a refused request: `{"error": message}`, with the Bearer challenge for a 401 and
    Retry-After for a 503."""
    body = orjson.dumps({"error": refusal.message})
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    if refusal.status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="layerserve"'))
    elif refusal.status == 503:
        headers.append((b"retry-after", b"1"))
    return headers, body
