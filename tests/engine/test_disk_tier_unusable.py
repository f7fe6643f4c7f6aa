"""An engine whose --kv-disk-dir cannot be used at start (here: a path under a regular file,
which stops root as well as anyone) starts and serves without the tier, greedy outputs equal
to HF transformers' own, says so once and in its stats; once the directory works, the tier's
retry finds it, blocks are written, and a restart serves them from disk. This is the path
``kvserve serve`` takes to build its engine (``EngineCore`` -> ``build_disk_tier``), which used
to raise and exit with status 2."""

from __future__ import annotations

import logging
import random
import time

import pytest

from engine import LLM, SamplingParams
from engine.loading.hf_reference import hf_greedy, load_hf
from engine.loading.tiny import make_tiny_model_dir

BS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_model_dir(tmp_path_factory.mktemp("llama"), "llama")
    hf = load_hf(path)
    rng = random.Random(5)
    prompts = [[rng.randrange(0, 256) for _ in range(n)] for n in (41, 26)]
    return path, prompts, [hf_greedy(hf, p, 5) for p in prompts]


def _llm(path, disk) -> LLM:
    return LLM(str(path), dtype="float32", block_size=BS, kv_cache_memory=2**21,
               kv_disk_dir=str(disk), kv_disk_size="8MiB")


def _run(llm: LLM, prompts):
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = llm.generate(prompts, [sp] * len(prompts))
    llm.engine.kv.check_integrity()
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def test_unusable_dir_starts_serves_and_resumes(tiny, tmp_path, caplog):
    path, prompts, expected = tiny
    blocker = tmp_path / "file"
    blocker.write_text("x")
    disk = blocker / "kv"
    caplog.set_level(logging.INFO, logger="kvserve.engine")
    with _llm(path, disk) as llm:  # today: ValueError "... is not a writable directory"
        outs, _ = _run(llm, prompts)
        assert outs == expected
        stats = llm.stats()
        assert not stats["disk_available"] and stats["disk_written_blocks"] == 0
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                  and str(disk) in r.getMessage()]
        assert len(warned) == 1 and "Not a directory" in warned[0]
        blocker.unlink()  # the directory becomes usable
        store = llm.engine.disk.store
        store.health.clock = lambda: time.monotonic() + 3600  # the retry is due
        store.flush()
        assert llm.stats()["disk_available"]
        outs, _ = _run(llm, [p + [1, 2, 3, 4] for p in prompts])
        store.flush()
        assert llm.stats()["disk_written_blocks"] > 0
    with _llm(path, disk) as llm:
        outs, cached = _run(llm, prompts)
        assert llm.stats()["disk_available"]
    assert outs == expected and min(cached) > 0
