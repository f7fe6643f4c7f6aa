"""Hostile or unlucky requests against the real engine on tiny random models: ids past the
tokenizer, per-request failures inside a step, prompt logprobs in chunks and across a recompute
preemption, requests whose samples can never fit the pool, admission limits.
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.loading.hf_reference import load_hf
from engine.loading.tiny import make_tiny_model_dir

BLOCK_BYTES = 512 * 4  # tiny llama, float32: 512 bytes per token, 4 tokens per block


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("llama"), "llama", seed=2)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", block_size=4, kv_cache_memory="8MiB")


def _drain(engine) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def _assert_clean(llm: LLM) -> None:
    llm.engine.kv.check_integrity()
    assert llm.stats()["num_blocks_used"] == 0
    assert not llm.engine.has_unfinished_requests()


# ---- ids the tokenizer does not know (Qwen-style padded embedding) ---------------------------


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    # Vocabulary 260; the tokenizer knows 259 ids (bytes, <s>, </s>, Qwen's <|endoftext|>):
    # id 259 exists only in the model.
    path = make_tiny_model_dir(tmp_path_factory.mktemp("qwen2"), "qwen2")
    return LLM(str(path), dtype="float32", block_size=4, kv_cache_memory="4MiB")


@pytest.mark.parametrize("prompt, params, where", [
    ([72, 259], SamplingParams(max_tokens=2, prompt_logprobs=0, logprobs=0), "the prompt"),
    ([72, 73], SamplingParams(max_tokens=2, logit_bias={259: 5.0}), "logit_bias"),
    ([72, 73], SamplingParams(max_tokens=2, stop_token_ids=[1, 259]), "stop_token_ids"),
])
def test_ids_past_the_tokenizer_are_refused_naming_id_and_bound(qwen, prompt, params, where):
    core = qwen.engine
    assert core.vocab_size == 260 and core.token_id_bound == 259
    with pytest.raises(ValueError, match=rf"(259 in {where}|{where} names token 259).*"
                                         rf"outside the vocabulary \(0\.\.258\)"):
        core.add_request("bad", prompt, params)
    assert not core.has_unfinished_requests()
    # The engine still serves, logprobs and all.
    out = qwen.generate([[72, 258]], SamplingParams(max_tokens=3, prompt_logprobs=2, logprobs=2,
                                                    ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.prompt_logprobs) == 2


# ---- per-request failures inside a step --------------------------------------------------------


def test_failure_in_one_requests_logprobs_ends_only_that_request(llm, caplog):
    core = llm.engine
    real = core.token_text
    core.token_text = lambda t: (_ for _ in ()).throw(KeyError(f"no text for {t}"))
    try:
        core.add_request("victim", [5, 6, 7], SamplingParams(max_tokens=6, logprobs=1,
                                                             ignore_eos=True))
        core.add_request("other", [8, 9], SamplingParams(max_tokens=6, ignore_eos=True))
        finals = _drain(core)
    finally:
        core.token_text = real
    victim, other = finals["victim"], finals["other"]
    assert victim.outputs[0].finish_reason == "abort"
    assert victim.error and "KeyError" in victim.error
    assert other.error is None and other.outputs[0].finish_reason == "length"
    assert len(other.outputs[0].token_ids) == 6
    assert "victim" in caplog.text and "Traceback" in caplog.text
    _assert_clean(llm)
    after = llm.generate([[1, 2]], SamplingParams(max_tokens=2, logprobs=1, ignore_eos=True))
    assert after[0].outputs[0].finish_reason == "length" and after[0].error is None


def test_failure_in_stop_checks_or_sampling_ends_only_that_request(llm, monkeypatch):
    from engine.sampling import penalties

    core = llm.engine
    core.add_request("stopper", [5, 6], SamplingParams(n=2, max_tokens=5, ignore_eos=True))
    core.add_request("biased", [5, 7], SamplingParams(max_tokens=5, logit_bias={3: 1.0},
                                                      ignore_eos=True))
    core.add_request("fine", [5, 8], SamplingParams(max_tokens=5, ignore_eos=True))
    seq = core.requests["stopper"].seqs[1]
    seq.text_state.append = lambda token: 1 / 0
    real_bias = penalties.apply_logit_bias

    def broken_bias(logits, rows):
        if any(r.params.logit_bias for r in rows):
            raise RuntimeError("bias exploded")
        real_bias(logits, rows)

    monkeypatch.setattr(penalties, "apply_logit_bias", broken_bias)
    finals = _drain(core)
    assert [c.finish_reason for c in finals["stopper"].outputs] == ["abort", "abort"]
    assert "ZeroDivisionError" in finals["stopper"].error
    assert finals["biased"].outputs[0].finish_reason == "abort"
    assert "bias exploded" in finals["biased"].error
    assert finals["fine"].error is None and len(finals["fine"].outputs[0].token_ids) == 5
    _assert_clean(llm)


def test_a_failing_forward_pass_is_not_swallowed(llm, monkeypatch):
    core = llm.engine
    monkeypatch.setattr(core.runner, "execute", lambda inp, *args, **kwargs: 1 / 0)
    core.add_request("x", [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(ZeroDivisionError):
        core.step()
    monkeypatch.undo()
    core.abort_request(["x"])
    core.step()
    _assert_clean(llm)


# ---- prompt logprobs: chunked, and across a recompute preemption ---------------------------


PROMPT = list(b"Prompt logprobs come in chunks of rows")


def test_prompt_logprobs_in_small_chunks_equal_one_piece_and_hf(llm, model_dir, monkeypatch):
    import torch

    import engine.runner.model_runner as mr

    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, ignore_eos=True)
    whole = llm.generate([PROMPT], params)[0].prompt_logprobs
    rows = []
    real = llm.engine.runner.model.compute_logits
    monkeypatch.setattr(mr, "PROMPT_LOGPROB_CHUNK", 5)
    monkeypatch.setattr(llm.engine.runner.model, "compute_logits",
                        lambda h: rows.append(h.shape[0]) or real(h))
    chunked = llm.generate([PROMPT], params)[0].prompt_logprobs
    assert max(rows) == 5 and sum(r for r in rows if r > 1) >= len(PROMPT) - 5
    assert len(chunked) == len(whole) == len(PROMPT) and chunked[0] is None
    hf = load_hf(model_dir)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0].float(), -1)
    for pos in range(1, len(PROMPT)):
        assert chunked[pos].keys() == whole[pos].keys()
        for tok, lp in chunked[pos].items():
            assert lp.rank == whole[pos][tok].rank
            assert lp.logprob == pytest.approx(whole[pos][tok].logprob, abs=1e-5)
            assert lp.logprob == pytest.approx(float(ref[pos - 1, tok]), abs=1e-4)


def test_prompt_logprobs_survive_a_recompute_preemption_during_prefill(model_dir):
    """A 52-token prompt with prompt logprobs prefills in 7-token chunks next to a decoding
    request; the 16-block pool runs out mid-prefill, so it is preempted (recompute) and
    starts its prefill again. Its prompt logprobs must still hold one entry per prompt token,
    equal to a run without preemption (they used to be recorded again: duplicated)."""
    prompt = [(i * 37 + 11) % 256 for i in range(52)]
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1, ignore_eos=True)
    free = LLM(str(model_dir), dtype="float32", block_size=4, kv_cache_memory="8MiB")
    expected = free.generate([prompt], params)[0]

    tight = LLM(str(model_dir), dtype="float32", block_size=4, kv_cache_memory=16 * BLOCK_BYTES,
                max_num_batched_tokens=8, preemption_mode="recompute")
    core = tight.engine
    core.add_request("decoder", list(range(100, 112)),
                     SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    core.add_request("echo", prompt, params)
    finals = _drain(core)
    assert tight.stats()["num_preemptions_recompute"] > 0
    got = finals["echo"]
    assert got.error is None and got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert len(got.prompt_logprobs) == len(prompt) and got.prompt_logprobs[0] is None
    for pos in range(1, len(prompt)):
        want = expected.prompt_logprobs[pos]
        assert got.prompt_logprobs[pos].keys() == want.keys()
        for tok, lp in got.prompt_logprobs[pos].items():
            assert lp.rank == want[tok].rank
            assert lp.logprob == pytest.approx(want[tok].logprob, abs=1e-5)
    _assert_clean(tight)


# ---- admission: samples that can never fit, limits, policy -------------------------------------


def test_samples_that_can_never_fit_the_pool_together_are_refused(model_dir):
    small = LLM(str(model_dir), dtype="float32", block_size=4, kv_cache_memory=16 * BLOCK_BYTES)
    prompt = list(range(20))
    small.engine.check_request(prompt, SamplingParams(n=1, max_tokens=20))
    # 4 samples x 10 blocks, sharing 4 full prompt blocks: 10 + 3 * 6 = 28 > 16.
    with pytest.raises(ValueError, match="4 samples need 28 KV blocks.*holds 16.*lower n"):
        small.engine.add_request("big-n", prompt, SamplingParams(n=4, max_tokens=20))
    small.engine.check_request(prompt, SamplingParams(n=2, max_tokens=20))  # 16: fits
    # With swap preemption the samples can wait in the host tier.
    swap = LLM(str(model_dir), dtype="float32", block_size=4, kv_cache_memory=16 * BLOCK_BYTES,
               swap_space=64 * BLOCK_BYTES / 2**30, preemption_mode="swap")
    swap.engine.check_request(prompt, SamplingParams(n=4, max_tokens=20))


def test_n_and_priority_limits_are_checked_by_the_core(model_dir):
    llm = LLM(str(model_dir), dtype="float32", block_size=4, kv_cache_memory="8MiB",
              max_num_seqs=4, max_waiting_requests=64)
    core = llm.engine
    with pytest.raises(ValueError, match="asks for 5 sequences.*at most 4"):
        core.add_request("n", [1, 2], SamplingParams(n=5, max_tokens=2))
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        core.add_request("p", [1, 2], SamplingParams(max_tokens=2), priority=1)
    assert not core.has_unfinished_requests()
    prio = LLM(str(model_dir), dtype="float32", block_size=4, kv_cache_memory="8MiB",
               scheduling_policy="priority")
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    out = prio.generate([[1, 2]], greedy)
    prio.engine.add_request("p", [1, 2], greedy, priority=-3)
    assert _drain(prio.engine)["p"].outputs[0].token_ids == out[0].outputs[0].token_ids
