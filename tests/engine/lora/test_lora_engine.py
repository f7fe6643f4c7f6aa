"""LoRA adapters in the engine: greedy tokens equal HF + PEFT's merged model per adapter, in one
mixed batch of three adapters and the base model; prefixes are shared within an adapter and
never across; slots are bounded by ``max_loras``; unloading keeps running requests whole; the
KV events carry the adapter."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.loading.hf_reference import hf_greedy, load_hf
from engine.loading.tiny import make_tiny_model_dir
from tests.engine.lora.peft_adapters import ALL_TARGETS, make_peft_adapter

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    base = make_tiny_model_dir(tmp_path_factory.mktemp("base"), "llama")
    out = tmp_path_factory.mktemp("adapters")
    adapters = [
        make_peft_adapter(base, out, "qv", seed=1, r=4, alpha=8, targets=["q_proj", "v_proj"]),
        make_peft_adapter(base, out, "all", seed=2, r=8, alpha=16, targets=ALL_TARGETS),
        make_peft_adapter(base, out, "mlp", seed=3, r=2, alpha=4, use_rslora=True,
                          targets=["o_proj", "up_proj", "down_proj"]),
    ]
    return base, load_hf(base), adapters


def _engine(base, adapters, **overrides) -> LLM:
    cfg = dict(dtype="float32", block_size=4, kv_cache_memory="8MiB", enable_lora=True,
               lora_modules=[f"{a.name}={a.path}" for a in adapters])
    cfg.update(overrides)
    return LLM(str(base), **cfg)


def _greedy(k: int, lora: str | None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=k, ignore_eos=True, lora_name=lora)


@pytest.mark.parametrize("max_loras", [4, 1], ids=["all-resident", "one-slot"])
def test_mixed_batch_matches_hf_peft(lora_setup, max_loras):
    """Three adapters and the base in one batch (and, with one slot, taking turns)."""
    base, hf, adapters = lora_setup
    rng = random.Random(0)
    prompts = [[rng.randrange(0, 256) for _ in range(rng.randint(3, 30))] for _ in range(8)]
    which = [None, 0, 1, 2, 0, 1, 2, None]
    expected = [hf_greedy(hf if w is None else adapters[w].merged, p, 8)
                for p, w in zip(prompts, which)]
    llm = _engine(base, adapters, max_loras=max_loras)
    outs = llm.generate(prompts, [_greedy(8, None if w is None else adapters[w].name)
                                  for w in which])
    assert [o.outputs[0].token_ids for o in outs] == expected
    # the adapters do change the tokens: the test would catch a delta that was never added
    assert expected[1] != hf_greedy(hf, prompts[1], 8)
    llm.engine.kv.check_integrity()
    assert llm.stats()["num_blocks_used"] == 0
    slots = llm.engine.adapters.slots
    assert all(pins == 0 for _, _, pins in slots.resident())
    assert len(slots.resident()) <= max_loras
    if max_loras == 1:
        assert slots.num_loads >= 3


def test_prefix_cached_under_one_adapter_is_no_hit_for_another(lora_setup):
    base, hf, adapters = lora_setup
    qv, full = adapters[0], adapters[1]
    prompt = list(range(100, 140)) + [7, 8]  # 10 full blocks of 4, then 2 tokens
    llm = _engine(base, adapters)
    first = llm.generate([prompt], _greedy(6, qv.name))[0]
    assert first.num_cached_tokens == 0
    other = llm.generate([prompt], _greedy(6, full.name))[0]
    assert other.num_cached_tokens == 0, "a prefix computed under adapter A served adapter B"
    assert other.outputs[0].token_ids == hf_greedy(full.merged, prompt, 6)
    plain = llm.generate([prompt], _greedy(6, None))[0]
    assert plain.num_cached_tokens == 0
    assert plain.outputs[0].token_ids == hf_greedy(hf, prompt, 6)
    again = llm.generate([prompt], _greedy(6, qv.name))[0]
    assert again.num_cached_tokens == 40  # shared within the adapter
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == hf_greedy(
        qv.merged, prompt, 6)


def test_same_weights_under_another_name_share_the_prefix(lora_setup, tmp_path):
    """The cache key is the adapter's arithmetic, not its name."""
    base, _, adapters = lora_setup
    prompt = list(range(50, 70))
    llm = _engine(base, adapters[:1])
    llm.load_lora_adapter("twin", str(adapters[0].path))
    a = llm.generate([prompt], _greedy(4, adapters[0].name))[0]
    b = llm.generate([prompt], _greedy(4, "twin"))[0]
    assert b.num_cached_tokens == 16 and a.outputs[0].token_ids == b.outputs[0].token_ids


def test_unload_keeps_running_requests_and_refuses_new_ones(lora_setup):
    base, _, adapters = lora_setup
    llm = _engine(base, adapters[:1])
    name = adapters[0].name
    engine = llm.engine
    engine.add_request("r", list(range(10, 30)), _greedy(12, name))
    engine.step()  # admitted: it pins the adapter's slot
    llm.unload_lora_adapter(name)
    with pytest.raises(ValueError, match="not loaded"):
        engine.check_request([1, 2, 3], _greedy(2, name))
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    final = [o for o in outs if o.request_id == "r" and o.finished][0]
    assert len(final.outputs[0].token_ids) == 12 and final.outputs[0].finish_reason == "length"
    assert engine.adapters.slots.resident() == []  # cleared with its last sequence
    with pytest.raises(KeyError):
        llm.unload_lora_adapter(name)


def test_refusals(lora_setup, tmp_path):
    base, _, adapters = lora_setup
    llm = _engine(base, adapters[:1], max_lora_rank=4)
    with pytest.raises(ValueError, match="already loaded"):
        llm.load_lora_adapter(adapters[0].name, str(adapters[0].path))
    with pytest.raises(ValueError, match="max-lora-rank"):
        llm.load_lora_adapter("big", str(adapters[1].path))  # rank 8 > 4
    with pytest.raises(ValueError, match="not loaded"):
        llm.generate([[1, 2, 3]], _greedy(2, "nope"))
    plain = LLM(str(base), dtype="float32", block_size=4, kv_cache_memory="8MiB")
    with pytest.raises(ValueError, match="enable-lora"):
        plain.generate([[1, 2, 3]], _greedy(2, adapters[0].name))


class _Collect:
    def __init__(self) -> None:
        self.events: list = []

    def publish(self, events) -> bool:
        self.events.extend(events)
        return True

    def stats(self):
        return None

    def close(self) -> None:
        pass


def test_kv_events_carry_the_adapter(lora_setup):
    base, _, adapters = lora_setup
    llm = _engine(base, adapters[:1], kv_events_config={
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:0"})
    sink = _Collect()
    llm.engine.kv_events.publisher.close()
    llm.engine.kv_events.publisher = sink
    llm.generate([list(range(60, 80))], _greedy(2, adapters[0].name))
    llm.generate([list(range(60, 80))], _greedy(2, None))
    stored = [e for e in sink.events if type(e).__name__ == "BlockStored"]
    lora_ids = {(e.lora_id, e.lora_name) for e in stored}
    assert (1, adapters[0].name) in lora_ids and (None, None) in lora_ids
    wire = next(e for e in stored if e.lora_id == 1).to_wire()
    assert wire["lora_id"] == 1 and wire["lora_name"] == adapters[0].name


def test_adapter_rows_are_batch_invariant(lora_setup):
    """With batch invariance (the default on a CPU) an adapter row's logprobs are bit for bit
    the same alone and beside other adapters' and the base model's rows."""
    base, _, adapters = lora_setup
    llm = _engine(base, adapters)
    if llm.engine.runner.lora.kind != "cpu-kernel":
        pytest.skip("the C++ kernels are not built here")
    rng = random.Random(1)
    prompts = [[rng.randrange(0, 256) for _ in range(rng.randint(5, 30))] for _ in range(6)]
    names = [adapters[1].name, None, adapters[0].name, adapters[1].name, adapters[2].name, None]

    def params(name):
        return SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3,
                              lora_name=name)

    alone = llm.generate(prompts[:1], params(names[0]))[0].outputs[0]
    llm.engine.reset_prefix_cache()
    together = llm.generate(prompts, [params(n) for n in names])[0].outputs[0]
    assert together.token_ids == alone.token_ids
    assert [dict((t, lp.logprob) for t, lp in pos.items()) for pos in together.logprobs] == \
        [dict((t, lp.logprob) for t, lp in pos.items()) for pos in alone.logprobs]


def test_decode_stack_serves_adapter_rows_bit_for_bit(lora_setup, monkeypatch):
    """The C++ decode stack adds the adapters' delta itself: the same logprobs as the Python
    layer loop (``KVSERVE_DECODE_STACK=0``), and adapter steps do run there."""
    base, _, adapters = lora_setup
    rng = random.Random(2)
    prompts = [[rng.randrange(0, 256) for _ in range(rng.randint(5, 20))] for _ in range(4)]
    names = [adapters[1].name, None, adapters[0].name, adapters[2].name]
    params = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2,
                             lora_name=n) for n in names]

    def run():
        llm = _engine(base, adapters)
        outs = llm.generate(prompts, params)
        return llm, [[{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs]
                     for o in outs]

    llm, with_stack = run()
    stack = llm.engine.runner.model.decode_stack
    if stack is None:
        pytest.skip("no C++ decode stack here")
    assert stack.calls > 0
    monkeypatch.setenv("KVSERVE_DECODE_STACK", "0")
    llm, in_python = run()
    assert llm.engine.runner.model.decode_stack is None
    assert with_stack == in_python


@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text"])
def test_other_architectures_match_hf_peft(model_type, tmp_path):
    """Q/K norms (Qwen3); Gemma 3's sandwich norms, hybrid KV cache and local RoPE: the delta
    lands on the same projections, in the Python loop and the decode stack alike."""
    base = make_tiny_model_dir(tmp_path / "base", model_type)
    adapter = make_peft_adapter(base, tmp_path, "all", seed=7, r=4, alpha=8,
                                targets=ALL_TARGETS, std=0.2)
    hf = load_hf(base)
    rng = random.Random(3)
    prompts = [[rng.randrange(0, 256) for _ in range(rng.randint(4, 20))] for _ in range(3)]
    names = ["all", None, "all"]
    expected = [hf_greedy(adapter.merged if n else hf, p, 6) for p, n in zip(prompts, names)]
    llm = _engine(base, [adapter])
    outs = llm.generate(prompts, [_greedy(6, n) for n in names])
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert expected[0] != hf_greedy(hf, prompts[0], 6)
