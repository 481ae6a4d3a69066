"""TFRecord files read without TensorFlow: checked against files TensorFlow writes and reads itself."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from layerserve.errors import BadRequestError
from layerserve.protocols.tfrecord import crc32c, masked_crc32c, read_records

RECORDS = [b"first", b"", bytes(range(256)) * 300 + b"tail", b"last"]  # the third one's CRC is computed in lanes


def tf_masked_crc32c(data: bytes, path: Path) -> int:
    """TensorFlow's own masked CRC-32C of `data`: the last 4 bytes of the record it writes of it."""
    with tf.io.TFRecordWriter(str(path)) as writer:
        writer.write(data)
    return int.from_bytes(path.read_bytes()[-4:], "little")


def _written(path: Path) -> bytes:
    with tf.io.TFRecordWriter(str(path)) as writer:
        for record in RECORDS:
            writer.write(record)
    return path.read_bytes()


def test_crc32c_of_the_standard_check_string() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value (RFC 3720)
    assert crc32c(b"") == 0


def test_crc32c_in_lanes_equals_tensorflows_on_either_side_of_the_threshold(tmp_path: Path) -> None:
    data = np.random.default_rng(0).integers(0, 256, 300_007, dtype=np.uint8).tobytes()
    for size in (1, 65_535, 65_536, 65_537, 300_007):  # below 64 KiB a byte at a time, from there in 1 KiB lanes
        assert masked_crc32c(data[:size]) == tf_masked_crc32c(data[:size], tmp_path / "one"), size


def test_records_equal_what_tensorflow_reads(tmp_path: Path) -> None:
    data = _written(tmp_path / "records")
    theirs = [record.numpy() for record in tf.data.TFRecordDataset(str(tmp_path / "records"))]
    assert list(read_records(data)) == theirs == RECORDS


def test_a_corrupt_data_byte_names_its_record_and_tensorflow_refuses_it_too(tmp_path: Path) -> None:
    data = bytearray(_written(tmp_path / "records"))
    record_2_data = (12 + len(RECORDS[0]) + 4) + (12 + 0 + 4) + 12  # each record: 12 bytes, its data, 4 bytes
    data[record_2_data] ^= 0x01
    (tmp_path / "corrupt").write_bytes(bytes(data))
    with pytest.raises(BadRequestError, match=r"record 2: the CRC of its data does not match"):
        list(read_records(bytes(data)))
    with pytest.raises(tf.errors.DataLossError):
        list(tf.data.TFRecordDataset(str(tmp_path / "corrupt")))


def test_a_corrupt_length_and_a_truncated_file_are_refused(tmp_path: Path) -> None:
    data = _written(tmp_path / "records")
    with pytest.raises(BadRequestError, match=r"record 0: the CRC of its length does not match"):
        list(read_records(b"\x07" + data[1:]))
    with pytest.raises(BadRequestError, match=r"record 3: truncated data"):
        list(read_records(data[:-2]))
    with pytest.raises(BadRequestError, match=r"record 0: truncated header"):
        list(read_records(b"abc"))
