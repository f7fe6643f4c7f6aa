"""The remote KV store against a real ``redis-server`` (tests/support/kv_remote_redis.py; skipped with the
reason where none is installed): round trip and sharing between two stores, the key layout, a
corrupted record and a record of another fingerprint never used, LRU eviction by the server
read as misses (not errors), a killed and a stopped (slow) server costing misses and dropped
writes, then the store resuming when the server answers again; the disk-then-remote chain; the
URL's options. No mock of the store."""

from __future__ import annotations

import logging
import os
import secrets
import signal
import time

import pytest

from engine.config.engine import EngineConfig
from engine.config.kv_disk import DiskTierConfig
from engine.config.kv_remote import RemoteTierConfig
from engine.kv_cache.disk.health import RetryPolicy
from engine.kv_cache.disk.store import DiskStore
from engine.kv_cache.remote.chain import ChainStore
from engine.kv_cache.remote.record import encode_value
from engine.kv_cache.remote.store import RemoteStore
from tests.support.kv_remote_redis import RedisServer

BLOCK = 4096
FAST_RETRY = RetryPolicy(first_s=0.05, max_s=0.2)


@pytest.fixture
def server(tmp_path):
    with RedisServer(tmp_path / "redis") as srv:
        yield srv


def _store(url: str, fp: bytes, **kw) -> RemoteStore:
    cfg = RemoteTierConfig.from_url(url)
    return RemoteStore(cfg.__class__(**{**vars(cfg), **kw}), fp, fp.hex()[:24], BLOCK,
                       retry=FAST_RETRY)


def _chain(n: int) -> tuple[list[bytes], list[bytes]]:
    return ([secrets.token_bytes(32) for _ in range(n)],
            [os.urandom(BLOCK) for _ in range(n)])


def _wait(cond, what: str, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_round_trip_is_shared_between_stores(server):
    fp = secrets.token_bytes(32)
    hashes, payloads = _chain(5)
    a = _store(server.url, fp)
    try:
        assert a.lookup(hashes) == 0
        assert all(a.submit(h, p) for h, p in zip(hashes[:3], payloads[:3]))
        a.flush()
        assert a.stats.written_blocks == 3 and a.stats.dropped_writes == 0
        assert all(h in a for h in hashes[:3]) and len(a) == 3  # known: it wrote them
    finally:
        a.close()
    key = f"kvserve:{fp.hex()[:24]}:{hashes[0].hex()}".encode()
    assert server.client().get(key) == encode_value(fp, hashes[0], payloads[0])
    b = _store(server.url, fp)  # another replica: knows nothing, finds everything
    try:
        assert hashes[0] not in b
        assert b.lookup(hashes) == 3 and hashes[0] in b and hashes[3] not in b
        assert b.lookup(hashes[1:]) == 2
        assert b.read_many(hashes) == payloads[:3] + [None, None]
        assert b.read(hashes[2]) == payloads[2]
        s = b.snapshot()
        assert s.hit_blocks == 4 and s.available and s.errors == 0 and s.lookups == 2
    finally:
        b.close()


def test_a_corrupted_record_or_another_fingerprint_is_never_used(server, caplog):
    fp, other = secrets.token_bytes(32), secrets.token_bytes(32)
    hashes, payloads = _chain(3)
    store = _store(server.url, fp)
    r = server.client()
    try:
        for h, p in zip(hashes, payloads):
            store.submit(h, p)
        store.flush()
        key = store.key
        value = bytearray(r.get(key(hashes[0])))
        value[-100] ^= 0x01  # one bit of the payload
        r.set(key(hashes[0]), bytes(value))
        # a valid record of another fingerprint (model, settings, rank) under our key
        r.set(key(hashes[1]), encode_value(other, hashes[1], payloads[1]))
        # a record of another block under this block's key
        r.set(key(hashes[2]), encode_value(fp, hashes[0], payloads[2]))
        with caplog.at_level(logging.WARNING, "kvserve.engine"):
            assert store.read_many(hashes) == [None, None, None]
        assert store.stats.bad_records == 3 and store.stats.hit_blocks == 0
        assert sum("is bad" in rec.getMessage() for rec in caplog.records) == 3
        assert store.lookup(hashes) == 0  # deleted: the next writer puts good ones back
        assert store.health.available  # bad data is not an outage
        # another fingerprint's store never sees these keys at all
        stranger = _store(server.url, other)
        try:
            stranger.submit(hashes[0], payloads[0])
            stranger.flush()
            assert store.lookup(hashes[:1]) == 0 and stranger.lookup(hashes[:1]) == 1
        finally:
            stranger.close()
    finally:
        store.close()


def test_eviction_by_the_server_is_a_miss_not_an_error(tmp_path):
    """``maxmemory 2mb`` with ``allkeys-lru`` and 2.5 MiB of blocks written: the server evicts,
    and what it evicted reads as a miss; every block read is verified."""
    with RedisServer(tmp_path / "redis", maxmemory="2mb") as server:
        fp = secrets.token_bytes(32)
        hashes, payloads = _chain(640)
        store = _store(server.url, fp, queue_blocks=1024)
        try:
            for h, p in zip(hashes, payloads):
                assert store.submit(h, p)
            store.flush()
            assert store.stats.written_blocks == 640
            held = server.client().dbsize()
            assert 0 < held < 640
            found = store.lookup(hashes)
            assert found < 640
            got = store.read_many(hashes[:64]) + store.read_many(hashes[-64:])
            assert any(g is None for g in got) and any(g is not None for g in got)
            assert all(g is None or g == p for g, p in zip(got, payloads[:64] + payloads[-64:]))
            s = store.snapshot()
            assert s.errors == 0 and s.bad_records == 0 and s.available and s.outages == 0
            assert s.miss_blocks > 0
        finally:
            store.close()


def test_a_killed_server_costs_misses_and_drops_then_the_store_resumes(server, caplog):
    fp = secrets.token_bytes(32)
    hashes, payloads = _chain(4)
    store = _store(server.url, fp)
    try:
        store.submit(hashes[0], payloads[0])
        store.flush()
        assert store.lookup(hashes) == 1
        server.kill()
        with caplog.at_level(logging.WARNING, "kvserve.engine"):
            assert store.lookup(hashes) == 0  # refused: a miss, and the store is down
            assert not store.writable
            assert store.read_many(hashes) == [None] * 4
            assert not store.submit(hashes[1], payloads[1])
            assert store.lookup(hashes) == 0
        assert store.stats.dropped_writes == 1 and store.stats.errors >= 1
        warned = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and "kv remote tier" in warned[0].getMessage()
        _wait(lambda: store.stats.errors >= 2, "the writer thread did not retry")
        server.start()  # same port, empty (no persistence)
        _wait(lambda: store.writable, "the store did not resume")
        assert store.lookup(hashes) == 0
        assert store.submit(hashes[1], payloads[1])
        store.flush()
        assert store.read_many(hashes[1:2]) == [payloads[1]]
        assert store.health.state == "ok" and store.snapshot().outages == 1
    finally:
        store.close()


def test_a_stopped_server_times_out_instead_of_stalling(server):
    """SIGSTOP: connections are accepted by the kernel but nothing answers. Without the
    client's timeouts these calls would never return; with them they are misses and drops."""
    fp = secrets.token_bytes(32)
    hashes, payloads = _chain(8)
    store = _store(server.url, fp, timeout_s=0.2, io_timeout_s=0.5, queue_blocks=2)
    try:
        store.submit(hashes[0], payloads[0])
        store.flush()
        server.proc.send_signal(signal.SIGSTOP)
        try:
            # the writer is stuck on its batch until io_timeout: the queue fills, never blocks
            queued = [store.submit(h, p) for h, p in zip(hashes[1:], payloads[1:])]
            assert queued.count(False) >= 4
            assert store.lookup(hashes) == 0 and not store.writable
            assert store.read(hashes[0]) is None
        finally:
            server.proc.send_signal(signal.SIGCONT)
        _wait(lambda: store.writable, "the store did not resume after SIGCONT")
        assert store.lookup(hashes[:1]) == 1 and store.read(hashes[0]) == payloads[0]
        s = store.snapshot()
        assert s.dropped_writes >= 4 and s.outages >= 1
    finally:
        store.close()


def test_a_server_down_at_start_starts_the_store_down(tmp_path):
    server = RedisServer(tmp_path / "redis")  # never started: the port refuses
    fp = secrets.token_bytes(32)
    store = _store(server.url, fp)
    try:
        assert not store.writable and store.lookup([fp]) == 0
        server.start()
        _wait(lambda: store.writable, "the store did not come up with the server")
    finally:
        store.close()
        server.kill()


def test_the_chain_reads_disk_then_remote_and_writes_both(server, tmp_path):
    fp = secrets.token_bytes(32)
    hashes, payloads = _chain(6)
    disk = DiskStore(DiskTierConfig(str(tmp_path / "disk"), 2**20, segment_bytes=2**18), fp,
                     fp.hex()[:24], BLOCK)
    remote = _store(server.url, fp)
    chain = ChainStore(disk, remote)
    try:
        for h, p in zip(hashes[:2], payloads[:2]):
            disk.submit(h, p)  # on disk only
        for h, p in zip(hashes[2:4], payloads[2:4]):
            remote.submit(h, p)  # in Redis only
        chain.flush()
        assert chain.lookup(hashes) == 4
        assert chain.read_many(hashes) == payloads[:4] + [None, None]
        assert hashes[0] in chain and hashes[2] in chain
        assert not chain.stored_everywhere(hashes[0]) and not chain.stored_everywhere(hashes[2])
        for h, p in zip(hashes, payloads):
            chain.submit(h, p)  # each store gets what it lacks
        chain.flush()
        assert all(chain.stored_everywhere(h) for h in hashes)
        assert disk.lookup(hashes) == 6 and remote.lookup(hashes) == 6
        assert chain.snapshot().enabled and chain.remote_snapshot().written_blocks == 6
    finally:
        chain.close()


def test_the_url_and_its_options():
    cfg = RemoteTierConfig.from_url("valkey://cache:6380/2?timeout=0.1&queue_blocks=512")
    assert cfg.url == "redis://cache:6380/2" and cfg.timeout_s == 0.1
    assert cfg.queue_blocks == 512 and cfg.io_timeout_s == 2.0
    assert RemoteTierConfig.from_url("rediss://:pw@h:1/0").redacted_url() == "rediss://:***@h:1/0"
    for bad, why in [("http://h:1/0", "must look like"), ("redis://h/0?timout=1", "unknown"),
                     ("redis://h/0?timeout=x", "not a float"), ("redis://h/0?timeout=0",
                                                                   "timeouts")]:
        with pytest.raises(ValueError, match=why):
            RemoteTierConfig.from_url(bad)
    with pytest.raises(ValueError, match="prefix caching"):
        EngineConfig(model="m", kv_remote_url="redis://h:1/0", enable_prefix_caching=False)
    # under tensor parallelism each rank keys its own share (issue 58, item 4)
    assert EngineConfig(model="m", kv_remote_url="redis://h:1/0",
                        tensor_parallel_size=2).stored_kv_tier
    with pytest.raises(ValueError, match="kv_remote_url"):
        EngineConfig(model="m", kv_remote_url="h:1")
    assert EngineConfig(model="m", kv_remote_url="redis://h:1/0").stored_kv_tier


def test_clear_deletes_this_fingerprints_keys_only(server):
    fp, other_fp = secrets.token_bytes(32), secrets.token_bytes(32)
    hashes, payloads = _chain(4)
    a, other = _store(server.url, fp), _store(server.url, other_fp)
    try:
        for h, p in zip(hashes, payloads):
            a.submit(h, p)
            other.submit(h, p)
        a.flush()
        other.flush()
        assert a.lookup(hashes) == 4 and len(a) == 4
        assert a.clear() == 4
        assert len(a) == 0 and a.lookup(hashes) == 0  # gone from the server, not only here
        assert other.lookup(hashes) == 4  # another model's (fingerprint's) blocks stay
        assert a.clear() == 0
        server.kill()
        assert a.clear() is None  # down: not cleared, and no exception
    finally:
        a.close()
        other.close()


def test_the_weights_identity_ignores_the_conversion_caches_last_use_marker(tmp_path):
    """Replicas share remote blocks only under one fingerprint: the ``kvserve-last-use`` file
    a converted GGUF's directory is touched with at every start must not change it."""
    from engine.kv_cache.disk.fingerprint import weights_identity
    from engine.loading.gguf_convert import LAST_USE

    (tmp_path / "model.safetensors").write_bytes(b"w" * 64)
    (tmp_path / LAST_USE).write_text("")
    before = weights_identity(tmp_path, "x")
    os.utime(tmp_path / LAST_USE, ns=(1, 1))
    assert weights_identity(tmp_path, "x") == before
    os.utime(tmp_path / "model.safetensors", ns=(1, 1))  # the weights themselves still count
    assert weights_identity(tmp_path, "x") != before
