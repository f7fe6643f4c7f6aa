"""The disk and remote KV tiers under tensor parallelism (2 gloo ranks on the CPU, a tiny random
Llama whose 2 KV heads split one per rank): every rank stores its own share of each block under
a fingerprint naming its rank (its own sub-directory, its own Redis key prefix). Engine A
computes the prompts and closes (its blocks written through, or at shutdown with ``on-evict``);
a fresh engine B on the same directory (or Redis server) serves them with every full block of
their prefixes cached and the greedy tokens of A's cold run. One rank's share of a block
missing or corrupt (rank 0's for one prompt, rank 1's for another) cuts that prompt's hit at
that block on every rank: the rest is recomputed, the tokens are the same, nothing fails, and
the rank that lost its share writes it again. Both ranks writing one key (the rank dropped from
the fingerprint) fails these tests: one share directory or key prefix instead of two, and each
rank reading the other's heads."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from engine import LLM
from engine.kv_cache.disk.build import engine_fingerprint
from engine.kv_cache.disk.segment import HEADER_BYTES, RECORD_HEADER_BYTES, SEGMENT_MAGIC, scan
from engine.loading.tiny import make_tiny_model_dir
from tests.engine.tier_runs import BS, full_prefix, run_greedy

pytestmark = pytest.mark.slow  # four 2-rank engines, spawned workers

CUT = (7, 5)  # the block whose share goes missing: rank 0's in prompt 1, rank 1's in prompt 2
BASE = dict(dtype="float32", block_size=BS, kv_cache_memory="8MiB", num_threads=1,
            distributed_timeout=60, tensor_parallel_size=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_model_dir(tmp_path_factory.mktemp("llama"), "llama")
    rng = random.Random(7)
    return path, [[rng.randrange(0, 256) for _ in range(n)] for n in (61, 45, 53)]


def _chain(llm: LLM, prompt) -> list[bytes]:
    return llm.engine.kv.prompt_chains(prompt)[0]


def _corrupt_disk_record(share_dir: Path, block_hash: bytes) -> None:
    """Flip a payload byte of ``block_hash``'s record in ``share_dir``'s segments."""
    for seg in share_dir.glob("*.kvs"):
        fingerprint = seg.read_bytes()[len(SEGMENT_MAGIC):HEADER_BYTES]
        for h, off, _ in scan(str(seg), fingerprint)[0]:
            if h == block_hash:
                with open(seg, "r+b") as f:
                    f.seek(off + RECORD_HEADER_BYTES + 3)
                    byte = f.read(1)
                    f.seek(off + RECORD_HEADER_BYTES + 3)
                    f.write(bytes([byte[0] ^ 0xFF]))
                return
    raise AssertionError(f"no record of {block_hash.hex()[:16]} in {share_dir}")


def _records(share_dir: Path) -> Counter:
    """How many records of each block hash ``share_dir``'s segments hold."""
    return Counter(h for seg in share_dir.glob("*.kvs")
                   for h, _, _ in scan(str(seg), seg.read_bytes()[len(SEGMENT_MAGIC):
                                                                  HEADER_BYTES])[0])


def _check_served(cold, warm, cached, prompts) -> None:
    """B's tokens are A's cold ones; prompt 0 is a whole hit, prompts 1 and 2 stop at the
    block whose share one rank lost."""
    assert warm == cold
    assert cached == [full_prefix(prompts[0]), CUT[0] * BS, CUT[1] * BS]


@pytest.mark.parametrize("policy", ["write-through", "on-evict"])
def test_disk_tier_under_tensor_parallelism(tiny, tmp_path, policy):
    """``on-evict``: every rank writes its share of what memory holds at A's shutdown."""
    path, prompts = tiny
    kv = dict(kv_disk_dir=str(tmp_path / "kv"), kv_disk_size="64MiB",
              kv_disk_write_policy=policy)
    with LLM(str(path), **BASE, **kv) as a:
        cold, cached = run_greedy(a, prompts)
        rank0 = tmp_path / "kv" / f"kv-{engine_fingerprint(a.engine.config, a.engine).hex}"
        chains = [_chain(a, p) for p in prompts]
    assert cached == [0, 0, 0]
    shares = sorted(p for p in (tmp_path / "kv").glob("kv-*") if p.is_dir())
    assert len(shares) == 2 and rank0 in shares  # one directory per rank's share
    rank1 = next(d for d in shares if d != rank0)
    for share in shares:  # every full block of every prompt, in each rank's share
        assert all(h in _records(share) for chain in chains for h in chain)
    _corrupt_disk_record(rank0, chains[1][CUT[0]])
    _corrupt_disk_record(rank1, chains[2][CUT[1]])
    with LLM(str(path), **BASE, **kv) as b:
        warm, cached = run_greedy(b, prompts)
        stats = b.stats()
    _check_served(cold, warm, cached, prompts)
    assert stats["disk_checksum_failures"] == 1  # rank 0's (rank 1 counts its own)
    # each rank wrote its lost share again when B recomputed the block
    assert _records(rank0)[chains[1][CUT[0]]] == 2
    assert _records(rank1)[chains[2][CUT[1]]] == 2


def test_remote_tier_under_tensor_parallelism(tiny, tmp_path):
    from tests.support.kv_remote_redis import RedisServer

    path, prompts = tiny
    with RedisServer(tmp_path / "redis") as srv:
        kv = dict(kv_remote_url=srv.url)
        with LLM(str(path), **BASE, **kv) as a:
            cold, cached = run_greedy(a, prompts)
            fp0 = engine_fingerprint(a.engine.config, a.engine).hex
            chains = [_chain(a, p) for p in prompts]
        assert cached == [0, 0, 0]
        client = srv.client()
        keys = [k.decode() for k in client.keys("kvserve:*")]
        prefixes = Counter(k.split(":")[1] for k in keys)
        # one key prefix per rank's share, each holding every block
        assert len(prefixes) == 2 and fp0 in prefixes
        assert len(set(prefixes.values())) == 1
        fp1 = next(p for p in prefixes if p != fp0)
        for fp in (fp0, fp1):
            assert all(f"kvserve:{fp}:{h.hex()}" in keys for chain in chains for h in chain)
        assert client.delete(f"kvserve:{fp0}:{chains[1][CUT[0]].hex()}") == 1
        assert client.delete(f"kvserve:{fp1}:{chains[2][CUT[1]].hex()}") == 1
        with LLM(str(path), **BASE, **kv) as b:
            warm, cached = run_greedy(b, prompts)
            stats = b.stats()
        # each rank wrote its lost share again when B recomputed the block
        assert client.exists(f"kvserve:{fp0}:{chains[1][CUT[0]].hex()}",
                             f"kvserve:{fp1}:{chains[2][CUT[1]].hex()}") == 2
    _check_served(cold, warm, cached, prompts)
    assert stats["remote_available"] and stats["remote_errors"] == 0
