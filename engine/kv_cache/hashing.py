"""Chained block hashes: the names under which full KV blocks are shared between requests.

A block hash names a whole prefix, not just one block: ``hash(i) = H(hash(i-1) || tokens of
block i || extra keys)``. Two blocks with equal hashes therefore hold the KV of the same tokens at
the same positions after the same history, and may be shared. Only *full* blocks are hashed; a
partial last block changes every step and is never shared.

The digest is SHA-256 over a fixed byte encoding (tokens as little-endian int64). Python's builtin
``hash`` of a tuple is cheaper but only 64 bits wide and not collision resistant, so a crafted
prompt could alias another tenant's prefix (and read its KV through a cache hit). SHA-256's cost
(docs/decisions.md#small-cpu-costs) is paid once per block per sequence: hashes are
remembered by the manager, never recomputed per step.

Hashes are plain ``bytes`` so that the host offload tier can key its own map by them.

**Media** (images) enter a prompt as runs of identical placeholder tokens, so their tokens alone
cannot tell two images apart. A request's extra keys may hold one :func:`media_key` element,
``("media", ((offset, length, content_key), ...))``: it is not added to every block, as the
other extra keys are, but only to the blocks that overlap a span (each such block's bytes gain
its spans' content keys and offsets relative to the block). Blocks wholly before the first
span keep the hashes a text-only prompt gives them (a shared system prompt still hits), and the
chain carries the difference to every block after (vLLM's ``mm_hash`` in its block keys).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

BlockHash = bytes
"""A 32-byte SHA-256 digest naming a full block together with everything before it."""

# Parent of the first block. A fixed, non-empty seed keeps "no parent" distinct from any digest.
ROOT_PARENT: BlockHash = hashlib.sha256(b"kvserve-kv-root-v1").digest()

_ALLOWED_KEY_TYPES = (str, int, float, bool, bytes, type(None))
MEDIA = "media"  # the tag of the extra key that holds a prompt's media spans (module docstring)
MediaSpan = tuple[int, int, str]
"""``(offset, length, content_key)``: a media item's placeholder tokens and its content key."""
_BIG_ENDIAN = sys.byteorder == "big"


def encode_extra_keys(extra_keys: tuple) -> bytes:
    """Deterministic bytes for ``extra_keys`` (cache_salt, adapter ids, media hashes, ...).

    Accepts nested tuples of str / int / float / bool / bytes / None. Anything else is refused with
    ``ValueError``: its ``repr`` could contain a memory address, which would silently turn every
    lookup into a miss (or, worse, differ between the lookup and the registration).
    """
    if not isinstance(extra_keys, tuple):
        raise ValueError(f"extra_keys must be a tuple, got {type(extra_keys).__name__}")
    if not extra_keys:
        return b""
    _check_keys(extra_keys)
    # repr of these types is stable and unambiguous (strings are quoted, tuples bracketed).
    return repr(extra_keys).encode("utf-8")


def _check_keys(keys: tuple) -> None:
    for key in keys:
        if isinstance(key, tuple):
            _check_keys(key)
        elif not isinstance(key, _ALLOWED_KEY_TYPES):
            raise ValueError(
                f"extra key {key!r} of type {type(key).__name__} cannot be hashed stably; "
                "use str, int, float, bool, bytes, None or tuples of them"
            )


def media_key(spans: Sequence[MediaSpan]) -> tuple:
    """The extra key for a prompt's media ``spans`` (module docstring), sorted by offset.
    ``ValueError`` for a negative offset, an empty span, an empty content key or two spans that
    overlap."""
    out = tuple(sorted((int(o), int(n), k) for o, n, k in spans))
    end = 0
    for offset, length, key in out:
        if offset < 0 or length < 1:
            raise ValueError(f"a media span needs offset >= 0 and length >= 1, got "
                             f"({offset}, {length})")
        if not isinstance(key, str) or not key:
            raise ValueError("a media span needs a non-empty content key")
        if offset < end:
            raise ValueError(f"media spans overlap at token {offset}")
        end = offset + length
    return (MEDIA, out)


def split_media(extra_keys: tuple) -> tuple[tuple, tuple[MediaSpan, ...]]:
    """``(the keys every block carries, the media spans)`` of ``extra_keys``."""
    if not isinstance(extra_keys, tuple):
        raise ValueError(f"extra_keys must be a tuple, got {type(extra_keys).__name__}")
    plain, spans = [], ()
    for key in extra_keys:
        if isinstance(key, tuple) and len(key) == 2 and key[0] == MEDIA:
            spans = key[1]
        else:
            plain.append(key)
    return tuple(plain), spans


def _block_media(spans: tuple[MediaSpan, ...], start: int, end: int) -> bytes:
    """The bytes block ``[start, end)`` adds for the spans it overlaps (b"" for none)."""
    mine = tuple((key, offset - start, length) for offset, length, key in spans
                 if offset < end and offset + length > start)
    return b"\x00media" + repr(mine).encode("utf-8") if mine else b""


def hash_block_tokens(parent: BlockHash, tokens: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Hash one full block given its parent's hash and pre-encoded extra keys (the hot path).

    ``tokens`` must be exactly one block of token ids; the caller guarantees fullness.
    """
    packed = array("q", tokens)
    if _BIG_ENDIAN:  # the digest must not depend on the host
        packed.byteswap()
    return hashlib.sha256(parent + packed.tobytes() + extra).digest()


def hash_block(
    parent: BlockHash | None, tokens: Sequence[int], extra_keys: tuple = ()
) -> BlockHash:
    """Hash of one full block; ``parent=None`` for the first block of a sequence (no media
    key: a block's media bytes depend on its position, :func:`compute_block_hashes` knows it)."""
    if split_media(extra_keys)[1]:
        raise ValueError("hash_block cannot place media spans: use compute_block_hashes")
    return hash_block_tokens(
        ROOT_PARENT if parent is None else parent, tokens, encode_extra_keys(extra_keys)
    )


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    num_blocks: int,
    extra: bytes = b"",
    media: tuple[MediaSpan, ...] = (),
) -> None:
    """Append to ``hashes`` (the chain for ``token_ids`` so far) until it covers ``num_blocks``.

    Work is proportional to the blocks added, which lets callers grow a sequence's chain one block
    at a time. ``num_blocks`` must not exceed ``len(token_ids) // block_size`` (full blocks only).
    ``extra``: every block's encoded extra keys; ``media``: the spans of :func:`split_media`,
    added to the blocks they overlap.
    """
    if num_blocks * block_size > len(token_ids):
        raise ValueError(
            f"cannot hash {num_blocks} full blocks of {block_size} from {len(token_ids)} tokens"
        )
    first = len(hashes)
    if first >= num_blocks:
        return
    # Pack all new blocks at once: one array conversion instead of one per block.
    packed = array("q", token_ids[first * block_size : num_blocks * block_size])
    if _BIG_ENDIAN:
        packed.byteswap()
    data = packed.tobytes()
    stride = 8 * block_size
    parent = hashes[-1] if hashes else ROOT_PARENT
    sha256 = hashlib.sha256
    if media and max(o + n for o, n, _ in media) > first * block_size:  # a new block may overlap
        for i, off in enumerate(range(0, len(data), stride), start=first):
            tail = extra + _block_media(media, i * block_size, (i + 1) * block_size)
            parent = sha256(parent + data[off : off + stride] + tail).digest()
            hashes.append(parent)
        return
    for off in range(0, len(data), stride):
        parent = sha256(parent + data[off : off + stride] + extra).digest()
        hashes.append(parent)


def compute_block_hashes(
    token_ids: Sequence[int], block_size: int, extra_keys: tuple = ()
) -> list[BlockHash]:
    """Chained hashes of every full block of ``token_ids`` (a partial tail is ignored)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    plain, media = split_media(extra_keys)
    hashes: list[BlockHash] = []
    extend_block_hashes(
        hashes, token_ids, block_size, len(token_ids) // block_size, encode_extra_keys(plain),
        media,
    )
    return hashes
