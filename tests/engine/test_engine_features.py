"""Engine behaviour beyond greedy parity: seeds, logprobs, stops, aborts, bad input."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.loading.hf_reference import load_hf
from engine.loading.tiny import make_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("llama"), "llama", seed=1)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", block_size=4, kv_cache_memory="8MiB")


PROMPT = list(b"The quick brown fox")


def test_seeded_sampling_is_reproducible_in_any_batch(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([PROMPT], p)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (3, 9, 5)]
    batch = llm.generate([list(b"xyz"), PROMPT, list(b"hello"), list(b"a")], [others[0], p,
                                                                             *others[1:]])
    assert batch[1].outputs[0].token_ids == alone
    different = llm.generate([PROMPT], p.clone(seed=4321))[0].outputs[0].token_ids
    assert different != alone


def test_logprobs_match_hf_distribution(llm, model_dir):
    hf = load_hf(model_dir)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3, logprobs=2,
                                                prompt_logprobs=1, ignore_eos=True))[0]
    ids = PROMPT + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    comp = out.outputs[0]
    assert len(comp.logprobs) == 3
    for i, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        pos = len(PROMPT) - 1 + i
        assert entry[tok].rank == 1  # greedy picks the top token
        assert entry[tok].logprob == pytest.approx(float(ref[pos, tok]), abs=1e-4)
        top2 = torch.topk(ref[pos], 2).indices.tolist()
        assert set(top2) <= set(entry)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(PROMPT)
    for pos in range(1, len(PROMPT)):
        entry = out.prompt_logprobs[pos]
        assert entry[PROMPT[pos]].logprob == pytest.approx(float(ref[pos - 1, PROMPT[pos]]),
                                                           abs=1e-4)


def test_stop_string_is_removed_and_never_leaks(llm):
    free = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16,
                                                 ignore_eos=True))[0].outputs[0].text
    assert len(free) > 4
    stop = free[3:5]
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, stop=[stop],
                                                ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free[:free.index(stop)]


def test_stop_token_ids_and_min_tokens(llm):
    free = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10,
                                                 ignore_eos=True))[0].outputs[0].token_ids
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10,
                                                stop_token_ids=[free[2]]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == free[2]
    assert out.token_ids == free[:free.index(free[2]) + 1]


def test_abort_frees_blocks_and_reports(llm):
    engine = llm.engine
    engine.add_request("a1", PROMPT, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("a2", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    assert engine.stats().num_blocks_used > 0
    engine.abort_request(["a1", "a1", "unknown"])
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["a1"].outputs[0].finish_reason == "abort"
    assert finals["a2"].outputs[0].finish_reason == "length"
    assert engine.stats().num_blocks_used == 0
    engine.kv.check_integrity()


@pytest.mark.parametrize("prompt,params,message", [
    ([], SamplingParams(), "empty"),
    ([1] * 500, SamplingParams(max_tokens=100), "maximum context length is 512"),
    ([999999], SamplingParams(), "outside the vocabulary"),
    ([1, 2], SamplingParams(logprobs=50), "logprobs"),
])
def test_bad_requests_are_rejected_clearly(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request("bad", prompt, params)
    assert not llm.engine.has_unfinished_requests()


def test_request_larger_than_pool_is_rejected(model_dir):
    small = LLM(str(model_dir), dtype="float32", block_size=4, kv_cache_memory=512 * 4 * 8)
    with pytest.raises(ValueError, match="whole pool holds 32"):
        small.engine.add_request("big", list(range(30)), SamplingParams(max_tokens=10))
