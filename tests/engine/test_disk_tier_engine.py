"""The disk KV tier end to end on a tiny random model: after a restart a prompt's blocks come
back from disk (counted in cached_tokens) and greedy outputs equal HF transformers' own; with
the host tier off (staging only), with int8 or int4 KV; a corrupted, truncated or manifest-less
directory, another model's directory and two engines on one directory all answer correctly."""

from __future__ import annotations

import random
import shutil

import pytest

from engine import LLM, SamplingParams
from engine.kv_cache.disk import store as store_mod
from engine.kv_cache.disk.segment import HEADER_BYTES, RECORD_HEADER_BYTES
from engine.kv_format import formats
from engine.loading.hf_reference import hf_greedy, load_hf
from engine.loading.tiny import make_tiny_model_dir

BS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_model_dir(tmp_path_factory.mktemp("llama"), "llama")
    hf = load_hf(path)
    rng = random.Random(7)
    prompts = [[rng.randrange(0, 256) for _ in range(n)] for n in (61, 30)]
    expected = [hf_greedy(hf, p, 6) for p in prompts]
    return path, prompts, expected


def _llm(path, disk, **kw) -> LLM:
    cfg = dict(dtype="float32", block_size=BS, kv_cache_memory=2**21, kv_disk_dir=str(disk),
               kv_disk_size="8MiB")
    cfg.update(kw)
    return LLM(str(path), **cfg)


def _run(llm: LLM, prompts):
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(prompts, [sp] * len(prompts))
    llm.engine.kv.check_integrity()
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


@pytest.fixture(scope="module")
def written(tiny, tmp_path_factory):
    """A directory a cold float32 engine (host tier off) wrote while answering the prompts."""
    path, prompts, expected = tiny
    disk = tmp_path_factory.mktemp("disk")
    with _llm(path, disk) as llm:
        outs, cached = _run(llm, prompts)
    assert outs == expected and cached == [0] * len(prompts)
    return disk


def _copy(written, tmp_path):
    dst = tmp_path / "disk"
    shutil.copytree(written, dst)
    return dst


@pytest.mark.parametrize("host", ["host-off-no-manifest", "host-on"])
def test_restart_serves_disk_blocks_and_equals_hf(tiny, written, tmp_path, host):
    path, prompts, expected = tiny
    disk = _copy(written, tmp_path)
    kw = {}
    if host == "host-on":
        kw = {"swap_space": 2**20 / 2**30}
    else:  # the index is rebuilt from the segments alone
        next(disk.glob("kv-*/manifest.json")).unlink()
    with _llm(path, disk, **kw) as llm:
        warm, warm_cached = _run(llm, prompts)
        stats = llm.stats()
        tier = llm.engine.kv_snapshot().tier("disk")  # the KV page's third tier
    assert warm == expected
    assert tier.cached == stats["disk_blocks"] > 0 and tier.used == 0
    assert tier.free + tier.cached_free + tier.used == tier.num_blocks
    for p, c in zip(prompts, warm_cached):
        assert c >= 0.9 * (len(p) - BS) and c == (len(p) - 1) // BS * BS
    assert stats["disk_hit_blocks"] == sum(c // BS for c in warm_cached)
    assert stats["disk_checksum_failures"] == 0


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_restart_with_quantised_kv_in_a_float_dir(tiny, written, tmp_path, kind):
    """int8 or int4 KV in a directory a float32 engine wrote: its blocks are never read; after
    its own restart it serves its own blocks (their packed bytes and scales, unchanged) and
    answers as its cold run did."""
    path, prompts, _ = tiny
    disk = _copy(written, tmp_path)
    with _llm(path, disk, kv_cache_dtype=kind) as llm:
        cold, cold_cached = _run(llm, prompts)
        assert llm.stats()["disk_blocks_at_start"] == 0 and cold_cached == [0] * len(prompts)
    with _llm(path, disk, kv_cache_dtype=kind) as llm:
        warm, warm_cached = _run(llm, prompts)
    assert warm == cold and min(warm_cached) > 0


def test_a_row_layout_bump_hides_the_old_blocks(tiny, written, tmp_path, monkeypatch):
    """Bytes written under one version of a KV row layout are never read under the next
    (``formats.ROW_LAYOUT_VERSIONS``: a changed int4 group order or rotation must bump it)."""
    path, prompts, expected = tiny
    monkeypatch.setitem(formats.ROW_LAYOUT_VERSIONS, "float",
                        formats.ROW_LAYOUT_VERSIONS["float"] + 1)
    with _llm(path, _copy(written, tmp_path)) as llm:
        outs, cached = _run(llm, prompts)
        stats = llm.stats()
    assert outs == expected
    assert cached == [0] * len(prompts) and stats["disk_blocks_at_start"] == 0


def _flip_every_record(seg):
    data = bytearray(seg.read_bytes())
    off = HEADER_BYTES
    while off + RECORD_HEADER_BYTES < len(data):
        n = int.from_bytes(data[off + 36:off + 40], "little")
        data[off + RECORD_HEADER_BYTES + n // 2] ^= 0x01
        off += RECORD_HEADER_BYTES + n
    seg.write_bytes(bytes(data))


@pytest.mark.parametrize("fault", ["flip", "truncate"])
def test_damaged_dir_still_answers_correctly(tiny, written, tmp_path, fault):
    path, prompts, expected = tiny
    disk = _copy(written, tmp_path)
    segs = sorted(disk.glob("kv-*/*.kvs"))
    assert segs
    for seg in segs:
        if fault == "flip":
            _flip_every_record(seg)
        else:
            seg.write_bytes(seg.read_bytes()[:seg.stat().st_size * 2 // 3])
    with _llm(path, disk) as llm:
        outs, _ = _run(llm, prompts)
        stats = llm.stats()
    assert outs == expected
    if fault == "flip":
        assert stats["disk_checksum_failures"] > 0 and stats["disk_hit_blocks"] == 0


def test_another_models_dir_is_never_read(tiny, written, tmp_path, tmp_path_factory):
    path, prompts, _ = tiny
    other = make_tiny_model_dir(tmp_path_factory.mktemp("other"), "llama", seed=3)
    hf = load_hf(other)
    with _llm(other, _copy(written, tmp_path)) as llm:
        outs, cached = _run(llm, prompts)
        stats = llm.stats()
    assert outs == [hf_greedy(hf, p, 6) for p in prompts]
    assert cached == [0] * len(prompts) and stats["disk_blocks_at_start"] == 0


def test_two_engines_on_one_dir(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(store_mod, "REFRESH_INTERVAL_S", 0.0)
    path, prompts, expected = tiny
    with _llm(path, tmp_path) as a, _llm(path, tmp_path) as b:
        assert _run(a, prompts[:1])[0] == expected[:1]
        a.engine.disk.store.flush()
        outs, cached = _run(b, prompts)  # b finds what a wrote after b started
        assert outs == expected and cached[0] > 0


@pytest.mark.parametrize("policy", ["write-through", "on-evict"])
def test_prefixes_evicted_while_queued_come_back_from_disk(tiny, tmp_path, policy):
    """The multi-turn case: many requests arrive at once whose prefixes the device and a small
    host tier held on arrival, then evict while the first ones run. At the admission gate each
    is looked up again and read from disk (its read blocks held until it is admitted), so
    every one reports its whole prefix cached, with the tier-less greedy output."""
    path, _, _ = tiny
    rng = random.Random(11)
    prompts = [[rng.randrange(0, 256) for _ in range(60)] for _ in range(6)]
    # 512 bytes a token: a device pool of 24 blocks, a host tier of 20 (16 blocks a prompt)
    kw = dict(kv_cache_memory=24 * BS * 512, swap_space=20 * BS * 512 / 2**30)
    with _llm(path, tmp_path, kv_disk_write_policy=policy, **kw) as llm:
        first, _ = _run(llm, prompts)
        llm.engine.disk.store.flush()
        if policy == "on-evict":  # written as they left memory, not at commit
            cache = llm.engine.kv.host.cache
            written = llm.stats()["disk_written_blocks"]
            assert 0 < written <= cache.host_evictions + cache.spills_dropped
        # the tiny model recomputes faster than the nominal disk rate: always wait for reads
        llm.engine.disk.cost = None
        again = [p + [7, 8, 9, 10, 11] for p in prompts]
        outs, cached = _run(llm, again)
        stats = llm.stats()
    with LLM(str(path), dtype="float32", block_size=BS, **kw) as plain:
        assert outs == _run(plain, again)[0]
    assert stats["disk_hit_blocks"] > 0
    assert cached == [len(p) for p in prompts], cached  # every block of the first prompts


def test_on_evict_writes_back_memory_at_shutdown(tiny, tmp_path):
    """``on-evict`` with pools that evict nothing: no block reaches the disk while serving,
    all of them at a clean shutdown, and a restart serves them."""
    path, prompts, expected = tiny
    kw = dict(kv_disk_write_policy="on-evict", swap_space=2**20 / 2**30)
    with _llm(path, tmp_path, **kw) as llm:
        assert _run(llm, prompts)[0] == expected
        llm.engine.disk.store.flush()
        assert llm.stats()["disk_written_blocks"] == 0
    with _llm(path, tmp_path, **kw) as llm:
        warm, cached = _run(llm, prompts)
        assert llm.stats()["disk_blocks_at_start"] > 0
    assert warm == expected
    assert cached == [(len(p) - 1) // BS * BS for p in prompts]
