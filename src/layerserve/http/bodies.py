"""Reading request bodies within the size limit, and writing JSON answers."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import orjson
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.responses import Response

from layerserve.errors import BadRequestError, PayloadTooLargeError, UnsupportedMediaTypeError
from layerserve.images import IMAGE_MEDIA_TYPES
from layerserve.protocols.v2 import load_json_object

_MAX_FORM_FILES = 256
NPY_MEDIA_TYPE = "application/x-npy"


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused as soon as it grows past `limit` bytes.

    Raises:
        PayloadTooLargeError: the body (or its announced length) exceeds the limit.
        BadRequestError: the Content-Length header is not an integer.
    """
    announced = request.headers.get("content-length")
    if announced is not None:
        if not (announced.isascii() and announced.isdigit()):
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
