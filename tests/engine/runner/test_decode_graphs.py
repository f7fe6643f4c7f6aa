"""The CUDA-graph decode path's bookkeeping, run without CUDA: buckets, the static input layout
and the padding rows. ``DecodeGraphs.capture(use_graphs=False)`` prepares every bucket and
``run`` pads a decode batch into the static buffers and runs it eagerly, which is exactly what a
replay computes; greedy tokens must equal the plain eager engine's."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.loading.tiny import make_tiny_model_dir
from engine.runner.cuda_graphs import DecodeGraphs, bucket_for, capture_sizes

PROMPTS = [[7, 3, 250, 11, 42], list(range(40, 61)), [99], list(range(200, 213)), [5, 6]]


def test_capture_sizes_cover_every_batch():
    sizes = capture_sizes(100)
    assert sizes[0] == 1 and sizes[-1] == 100 and sizes == sorted(set(sizes))
    assert all(bucket_for(b, sizes) >= b for b in range(1, 101))
    assert bucket_for(101, sizes) is None
    assert bucket_for(3, sizes) == 4 and bucket_for(17, sizes) == 24
    assert capture_sizes(1) == [1]
    assert capture_sizes(4096)[-1] == 512  # capped: larger decode batches run eagerly


def _generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def _with_static_decode(llm: LLM, sizes: list[int], splits: int | None) -> DecodeGraphs:
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner._forward, runner.device, sizes, llm.config.block_size,
                          runner.max_model_len, (lambda b: splits) if splits else None)
    graphs.capture(use_graphs=False)
    runner.graphs = graphs
    return graphs


@pytest.mark.parametrize("backend,splits", [
    ("torch", None),
    pytest.param("triton", 3, marks=pytest.mark.slow),
])
def test_padded_static_decode_matches_eager(tmp_path, backend, splits, monkeypatch):
    monkeypatch.setenv("KVSERVE_CPU_KERNELS", "0")  # the PyTorch decode path, which pads too
    path = make_tiny_model_dir(tmp_path / "llama", "llama")
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    cfg = dict(dtype="float32", device=device, block_size=4, kv_cache_memory="4MiB",
               attention_backend=backend, max_model_len=64)
    expected = _generate(LLM(str(path), **cfg))
    llm = LLM(str(path), **cfg)
    graphs = _with_static_decode(llm, [1, 2, 4, 8], splits)
    calls = []
    run = graphs.run
    graphs.run = lambda inp: calls.append(inp.num_seqs) or run(inp)
    assert _generate(llm) == expected
    assert calls and max(calls) == len(PROMPTS)  # batches of 5 ran padded to the bucket of 8
    llm.engine.kv.check_integrity()
    assert llm.stats()["num_blocks_used"] == 0
