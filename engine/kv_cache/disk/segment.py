"""The segment file format: a header, then records appended one after another.

Header (40 bytes): ``b"KVSEG\\x01\\0\\0"`` and the 32-byte fingerprint digest.
Record: ``<4s 32s I I>`` = ``b"KVB1"``, the 32-byte chained block hash, the payload length and
a CRC-32 over (hash, length, payload); then the payload (one block's K and V of every layer).

A record is trusted only after :func:`read_record` has re-checked magic, hash, length and CRC:
:func:`scan` (start-up, other writers' new records) only checks the structure, so a segment cut
short by a crash ends at its last whole record, and a bad record is found when it is read.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass

SEGMENT_MAGIC = b"KVSEG\x01\0\0"
HEADER_BYTES = len(SEGMENT_MAGIC) + 32
_RECORD = struct.Struct("<4s32sII")
RECORD_MAGIC = b"KVB1"
RECORD_HEADER_BYTES = _RECORD.size
SUFFIX = ".kvs"


@dataclass(frozen=True)
class RecordRef:
    """Where one block lives: segment file name, record offset, payload length."""

    segment: str
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + RECORD_HEADER_BYTES + self.length


def segment_header(fingerprint: bytes) -> bytes:
    assert len(fingerprint) == 32
    return SEGMENT_MAGIC + fingerprint


def header_problem(header: bytes, fingerprint: bytes | str) -> str | None:
    """Why ``header`` (a file's first bytes) does not begin a segment of ``fingerprint`` (the
    digest, or the hex prefix a fingerprint directory is named by); None when it does."""
    if len(header) < HEADER_BYTES:
        return f"shorter than a segment header ({len(header)} of {HEADER_BYTES} bytes)"
    if not header.startswith(SEGMENT_MAGIC):
        return "not a segment file (bad magic)"
    digest = header[len(SEGMENT_MAGIC):HEADER_BYTES]
    ours = (digest == fingerprint if isinstance(fingerprint, bytes)
            else digest.hex().startswith(fingerprint))
    return None if ours else "its header names another fingerprint"


def encode_record(block_hash: bytes, payload: bytes | memoryview) -> bytes:
    """One record's bytes (header and payload)."""
    if len(block_hash) != 32:
        raise ValueError(f"block hashes are 32 bytes; got {len(block_hash)}")
    n = len(payload)
    crc = zlib.crc32(payload, zlib.crc32(block_hash + n.to_bytes(4, "little")))
    return _RECORD.pack(RECORD_MAGIC, block_hash, n, crc) + bytes(payload)


class CorruptRecord(Exception):
    """A record failed its checks (the message says which)."""


def read_record(fd: int, offset: int, block_hash: bytes, length: int) -> bytes:
    """The payload of the record at ``offset``, after checking that it is whole, names
    ``block_hash``, has ``length`` bytes and matches its CRC. ``CorruptRecord`` otherwise."""
    data = os.pread(fd, RECORD_HEADER_BYTES + length, offset)
    if len(data) != RECORD_HEADER_BYTES + length:
        raise CorruptRecord(f"record cut short ({len(data)} of "
                            f"{RECORD_HEADER_BYTES + length} bytes)")
    magic, h, n, crc = _RECORD.unpack_from(data)
    if magic != RECORD_MAGIC or h != block_hash or n != length:
        raise CorruptRecord("record header does not match the index")
    payload = memoryview(data)[RECORD_HEADER_BYTES:]
    if zlib.crc32(payload, zlib.crc32(h + n.to_bytes(4, "little"))) != crc:
        raise CorruptRecord("checksum mismatch")
    return bytes(payload)


def scan(path: str, fingerprint: bytes, start: int = 0,
         ) -> tuple[list[tuple[bytes, int, int]], int, bool]:
    """Records of the segment at ``path`` from offset ``start`` (0: check the header first).

    Returns ``(records, end, ok)``: ``records`` as (block hash, offset, payload length) in file
    order, ``end`` the offset after the last whole record, ``ok`` False when the header is not
    ours (wrong magic or fingerprint: nothing is returned). Structure only; CRCs are checked by
    :func:`read_record`. A torn or garbled tail ends the scan."""
    records: list[tuple[bytes, int, int]] = []
    with open(path, "rb") as f:
        if start == 0:
            header = f.read(HEADER_BYTES)
            if header != segment_header(fingerprint):
                return [], 0, False
            start = HEADER_BYTES
        size = os.fstat(f.fileno()).st_size
        off = start
        f.seek(off)
        while off + RECORD_HEADER_BYTES <= size:
            raw = f.read(RECORD_HEADER_BYTES)
            magic, h, n, _ = _RECORD.unpack(raw)
            if magic != RECORD_MAGIC or off + RECORD_HEADER_BYTES + n > size:
                break
            records.append((h, off, n))
            off += RECORD_HEADER_BYTES + n
            f.seek(off)
    return records, off, True
