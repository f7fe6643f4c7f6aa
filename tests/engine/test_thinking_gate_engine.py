"""The thinking gate in the engine (engine/structured/gated.py), on a tiny random Llama whose
greedy continuations loop (so n-gram drafts are accepted): the thought holds exactly the
budget's tokens, the closing marker follows, the answer after it is schema-valid JSON; the same
request with n-gram speculation and with jump-forward drafts off gives token for token the same
output (drafts and rollbacks cross the gate's phases); a gate alone (no constraint) bounds the
thought and leaves the answer free."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.loading.tiny import make_tiny_model_dir
from engine.params.structured import StructuredSpec
from engine.params.thinking import ThinkingGate

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "mood": {"enum": ["calm", "busy", "tired"]}},
          "required": ["ok", "mood"], "additionalProperties": False}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1, "disable_by_batch_size": None}
PROMPT = "Tell me, is it calm or busy? Think first. <think>\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("gate"), "llama", seed=2,
                               initializer_range=0.05)


def _llm(model_dir, **kw) -> LLM:
    return LLM(str(model_dir), dtype="float32", kv_cache_memory="4MiB", **kw)


@pytest.fixture(scope="module")
def llm(model_dir):
    with _llm(model_dir) as engine:
        yield engine


def _params(llm, budget, constrained=True) -> SamplingParams:
    enc = llm.tokenizer.encode
    gate = ThinkingGate(tuple(enc("<think>", add_special_tokens=False)),
                        tuple(enc("</think>", add_special_tokens=False)), budget, inside=True)
    return SamplingParams(temperature=0, max_tokens=80, thinking=gate,
                          structured=StructuredSpec.json_schema(SCHEMA) if constrained else None)


def _split(llm, out):
    end = llm.tokenizer.encode("</think>", add_special_tokens=False)
    ids = list(out.outputs[0].token_ids)
    at = next(i for i in range(len(ids)) if ids[i:i + len(end)] == end)
    return ids[:at], ids[at + len(end):]


@pytest.mark.parametrize("budget", [0, 7])
def test_budget_then_marker_then_schema(llm, budget):
    out = llm.generate(PROMPT, _params(llm, budget))[0]
    thought, answer = _split(llm, out)
    assert len(thought) == budget
    text = llm.tokenizer.decode(answer, skip_special_tokens=True)
    jsonschema.validate(json.loads(text), SCHEMA)
    free = llm.generate(PROMPT, _params(llm, budget, constrained=False))[0]
    assert len(_split(llm, free)[0]) == budget


@pytest.mark.slow
def test_speculation_and_jump_forward_give_the_same_tokens(llm, model_dir):
    outs = [list(llm.generate(PROMPT, _params(llm, 12))[0].outputs[0].token_ids)]
    for kw in ({"speculative_config": NGRAM},
               {"structured_outputs_config": {"jump_forward_tokens": 0}}):
        llm = _llm(model_dir, **kw)
        try:
            outs.append(list(llm.generate(PROMPT, _params(llm, 12))[0].outputs[0].token_ids))
            if "speculative_config" in kw:
                assert llm.stats()["spec_decode_num_draft_tokens"] > 0
        finally:
            llm.close()
    assert outs[0] == outs[1] == outs[2]
