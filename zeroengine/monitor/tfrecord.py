"""TFRecord framing: the container format of TensorBoard event files.

Each record is ``uint64 length | uint32 masked_crc32c(length bytes) | payload |
uint32 masked_crc32c(payload)``, all little-endian. The reader checks both
checksums, so a test that reads back what the writer wrote proves the framing,
not just the payloads.
"""
from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import BinaryIO

from .crc32c import masked_crc32c


class RecordCorruptError(ValueError):
    """A record's length or payload does not match its checksum (or the file ends mid-record)."""


def encode_record(payload: bytes) -> bytes:
    header = struct.pack("<Q", len(payload))
    return (header + struct.pack("<I", masked_crc32c(header)) + payload
            + struct.pack("<I", masked_crc32c(payload)))


def write_record(stream: BinaryIO, payload: bytes) -> None:
    stream.write(encode_record(payload))


def read_records(stream: BinaryIO) -> Iterator[bytes]:
    """Yield each record's payload; raise RecordCorruptError on a bad checksum or a truncated record."""
    while True:
        header = stream.read(8)
        if not header:
            return
        if len(header) < 8:
            raise RecordCorruptError("truncated record header")
        (length,) = struct.unpack("<Q", header)
        crc_bytes = stream.read(4)
        if len(crc_bytes) < 4 or struct.unpack("<I", crc_bytes)[0] != masked_crc32c(header):
            raise RecordCorruptError("record length checksum mismatch")
        payload = stream.read(length)
        crc_bytes = stream.read(4)
        if len(payload) < length or len(crc_bytes) < 4:
            raise RecordCorruptError("truncated record")
        if struct.unpack("<I", crc_bytes)[0] != masked_crc32c(payload):
            raise RecordCorruptError("record payload checksum mismatch")
        yield payload
