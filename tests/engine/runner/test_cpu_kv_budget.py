"""The CPU path's default KV budget follows the memory available (a share within a floor and a
ceiling), ``auto`` KV pools are 16-bit on a CPU, an idle pool holds no resident memory, and a
served pool's first blocks are written before the first request."""

from __future__ import annotations

import torch

from engine.kv_format.formats import kv_format, resolve_kv_cache_dtype
from engine.runner import cpu_memory
from engine.runner.cpu_memory import CPU_KV_CEILING, CPU_KV_FLOOR, CPU_KV_SHARE, cpu_kv_budget
from engine.runner.cpu_pool import zeroed_pool as _zeros

GIB = 1024**3


def test_the_budget_is_a_share_of_available_memory_within_floor_and_ceiling():
    assert cpu_kv_budget(8 * GIB).budget == int(CPU_KV_SHARE * 8 * GIB)
    assert cpu_kv_budget(512 * 1024**2).budget == CPU_KV_FLOOR
    assert cpu_kv_budget(256 * GIB).budget == CPU_KV_CEILING
    assert "available memory" in cpu_kv_budget(8 * GIB).describe()
    assert "(the ceiling)" in cpu_kv_budget(256 * GIB).describe()


def test_the_default_reads_memavailable(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:  100 kB\n"
                       "MemAvailable:    4194304 kB\n")
    assert cpu_memory.available_ram_bytes(meminfo) == 4 * GIB
    monkeypatch.setattr(cpu_memory, "available_ram_bytes", lambda: 10 * GIB)
    assert cpu_kv_budget().budget == int(CPU_KV_SHARE * 10 * GIB)


def test_the_embedded_model_gets_16_concurrent_8k_sequences_on_a_laptop():
    """SmolLM2-135M: 30 layers x 3 KV heads x 64 x (K, V) x 2 bytes = 23,040 bytes a token at
    float16. On a machine with 24 GiB available the default holds >= 16 x 8,192 tokens."""
    per_token = 30 * 3 * 64 * 2 * 2
    assert cpu_kv_budget(24 * GIB).budget // per_token >= 16 * 8192


def test_auto_is_16_bit_on_cpu_unless_float32_was_asked_for():
    assert resolve_kv_cache_dtype("auto", torch.float32, "cpu")[0] == "float16"
    assert resolve_kv_cache_dtype("auto", torch.float32, "cpu", "float32")[0] == "float32"
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, "cpu")[0] == "bfloat16"
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, "cuda")[0] == "bfloat16"
    assert resolve_kv_cache_dtype("float32", torch.float32, "cpu")[0] == "float32"
    assert kv_format("float32", torch.float32, 64).storage_dtype == torch.float32
    try:
        kv_format("float32", torch.bfloat16, 64)
    except ValueError as exc:
        assert "float32 model" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("float32 KV under a bf16 model must be refused")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_an_idle_cpu_pool_holds_no_resident_memory():
    before = _rss_bytes()
    pool = _zeros((4096, 16, 8, 128), torch.bfloat16, torch.device("cpu"))  # 128 MiB
    assert pool.shape == (4096, 16, 8, 128) and pool.dtype == torch.bfloat16
    assert _rss_bytes() - before < 32 * 1024**2
    assert float(pool[123].abs().sum()) == 0.0
    pool[:64].fill_(1.0)  # written blocks become resident, the rest stay free
    assert float(pool[:64].sum()) == 64 * 16 * 8 * 128
    assert _rss_bytes() - before < 64 * 1024**2


def _present(t: torch.Tensor, offset: int) -> bool:
    """Whether the page holding byte ``offset`` of ``t`` is in memory (/proc/self/pagemap)."""
    page = (t.data_ptr() + offset) // 4096
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(page * 8)
        return bool(int.from_bytes(f.read(8), "little") >> 63)


def test_the_pools_first_blocks_are_written_before_serving_and_the_rest_are_not(tmp_path):
    """Issue 66 item 7: the first request after a start does not pay the pools' first page
    faults (one per layer's K and V); the rest of each pool stays unbacked."""
    from engine.llm import LLM
    from engine.loading.tiny import make_tiny_model_dir
    from engine.runner.cpu_pool import POOL_HEAD_BYTES

    model = make_tiny_model_dir(tmp_path / "tiny", "llama", max_position_embeddings=256)
    with LLM(str(model), dtype="float32", kv_cache_memory="64MiB", max_model_len=128) as llm:
        pools = [t for pair in llm.engine.runner.kv_caches for t in pair]
        assert pools and all(t.numel() * t.element_size() > 8 * 1024**2 for t in pools)
        for t in pools:
            assert _present(t, 0) and _present(t, POOL_HEAD_BYTES - 1)
            assert not _present(t, t.numel() * t.element_size() - 1)
