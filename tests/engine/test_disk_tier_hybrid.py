"""The disk KV tier under a hybrid KV cache (sliding-window and full layers, one block table per
group): after a restart a prompt's blocks come back from disk in every group -- a full group's
whole chain, a window group's last window only -- and greedy tokens equal HF transformers';
a prompt sharing only an early prefix resumes from blocks its window groups gave back while the
first prompt was still being prefilled (written through all the same); both write policies."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.kv_cache.disk.build import engine_fingerprint
from engine.kv_cache.hybrid import HybridKVCacheManager
from engine.loading.hf_reference import hf_greedy, load_hf
from engine.loading.tiny import make_tiny_model_dir
from tests.support.tiny_models import make_hybrid_qwen2

BS = 4
WINDOW = 8
NEW = 5


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path = make_hybrid_qwen2(tmp_path_factory.mktemp("hyb"), WINDOW)
    hf = load_hf(path)
    rng = random.Random(11)
    long = [rng.randrange(0, 256) for _ in range(41)]
    # shares 24 tokens (6 blocks) with `long`: its window groups need blocks 4 and 5, which
    # slid out of their window while `long` was prefilled in one step
    early = long[:24] + [rng.randrange(0, 256) for _ in range(9)]
    prompts = [long, early]
    return path, prompts, [hf_greedy(hf, p, NEW) for p in prompts]


def _llm(path, disk, **kw) -> LLM:
    cfg = dict(dtype="float32", block_size=BS, kv_cache_memory="4MiB", quantization="none",
               kv_disk_dir=str(disk), kv_disk_size="8MiB")
    cfg.update(kw)
    return LLM(str(path), **cfg)


def _generate(llm: LLM, prompt):
    sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    out = llm.generate([prompt], [sp])[0]
    llm.engine.kv.check_integrity()
    return out.outputs[0].token_ids, out.num_cached_tokens


def _needed(kv: HybridKVCacheManager, num_tokens: int) -> int:
    """Blocks a hit of ``num_tokens`` tokens needs, all groups (a window group: its window's)."""
    k = num_tokens // BS
    return sum(len(kv.needed_blocks(k, g)) for g in range(len(kv.groups)))


@pytest.mark.parametrize("policy", ["write-through", "on-evict"])
@pytest.mark.parametrize("host", ["host-off", "host-on"])
def test_restart_serves_every_groups_blocks_and_equals_hf(hybrid, tmp_path, policy, host):
    path, prompts, expected = hybrid
    disk = tmp_path / "disk"
    kw = {"kv_disk_write_policy": policy}
    if host == "host-on":
        kw["swap_space"] = 2**20 / 2**30
    with _llm(path, disk, **kw) as llm:  # cold: the long prompt alone, then written
        assert isinstance(llm.engine.kv, HybridKVCacheManager)
        # a block of tokens is one record per group: the writer's queue holds as many blocks
        assert llm.engine.disk.store.config.queue_blocks == 256 * len(llm.engine.kv.groups)
        assert _generate(llm, prompts[0]) == (expected[0], 0)
        fingerprint = next(disk.glob("kv-*")).name
    with _llm(path, disk, **kw) as llm:  # restarted: both prompts from disk
        kv = llm.engine.kv
        found = llm.stats()["disk_blocks_at_start"]
        assert found > 0 and f"({found * BS // len(kv.groups)} tokens)" in llm.engine.disk.describe()
        assert next(disk.glob("kv-*")).name == fingerprint
        tokens, cached = _generate(llm, prompts[0])
        assert tokens == expected[0] and cached == (len(prompts[0]) - 1) // BS * BS
        stats = llm.stats()
        # every group's share came from disk: the full groups' whole chain, the window
        # groups' last blocks only (fewer than the whole chain: released blocks are not read);
        # the prompt's tokens counted once, not once per group
        assert stats["disk_hit_blocks"] == _needed(kv, cached) < len(kv.groups) * cached // BS
        assert stats["disk_hit_tokens"] == stats["prefix_cache_host_hits"] == cached
        assert stats["disk_dropped_writes"] == 0
        tokens, cached = _generate(llm, prompts[1])
        assert tokens == expected[1] and cached == 24
        after = llm.stats()
        # its full groups' blocks were on the device; its window groups' (blocks 4 and 5, which
        # slid out while the long prompt was prefilled) came from disk
        assert after["disk_hit_blocks"] - stats["disk_hit_blocks"] == 2
        assert after["disk_hit_tokens"] - stats["disk_hit_tokens"] == 2 * BS
        assert after["disk_checksum_failures"] == 0


def test_the_fingerprint_names_the_groups(hybrid, tmp_path):
    """A hybrid engine's blocks are filed under a fingerprint naming its KV groups (a block holds
    one group's layers); a one-group engine's fingerprint is what it was before groups existed,
    so directories written then are still read."""
    path, _, _ = hybrid
    with _llm(path, tmp_path / "a") as llm:
        fp = engine_fingerprint(llm.engine.config, llm.engine)
        assert fp.kv_layout == llm.engine.runner.kv_format.layout + "|groups=0,3:None;1,2:8"
    flat = make_tiny_model_dir(tmp_path / "llama", "llama")
    with LLM(str(flat), dtype="float32", block_size=BS, kv_cache_memory="4MiB",
             kv_disk_dir=str(tmp_path / "b"), kv_disk_size="8MiB") as llm:
        fp = engine_fingerprint(llm.engine.config, llm.engine)
        assert fp.kv_layout == llm.engine.runner.kv_format.layout
