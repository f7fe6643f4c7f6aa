"""Media in the prefix cache's block keys (engine/kv_cache/hashing.py, module docstring): the
same tokens after a different image never share a block from the image's first block on, the
same image does, and the blocks before any image keep a text prompt's hashes."""

from __future__ import annotations

import pytest

from engine.kv_cache import KVCacheManager
from engine.kv_cache.hashing import compute_block_hashes, extend_block_hashes, media_key

BS = 4
IMG = 99  # the placeholder token every image's span repeats


def _prompt() -> list[int]:
    # 6 text tokens, an image of 6 placeholders at offset 6 (blocks 1 and 2), 8 text tokens
    return [1, 2, 3, 4, 5, 6] + [IMG] * 6 + list(range(10, 18))


def _run(m: KVCacheManager, seq: str, tokens: list[int], extra: tuple) -> int:
    hit = m.find_prefix(seq, tokens, extra)
    assert m.allocate(seq, len(tokens), hit) is not None
    m.commit(seq, tokens, len(tokens), extra)
    m.check_integrity()
    return hit.num_tokens


def test_a_different_image_changes_every_block_from_its_first():
    tokens = _prompt()
    a = compute_block_hashes(tokens, BS, (media_key([(6, 6, "image-a")]),))
    b = compute_block_hashes(tokens, BS, (media_key([(6, 6, "image-b")]),))
    text = compute_block_hashes(tokens, BS)
    assert a[0] == b[0] == text[0]  # block 0 (tokens 0-3) holds no image: shared
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))  # blocks 1.. differ
    assert all(x != y for x, y in zip(a[1:], text[1:], strict=True))
    assert compute_block_hashes(tokens, BS, (media_key([(6, 6, "image-a")]),)) == a


def test_the_media_key_sits_beside_the_other_keys():
    tokens = _prompt()
    salted = compute_block_hashes(tokens, BS, ("salt", media_key([(6, 6, "image-a")])))
    assert salted != compute_block_hashes(tokens, BS, (media_key([(6, 6, "image-a")]),))
    assert salted[0] == compute_block_hashes(tokens, BS, ("salt",))[0]


def test_growing_a_chain_block_by_block_gives_the_same_hashes():
    tokens = _prompt()
    spans = media_key([(6, 6, "image-a")])[1]
    whole: list[bytes] = []
    extend_block_hashes(whole, tokens, BS, len(tokens) // BS, b"", spans)
    grown: list[bytes] = []
    for n in range(1, len(tokens) // BS + 1):
        extend_block_hashes(grown, tokens, BS, n, b"", spans)
    assert grown == whole


def test_same_text_different_image_is_never_a_prefix_hit():
    """Through the manager, as the scheduler calls it. Fails if the media key is dropped: the
    placeholders are the same tokens, so the second request would hit all 16 cached tokens."""
    m = KVCacheManager(16, BS)
    tokens = _prompt()
    _run(m, "first", tokens, (media_key([(6, 6, "image-a")]),))
    assert _run(m, "other-image", tokens, (media_key([(6, 6, "image-b")]),)) == BS
    assert _run(m, "same-image", tokens, (media_key([(6, 6, "image-a")]),)) == 16
    assert _run(m, "no-image", tokens, ()) == BS
    assert m.prompt_chains(tokens, (media_key([(6, 6, "image-a")]),))[0] == \
        m.block_hashes("same-image")[:4]


def test_two_images_each_keyed_where_they_sit():
    tokens = [1, 2] + [IMG] * 4 + [3, 4] + [IMG] * 4 + [5, 6, 7, 8, 9]
    ab = compute_block_hashes(tokens, BS, (media_key([(2, 4, "a"), (8, 4, "b")]),))
    ba = compute_block_hashes(tokens, BS, (media_key([(2, 4, "b"), (8, 4, "a")]),))
    ac = compute_block_hashes(tokens, BS, (media_key([(8, 4, "c"), (2, 4, "a")]),))
    assert ab[0] != ba[0]  # block 0 holds the first image's start
    assert ab[:2] == ac[:2] and ab[2] != ac[2]  # the second image starts in block 2


@pytest.mark.parametrize("spans", [[(-1, 2, "a")], [(0, 0, "a")], [(0, 2, "")],
                                   [(0, 4, "a"), (3, 2, "b")]])
def test_media_key_refuses_malformed_spans(spans):
    with pytest.raises(ValueError):
        media_key(spans)
