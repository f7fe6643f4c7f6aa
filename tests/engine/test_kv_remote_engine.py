"""The remote KV tier end to end: two engines (replicas with their own pools) on one tiny random
model sharing one real ``redis-server``. A prompt only engine A computed is served by engine B
from Redis (every full block of its prefix counted in cached_tokens) with the greedy tokens of
HF transformers' own forward pass and of a cold run; the same beside a disk tier (read disk
then Redis) and under a hybrid KV cache; ``redis-server`` killed while requests run costs
recomputes and no failed request, and the tier resumes when it is back."""

from __future__ import annotations

import random
import threading
import time

import pytest

from engine import LLM
from engine.loading.hf_reference import hf_greedy, load_hf
from engine.loading.tiny import make_tiny_model_dir
from tests.engine.tier_runs import BS, NEW, full_prefix, run_greedy
from tests.support.kv_remote_redis import RedisServer, require_redis_server
from tests.support.tiny_models import make_hybrid_qwen2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    require_redis_server()
    path = make_tiny_model_dir(tmp_path_factory.mktemp("llama"), "llama")
    hf = load_hf(path)
    rng = random.Random(5)
    prompts = [[rng.randrange(0, 256) for _ in range(n)] for n in (61, 30, 45, 53)]
    return path, prompts, [hf_greedy(hf, p, NEW) for p in prompts]


@pytest.fixture
def redis_server(tmp_path):
    with RedisServer(tmp_path / "redis") as srv:
        yield srv


def _llm(path, url, **kw) -> LLM:
    cfg = dict(dtype="float32", block_size=BS, kv_cache_memory=2**21, kv_remote_url=url)
    cfg.update(kw)
    return LLM(str(path), **cfg)


def _flush(llm: LLM) -> None:
    llm.engine.disk.store.flush()


def test_a_prompt_computed_by_a_is_served_by_b_from_redis(tiny, redis_server):
    path, prompts, expected = tiny
    with _llm(path, redis_server.url) as a, _llm(path, redis_server.url) as b:
        cold, cached = run_greedy(a, prompts)
        assert cold == expected and cached == [0] * len(prompts)
        _flush(a)
        # every full block of the prompts, and of the generated tokens after them
        assert a.stats()["remote_written_blocks"] >= sum(len(p) // BS for p in prompts)
        warm, cached = run_greedy(b, prompts)  # B never saw these prompts: its pools are empty
        stats = b.stats()
    assert warm == expected
    assert cached == [full_prefix(p) for p in prompts]
    assert all(c >= 0.95 * full_prefix(p) for c, p in zip(cached, prompts))
    assert stats["remote_hit_blocks"] == sum(full_prefix(p) // BS for p in prompts)
    assert stats["remote_available"] and stats["remote_errors"] == 0
    assert stats["disk_enabled"] is False  # no disk tier: its stats stay zero


def test_beside_a_disk_tier_b_reads_redis_after_its_own_disk(tiny, redis_server, tmp_path):
    path, prompts, expected = tiny
    kw = dict(kv_disk_size="8MiB")
    with _llm(path, redis_server.url, kv_disk_dir=str(tmp_path / "a"), **kw) as a:
        assert run_greedy(a, prompts[:2]) == (expected[:2], [0, 0])
        _flush(a)
    with _llm(path, redis_server.url, kv_disk_dir=str(tmp_path / "b"), **kw) as b:
        warm, cached = run_greedy(b, prompts[:2])  # B's disk is empty: every hit is Redis's
        stats = b.stats()
        _flush(b)
    assert warm == expected[:2] and cached == [full_prefix(p) for p in prompts[:2]]
    assert stats["remote_hit_blocks"] == sum(full_prefix(p) // BS for p in prompts[:2])
    # what B loaded from Redis went to its own disk as well: a restart of B reads its disk
    with _llm(path, redis_server.url, kv_disk_dir=str(tmp_path / "b"), **kw) as b2:
        warm, cached = run_greedy(b2, prompts[:2])
        stats = b2.stats()
    assert warm == expected[:2] and cached == [full_prefix(p) for p in prompts[:2]]
    assert stats["remote_hit_blocks"] == 0 and stats["disk_hit_blocks"] > 0


def test_redis_killed_mid_run_costs_recomputes_not_requests(tiny, redis_server):
    path, prompts, expected = tiny
    hf = load_hf(path)
    rng = random.Random(9)
    others = [[rng.randrange(0, 256) for _ in range(rng.randrange(30, 60))] for _ in range(12)]
    batch = prompts + others  # A computed the first four: B loads them from Redis
    truth = expected + [hf_greedy(hf, p, NEW) for p in others]
    with _llm(path, redis_server.url) as a:
        run_greedy(a, prompts)
        _flush(a)
    with _llm(path, redis_server.url, max_num_seqs=2) as b:
        remote = b.engine.disk.store.remote

        def kill_once_busy():  # while B reads and writes: its requests are mid-run
            deadline = time.monotonic() + 60
            while remote.stats.hit_blocks + remote.stats.written_blocks < 8:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.001)
            redis_server.kill()

        killer = threading.Thread(target=kill_once_busy)
        killer.start()
        outs, _ = run_greedy(b, batch)  # redis-server vanishes while these run
        killer.join()
        assert outs == truth
        # the tier noticed while the batch ran: its reads or writes met the dead server
        assert b.stats()["remote_errors"] >= 1
        fresh = [[rng.randrange(0, 256) for _ in range(37)] for _ in range(3)]
        outs, cached = run_greedy(b, fresh)  # looked up in a Redis that is gone: recomputed
        assert outs == [hf_greedy(hf, p, NEW) for p in fresh] and cached == [0, 0, 0]
        down = b.stats()
        assert not down["remote_available"] and down["remote_errors"] >= 1
        assert down["remote_outages"] == 1
        redis_server.start()  # back, empty; the writer's retry (1 s) finds it
        deadline = time.monotonic() + 30
        while not remote.writable:
            assert time.monotonic() < deadline, "the remote tier did not resume"
            time.sleep(0.05)
        later = [[7] * 40 + p[:9] for p in prompts[:2]]
        run_greedy(b, later)
        _flush(b)
        assert b.stats()["remote_written_blocks"] > down["remote_written_blocks"]
    with _llm(path, redis_server.url) as c:  # what B wrote after the outage is shared
        _, cached = run_greedy(c, later)
    assert cached == [full_prefix(p) for p in later]


def test_a_hybrid_kv_cache_finds_every_groups_blocks_in_redis(redis_server, tmp_path):
    path = make_hybrid_qwen2(tmp_path / "hyb", 8)
    rng = random.Random(3)
    prompt = [rng.randrange(0, 256) for _ in range(41)]
    expected = hf_greedy(load_hf(path), prompt, NEW)
    kw = dict(kv_cache_memory="4MiB", quantization="none")
    with _llm(path, redis_server.url, **kw) as a:
        assert run_greedy(a, [prompt]) == ([expected], [0])
        _flush(a)
    with _llm(path, redis_server.url, **kw) as b:
        warm, cached = run_greedy(b, [prompt])
        stats = b.stats()
    assert warm == [expected] and cached == [full_prefix(prompt)]
    assert stats["remote_hit_blocks"] > 0
