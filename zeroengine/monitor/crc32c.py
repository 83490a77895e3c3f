"""CRC-32C (Castagnoli), the checksum TFRecord framing uses, in pure Python.

TensorBoard event files are TFRecord streams, and every record carries two
*masked* CRC-32C checksums. The stdlib's ``zlib.crc32`` is the other CRC-32
(IEEE polynomial), so this one is computed here: table-driven, one byte per
table lookup. Event records are a few hundred bytes once per optimizer step,
so speed does not matter; not depending on a C extension does.
"""
from __future__ import annotations

_POLY = 0x82F63B78  # Castagnoli polynomial 0x1EDC6F41, bit-reversed (the CRC is computed LSB first)
_MASK_DELTA = 0xA282EAD8


def _make_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ _POLY if crc & 1 else crc >> 1
        table.append(crc)
    return tuple(table)


_TABLE = _make_table()


def crc32c(data: bytes, crc: int = 0) -> int:
    """CRC-32C of ``data``; pass a previous result as ``crc`` to continue over more bytes."""
    crc ^= 0xFFFFFFFF
    table = _TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC: rotate right by 15 bits and add a constant.

    The mask exists so that a CRC stored inside data that is itself CRC'd does
    not degrade the outer checksum; readers must apply the same transform.
    """
    crc = crc32c(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF
