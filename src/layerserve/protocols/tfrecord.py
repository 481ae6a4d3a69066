"""TFRecord files read as TensorFlow writes them, without TensorFlow: each record is its length (u64, little-endian),
the masked CRC-32C of those 8 bytes, its data, and the masked CRC-32C of the data; both CRCs are checked."""

from __future__ import annotations

import struct
from collections.abc import Iterator

from layerserve.errors import BadRequestError

_POLYNOMIAL = 0x82F63B78  # CRC-32C (Castagnoli), reflected
_MASK_DELTA = 0xA282EAD8
_HEADER = struct.Struct("<QI")
_FOOTER = struct.Struct("<I")


def _table() -> tuple[int, ...]:
    entries = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ _POLYNOMIAL if crc & 1 else crc >> 1
        entries.append(crc)
    return tuple(entries)


_TABLE = _table()


def crc32c(data: bytes | memoryview) -> int:
    """The CRC-32C of `data` (a table, a byte at a time: warm-up files are small)."""
    crc, table = 0xFFFFFFFF, _TABLE
    for byte in bytes(data):
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes | memoryview) -> int:
    """TFRecord's masked CRC-32C: rotated right by 15 bits, plus a constant (so that a CRC of CRCs stays useful)."""
    crc = crc32c(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF


def read_records(data: bytes) -> Iterator[bytes]:
    """Each record of a TFRecord file's bytes (uncompressed, as TF Serving reads its warm-up file), in order.

    Raises:
        BadRequestError: a truncated record or a CRC that does not match, naming the record (counted from 0).
    """
    view, offset, index = memoryview(data), 0, 0
    while offset < len(view):
        if offset + _HEADER.size > len(view):
            raise BadRequestError(f"record {index}: truncated header ({len(view) - offset} of {_HEADER.size} bytes)")
        length, length_crc = _HEADER.unpack_from(view, offset)
        if masked_crc32c(view[offset : offset + 8]) != length_crc:
            raise BadRequestError(f"record {index}: the CRC of its length does not match (not a TFRecord file?)")
        start = offset + _HEADER.size
        end = start + length
        if end + _FOOTER.size > len(view):
            raise BadRequestError(f"record {index}: truncated data ({length} bytes announced)")
        (data_crc,) = _FOOTER.unpack_from(view, end)
        if masked_crc32c(view[start:end]) != data_crc:
            raise BadRequestError(f"record {index}: the CRC of its data does not match (corrupt)")
        yield bytes(view[start:end])
        offset, index = end + _FOOTER.size, index + 1
