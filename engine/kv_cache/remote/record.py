"""A remote block's value: the disk tier's bytes, so one format is verified one way.

Value = the segment header (``engine.kv_cache.disk.segment.segment_header``: magic and the
32-byte fingerprint digest) followed by one record (``encode_record``: magic, the 32-byte
chained block hash, the payload length, a CRC-32 over them and the payload, then the payload).
The key already names the fingerprint (shortened); the value repeats all of it, so a record of
another model, configuration or rank is refused even under a colliding or forged key, and a
record for another block, of another length, cut short or with a flipped bit is refused by its
header and CRC.
"""

from __future__ import annotations

from engine.kv_cache.disk.segment import (
    HEADER_BYTES,
    RECORD_HEADER_BYTES,
    encode_record,
    segment_header,
)

VALUE_OVERHEAD = HEADER_BYTES + RECORD_HEADER_BYTES  # bytes of a value beyond its payload


class BadRecord(Exception):
    """A value failed its checks (the message says which)."""


def encode_value(fingerprint: bytes, block_hash: bytes, payload: bytes | memoryview) -> bytes:
    return segment_header(fingerprint) + encode_record(block_hash, payload)


def decode_value(value: bytes, fingerprint: bytes, block_hash: bytes, length: int) -> bytes:
    """The payload of ``value`` after checking the fingerprint, magic, hash, length and CRC
    (``BadRecord`` otherwise)."""
    if len(value) != VALUE_OVERHEAD + length:
        raise BadRecord(f"{len(value)} bytes where {VALUE_OVERHEAD + length} were expected")
    if value[:HEADER_BYTES] != segment_header(fingerprint):
        raise BadRecord("written under another fingerprint (model, settings or rank)")
    payload = memoryview(value)[VALUE_OVERHEAD:]
    # re-encoding the header checks magic, hash, length and the CRC over the payload
    expected = encode_record(block_hash, payload)[:RECORD_HEADER_BYTES]
    if value[HEADER_BYTES:VALUE_OVERHEAD] != expected:
        raise BadRecord("record header or checksum mismatch")
    return bytes(payload)
