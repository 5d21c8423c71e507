"""The record framing of TensorBoard event files: ``length, CRC(length), data, CRC(data)``.

One masked CRC-32C (``google-crc32c``, in C) for the writer (:func:`frame`) and the reader. The reader exists because
TensorBoard's own stops silently at the first bad record, so a file damaged in the middle would
read as a shorter run; here damage is an error, while a record cut short by the end of the file
(a writer killed mid-record, or one still writing) just ends the file.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import google_crc32c

_LENGTH, _CRC = struct.Struct("<Q"), struct.Struct("<I")


class DamagedFile(Exception):
    """A record whose bytes are all there but do not match their checksum."""


def masked_crc32c(data: bytes) -> int:
    """The checksum TFRecord stores: CRC-32C, rotated and offset (so CRCs of CRCs are not trivial)."""
    crc = int(google_crc32c.value(data))
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def frame(data: bytes) -> bytes:
    """One record holding ``data``."""
    header = _LENGTH.pack(len(data))
    return header + _CRC.pack(masked_crc32c(header)) + data + _CRC.pack(masked_crc32c(data))


def read_records(path: Path) -> Iterator[bytes]:
    """Each record's data, in file order, checksums verified; raises :class:`DamagedFile`
    at the first mismatch. A last record cut short ends the iteration quietly."""
    offset = 0
    with path.open("rb") as file:
        while header := file.read(_LENGTH.size + _CRC.size):
            if len(header) < _LENGTH.size + _CRC.size:
                return
            length_bytes, (length_crc,) = header[: _LENGTH.size], _CRC.unpack(header[_LENGTH.size :])
            if masked_crc32c(length_bytes) != length_crc:
                raise DamagedFile(f"the length of the record at byte {offset} fails its checksum")
            (length,) = _LENGTH.unpack(length_bytes)
            body = file.read(length + _CRC.size)
            if len(body) < length + _CRC.size:
                return
            data, (data_crc,) = body[:length], _CRC.unpack(body[length:])
            if masked_crc32c(data) != data_crc:
                raise DamagedFile(f"the data of the record at byte {offset} fails its checksum")
            yield data
            offset += len(header) + len(body)
