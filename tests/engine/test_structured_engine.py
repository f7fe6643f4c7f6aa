"""Constrained decoding through the engine, on a tiny random Llama (byte-level vocabulary):
greedy under a grammar equals greedy over the masked HF logits; n > 1, stop strings, max_tokens
mid-object, a recompute preemption mid-object, and batches mixing constrained and free rows
(with speculative decoding: test_structured_spec_decode); the greedy case on either grammar
library."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine import LLM, SamplingParams
from engine.loading.hf_reference import load_hf
from engine.loading.tiny import VOCAB, make_tiny_model_dir
from engine.params.structured import StructuredSpec
from engine.structured.llguidance_backend import LLGuidanceBackend
from engine.structured.xgrammar_backend import XGrammarBackend

EOS = 257
BLOCK_BYTES = 512 * 4  # tiny llama, float32: 512 bytes per token, 4 tokens per block
SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "tag": {"enum": ["red", "green", "blue"]},
    "name": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
    "required": ["id", "tag", "name"]}
PROMPT = list(b"Give me JSON: ")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("llama"), "llama", seed=3)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", block_size=4, kv_cache_memory="8MiB")


def reference_greedy(hf, backend, spec: StructuredSpec, prompt: list[int],
                     max_tokens: int) -> list[int]:
    """Greedy decoding over HF's logits masked by the grammar, step by step."""
    matcher = backend.matcher(backend.compile(spec))
    ids, out = list(prompt), []
    bitmask = backend.allocate_bitmask(1)
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = hf(torch.tensor([ids])).logits[0, -1:].float().clone()
            backend.fill_bitmasks([matcher], bitmask, [0])
            backend.apply_bitmask(logits, bitmask, [0])
            tok = int(logits.argmax(-1))
            assert matcher.accept(tok)
            out.append(tok)
            if tok == EOS:
                break
            ids.append(tok)
    return out


@pytest.fixture(scope="module")
def llm_guidance(model_dir):
    """The engine with every constraint it can on llguidance."""
    return LLM(str(model_dir), dtype="float32", block_size=4, kv_cache_memory="8MiB",
               structured_outputs_config={"backend": "llguidance"})


@pytest.mark.parametrize("lib", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("spec", [
    StructuredSpec.json_schema(SCHEMA),
    StructuredSpec.text("regex", r"[a-f]{2,5}-[0-9]{1,3}"),
    StructuredSpec.choice(["alpha", "beta", "gamma"]),
], ids=["json", "regex", "choice"])
def test_greedy_under_a_constraint_equals_greedy_over_masked_hf_logits(request, model_dir, spec,
                                                                      lib):
    llm = request.getfixturevalue("llm" if lib == "xgrammar" else "llm_guidance")
    hf = load_hf(model_dir)
    backend = (XGrammarBackend if lib == "xgrammar" else LLGuidanceBackend)(
        llm.engine.tokenizer, VOCAB, [EOS])
    want = reference_greedy(hf, backend, spec, PROMPT, 60)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=60,
                                                structured=spec))[0].outputs[0]
    if lib == "llguidance":  # forced; the other engine chooses per constraint by measurement
        assert set(llm.engine.structured.backend.chosen) == {"llguidance"}
    assert out.token_ids == want
    assert out.finish_reason == ("stop" if want[-1] == EOS else "length")


def test_sampled_outputs_follow_the_schema_for_every_sample(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=80,
                            structured=StructuredSpec.json_schema(SCHEMA))
    outs = llm.generate([PROMPT, list(b"other prompt")], params)
    for req in outs:
        assert len(req.outputs) == 4
        for c in req.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), SCHEMA)


def test_batches_mix_constrained_and_free_rows(llm):
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([PROMPT], free)[0].outputs[0].token_ids
    regex = SamplingParams(temperature=0.8, seed=1, max_tokens=30,
                           structured=StructuredSpec.text("regex", "[0-9]{3}"))
    outs = llm.generate([PROMPT, PROMPT, list(b"x")], [free, regex, regex])
    assert outs[0].outputs[0].token_ids == alone  # unconstrained rows are untouched
    for o in outs[1:]:
        assert re.fullmatch("[0-9]{3}", o.outputs[0].text)
        assert o.outputs[0].finish_reason == "stop"
    stats = llm.stats()
    assert stats["structured_constrained_rows"] > 0 and stats["structured_compiles"] > 0


def test_max_tokens_mid_object_is_length_and_stop_strings_still_cut(llm):
    spec = StructuredSpec.json_schema(SCHEMA)
    cut = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5,
                                                structured=spec))[0].outputs[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 5
    full = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=80,
                                                 structured=spec))[0].outputs[0].text
    stopped = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=80, stop=['"tag"'],
                                                    structured=spec))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == '"tag"'
    assert stopped.text == full[:full.index('"tag"')]


def test_a_recompute_preemption_mid_object_keeps_the_output(model_dir, llm):
    spec = StructuredSpec.json_schema(SCHEMA)
    prompts = [list(b"request number %d: " % i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=60, structured=spec)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    tight = LLM(str(model_dir), dtype="float32", block_size=4, kv_cache_memory=40 * BLOCK_BYTES,
                preemption_mode="recompute")
    got = [o.outputs[0] for o in tight.generate(prompts, params)]
    assert tight.stats()["num_preemptions_recompute"] > 0
    assert [c.token_ids for c in got] == want
    for c in got:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), SCHEMA)


def test_compile_failure_ends_the_request_with_the_reason(llm):
    out = llm.generate([PROMPT], SamplingParams(
        max_tokens=5, structured=StructuredSpec.text("regex", "(unclosed")))[0]
    assert out.outputs[0].finish_reason == "abort"
    assert "parenthesis" in out.error
    ok = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3))[0]
    assert ok.error is None
