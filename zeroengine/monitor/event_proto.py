"""The few protobuf messages of a TensorBoard event file, encoded and decoded by hand.

Only what a scalar log needs (field numbers from TensorFlow's event.proto and
summary.proto)::

    message Event   { double wall_time = 1; int64 step = 2;
                      oneof what { string file_version = 3; Summary summary = 5; } }
    message Summary { repeated Value value = 1; }
    message Value   { string tag = 1; float simple_value = 2; }

Protobuf's wire format for these is small: a key varint ``field << 3 | type``,
then a varint (type 0), 8 little-endian bytes (type 1), a length-prefixed
byte string or sub-message (type 2), or 4 little-endian bytes (type 5). The
decoder skips fields it does not know, as protobuf readers must, so it reads
files written by TensorFlow's own writer too.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

_VARINT, _FIXED64, _BYTES, _FIXED32 = 0, 1, 2, 5
FILE_VERSION = "brain.Event:2"


@dataclass
class Event:
    wall_time: float
    step: int = 0
    file_version: str | None = None
    scalars: dict[str, float] = field(default_factory=dict)  # Summary.value as tag -> simple_value


# -- encoding -----------------------------------------------------------------
def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int64 values go on the wire as their 64-bit two's complement
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _key(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def _length_delimited(number: int, data: bytes) -> bytes:
    return _key(number, _BYTES) + _varint(len(data)) + data


def encode_event(event: Event) -> bytes:
    out = _key(1, _FIXED64) + struct.pack("<d", event.wall_time)
    if event.step:
        out += _key(2, _VARINT) + _varint(event.step)
    if event.file_version is not None:
        out += _length_delimited(3, event.file_version.encode())
    if event.scalars:
        summary = b"".join(
            _length_delimited(1, _length_delimited(1, tag.encode()) + _key(2, _FIXED32) + struct.pack("<f", value))
            for tag, value in event.scalars.items())
        out += _length_delimited(5, summary)
    return out


# -- decoding -----------------------------------------------------------------
def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _fields(data: bytes):
    """Yield (field number, wire type, raw value) for each field of one message."""
    pos = 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            value, pos = _read_varint(data, pos)
        elif wire_type == _FIXED64:
            value, pos = data[pos:pos + 8], pos + 8
        elif wire_type == _FIXED32:
            value, pos = data[pos:pos + 4], pos + 4
        elif wire_type == _BYTES:
            length, pos = _read_varint(data, pos)
            value, pos = data[pos:pos + length], pos + length
        else:
            raise ValueError(f"unsupported protobuf wire type {wire_type}")
        if pos > len(data):
            raise ValueError("truncated protobuf field")
        yield number, wire_type, value


def _decode_value(data: bytes) -> tuple[str, float | None]:
    tag, value = "", None
    for number, wire_type, raw in _fields(data):
        if number == 1 and wire_type == _BYTES:
            tag = raw.decode()
        elif number == 2 and wire_type == _FIXED32:
            value = struct.unpack("<f", raw)[0]
    return tag, value


def decode_event(data: bytes) -> Event:
    event = Event(wall_time=0.0)
    for number, wire_type, raw in _fields(data):
        if number == 1 and wire_type == _FIXED64:
            event.wall_time = struct.unpack("<d", raw)[0]
        elif number == 2 and wire_type == _VARINT:
            event.step = raw - (1 << 64) if raw >= 1 << 63 else raw
        elif number == 3 and wire_type == _BYTES:
            event.file_version = raw.decode()
        elif number == 5 and wire_type == _BYTES:
            for sub_number, sub_type, value in _fields(raw):
                if sub_number == 1 and sub_type == _BYTES:
                    tag, scalar = _decode_value(value)
                    if scalar is not None:  # tensor / image summaries are not scalars: skipped
                        event.scalars[tag] = scalar
    return event
