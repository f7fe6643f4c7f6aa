"""``benchmarks/kv_summaries.py``: the measurement that decided pooled summaries of evicted
history are not built (docs/performance.md#pooled-summaries-of-evicted-history). Its cache
policies run in HF transformers, so these tests tie them to the engine and to each other on a
tiny random Llama (block 4, one sink block):

* its plain ``sink+window`` cache is kvserve's ``--kv-eviction``: teacher-forced on the
  engine's own greedy output, its argmax at every place is the engine's token;
* a summary of ``block`` vectors per block (one token each, log-weight 0) is exactly a wider
  window: pooling, re-rotation and the oldest-first cap move keys as the K-shift does;
* before the first eviction every variant is the uncut cache, and the log-weight is applied.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.loading.hf_reference import load_hf
from engine.loading.tiny import make_tiny_model_dir

BS, SINK = 4, 4
PROMPT = [5, 9, 33, 77, 12, 40]
_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "kv_summaries.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("kv_summaries_bench", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = make_tiny_model_dir(tmp_path_factory.mktemp("summ"), "llama")
    return path, load_hf(path)


def _run(bench, hf, ids, variant):
    return bench.forced(hf, ids, variant, SINK, BS, prompt=len(PROMPT))


def test_plain_window_is_the_engines_streaming_eviction(bench, llama):
    path, hf = llama
    llm = LLM(str(path), dtype="float32", block_size=BS, kv_cache_memory="4MiB",
              max_model_len=64, kv_eviction=f"sink:{SINK},window:16")
    new = 120  # about 2x max_model_len: many evictions
    tokens = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=new,
                                                   ignore_eos=True))[0].outputs[0].token_ids
    assert llm.stats()["num_blocks_evicted_stream"] > 10
    _, top = _run(bench, hf, PROMPT + list(tokens), bench.Variant(16))
    assert top == list(tokens)


def test_one_vector_per_token_summaries_are_a_wider_window(bench, llama):
    _, hf = llama
    ids = [int(x) for x in torch.randint(3, 200, (100,), generator=torch.Generator().manual_seed(1))]
    ids[:len(PROMPT)] = PROMPT
    wide, _ = _run(bench, hf, ids, bench.Variant(16))
    summ, _ = _run(bench, hf, ids, bench.Variant(8, 8, BS))
    torch.testing.assert_close(torch.tensor(summ), torch.tensor(wide), atol=2e-4, rtol=0)


def test_before_the_first_eviction_all_variants_are_the_uncut_cache(bench, llama):
    _, hf = llama
    ids = [int(x) for x in torch.randint(3, 200, (60,), generator=torch.Generator().manual_seed(2))]
    with torch.no_grad():
        full = hf(input_ids=torch.tensor([ids])).logits[0].log_softmax(-1)
    ref = [float(full[i - 1, ids[i]]) for i in range(len(PROMPT), len(ids))]
    logw, _ = _run(bench, hf, ids, bench.Variant(8, 8, 2))
    nolog, _ = _run(bench, hf, ids, bench.Variant(8, 8, 2, nolog=True))
    first = (1 + 2 + 1) * BS  # sink block + 2 window blocks + the one being filled
    n = first + 1 - len(PROMPT)
    torch.testing.assert_close(torch.tensor(logw[:n]), torch.tensor(ref[:n]), atol=1e-5, rtol=0)
    assert logw[:n] == nolog[:n]
    assert logw[n:] != nolog[n:]  # the log-weight reaches the scores once summaries exist
    assert logw[n:] != ref[n:]
