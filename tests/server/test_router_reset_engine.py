"""What ``POST /flush_cache`` and ``/reset_prefix_cache`` do below the HTTP layer: the disk
store's ``clear`` (queued writes dropped, every segment no other writer holds deleted, this
server's active one deleted by its writer thread, another server's active one kept), and
``EngineCore.reset_prefix_cache`` on a tiny random model with the host and disk tiers: each
tier named is emptied of its cached blocks and no other, the next identical prompt is a miss
(``num_cached_tokens`` 0) where before it was a hit, blocks held by a running request keep
their KV and hash, and the block accounting holds after every step."""

from __future__ import annotations

import hashlib
import random
import threading

import pytest

from engine import LLM, SamplingParams
from engine.config.kv_disk import DiskTierConfig, parse_size
from engine.kv_cache.disk.store import DiskStore
from engine.loading.tiny import make_tiny_model_dir
from tests.support.disk_blocks import BLOCK, block_hash, fill, payload, readable

FP = hashlib.sha256(b"router-reset").digest()
BS = 4


def _store(d, seg: int = 8192, queue_blocks: int = 256) -> DiskStore:
    cfg = DiskTierConfig(str(d), parse_size("8MiB"), segment_bytes=seg,
                         queue_blocks=queue_blocks)
    return DiskStore(cfg, FP, FP.hex()[:24], BLOCK)


def test_disk_store_clear_drops_every_block_it_may(tmp_path):
    s = _store(tmp_path)
    fill(s, range(30))  # several closed segments and one active
    assert len(s) == 30 and s._active is not None
    dropped = s.clear()
    assert dropped == 30 and len(s) == 0 and readable(s, range(30)) == 0
    s.flush()  # the writer has dropped its active segment
    assert s._active is None and not list(s.dir.glob("*.kvs"))
    fill(s, range(30, 35))  # writes go on, into a new segment
    assert readable(s, range(30, 35)) == 5
    s.close()
    again = _store(tmp_path)  # nothing cleared comes back at the next start
    assert readable(again, range(30)) == 0 and readable(again, range(30, 35)) == 5
    again.close()


def test_disk_store_clear_keeps_another_writers_active_segment(tmp_path):
    a, b = _store(tmp_path), _store(tmp_path)
    fill(a, range(10))
    fill(b, range(10, 20))
    a.refresh(force=True)
    assert readable(a, range(20)) == 20
    in_b_active = b._count_indexed(b._active[1])
    assert 0 < in_b_active < 10  # b closed segments too: those are deleted like a's
    a.clear()
    a.flush()
    a.refresh(force=True)
    assert readable(a, range(10)) == 0
    assert readable(a, range(10, 20)) == in_b_active  # b writes that one: shared, kept
    assert (b.dir / b._active[1]).exists()
    a.close()
    b.close()


def test_disk_store_clear_drops_queued_writes_and_answers_flushes(tmp_path, monkeypatch):
    s = _store(tmp_path)
    gate = threading.Event()
    write = s._write
    monkeypatch.setattr(s, "_write", lambda h, p: (gate.wait(10), write(h, p)))
    for i in range(5):
        assert s.submit(block_hash(i), payload(block_hash(i)))
    waiter = threading.Thread(target=s.flush)
    waiter.start()
    s.clear()  # the four still queued and the flush marker go; the writer's one in hand stays
    waiter.join(10)
    assert not waiter.is_alive()
    gate.set()
    s.flush()
    assert readable(s, range(1, 5)) == 0
    s.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.fixture
def llm(tiny, tmp_path):
    with LLM(str(tiny), dtype="float32", block_size=BS, kv_cache_memory=2**21,
             swap_space=2**20 / 2**30, kv_disk_dir=str(tmp_path / "kv"),
             kv_disk_size="8MiB") as llm:
        yield llm


PROMPT = [random.Random(3).randrange(1, 256) for _ in range(41)]  # ten full blocks


def _cached(llm: LLM, prompt=PROMPT) -> int:
    out = llm.generate([prompt], [SamplingParams(temperature=0, max_tokens=2,
                                                 ignore_eos=True)])[0]
    llm.engine.kv.check_integrity()
    return out.num_cached_tokens


def _spill_to_host(llm: LLM) -> None:
    """Other prompts until the device pool reused the prompt's blocks (spilled to the host)."""
    rng = random.Random(5)
    for _ in range(40):
        _cached(llm, [rng.randrange(1, 256) for _ in range(200)])


def test_reset_of_every_tier_makes_the_next_prompt_a_miss(llm):
    core = llm.engine
    assert core.cache_tiers() == ["device", "host", "disk"]
    assert _cached(llm) == 0
    assert _cached(llm) == 40  # a device hit
    core.disk.store.flush()
    dropped = core.reset_prefix_cache()
    assert set(dropped) == {"device", "host", "disk"}
    assert dropped["device"] >= 10 and dropped["disk"] >= 10
    assert not core.kv.pool.cached and not core.kv.host.pool.cached and len(core.disk.store) == 0
    core.kv.check_integrity()
    assert _cached(llm) == 0  # computed again


def test_a_named_tier_alone_is_dropped(llm):
    core = llm.engine
    _cached(llm)
    core.disk.store.flush()
    dropped = core.reset_prefix_cache(["device"])
    assert list(dropped) == ["device"] and dropped["device"] >= 10
    assert len(core.disk.store) >= 10
    assert _cached(llm) == 40  # read back from the disk tier (through host memory)
    core.disk.store.flush()
    _spill_to_host(llm)
    assert core.kv.host.pool.cached
    dropped = core.reset_prefix_cache(["host", "disk"])
    assert dropped["host"] > 0 and dropped["disk"] > 0 and "device" not in dropped
    core.disk.store.flush()  # a block the writer had in hand went with its segment
    assert not core.kv.host.pool.cached and len(core.disk.store) == 0
    core.kv.check_integrity()


def test_unknown_tier_is_refused(llm):
    with pytest.raises(ValueError, match="no remote KV tier.*device, host, disk"):
        llm.engine.reset_prefix_cache(["remote"])


def test_blocks_of_a_running_request_are_kept(llm):
    core = llm.engine
    core.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    core.step()  # the prompt is computed and its full blocks named, held by the request
    held = {h for h, b in core.kv.pool.cached.items() if b.ref_count > 0}
    assert len(held) >= 10
    core.reset_prefix_cache()
    assert held <= set(core.kv.pool.cached)
    while core.has_unfinished_requests():
        core.step()
        core.kv.check_integrity()
    assert _cached(llm) == 40  # freed after the reset: a hit again
