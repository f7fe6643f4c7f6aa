"""Batch-invariant greedy output (issue 27, item 8; ``engine.models.batch_invariant``).

Kernel level: a packed linear's row ``r`` is bit-identical for 1, 3, 17, 64 and 300 rows (the
decode-kernel, tile and prefill sizes), 4-bit and 8-bit, with the module settings the start-up
probe may choose (``panel_dtype``, ``q4_prefill``, ``q4_batch``, kernels) and with a float
fallback kept for large batches; the float panel linear likewise.

Engine level, on a tiny random Llama written as a Q4_0/Q8_0 GGUF and served packed (the same
kernels as the embedded model's Q4_1/Q8_0): 20 prompts, each generated alone (no prefix cache:
nothing shared) and inside batches of 2, 7 and 16 with other prompts, with prompts chunked by a
small token budget (48), with prefix-cache hits (half of them share a 24-token prefix; everything
runs twice) and under recompute preemption (a KV pool too small for 16 at once): the same
greedy tokens everywhere. A random model's top-1 is often a near tie, so the default
(non-invariant) routes fail this readily; these tests fail without ``set_batch_invariant``.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.quantization.linear import QuantLinear
from engine.quantization.rtn import quantise

ROWS = (1, 3, 17, 64, 300)
OUT_TOKENS = 10


def _kernels_or_skip():
    from engine.cpu.kernels import load

    if load() is None:
        pytest.skip("CPU kernels unavailable")


@pytest.mark.parametrize("scheme", ["int4", "int8"])
@pytest.mark.parametrize("panels", [torch.float32, torch.bfloat16])
def test_packed_linear_rows_do_not_depend_on_the_batch(scheme, panels):
    _kernels_or_skip()
    torch.manual_seed(0)
    weight = torch.randn(200, 256)
    lin = QuantLinear(quantise(weight, scheme), bias=torch.randn(200))
    # Every per-size route the probe may pick, and a float copy for the large batches.
    lin.choose(panel_dtype=panels)
    lin.choose(q4_prefill="panels")
    lin.choose(q4_batch="tiles")
    lin.keep_float_above(64, torch.nn.Linear(256, 200))
    lin.set_batch_invariant()
    x = torch.randn(max(ROWS), 256)
    alone = torch.cat([lin(x[r:r + 1]) for r in range(max(ROWS))])
    for m in ROWS:
        assert torch.equal(lin(x[:m]), alone[:m]), f"{scheme}: rows differ at M={m}"


def test_float_panel_linear_rows_do_not_depend_on_the_batch():
    from engine.quantization.packed_linear import (
        PackedLinear,
        onednn_linear_available,
        panel_kernels_available,
    )

    cpu = torch.device("cpu")
    if not panel_kernels_available(cpu, torch.float32):
        pytest.skip("no AVX2 panel kernel here")
    # hybrid: oneDNN above 128 rows, whose rows differ from the panels' at K = 576 (not 256).
    backend = "hybrid" if onednn_linear_available(cpu, torch.float32) else "avx2-panels"
    torch.manual_seed(1)
    lin = PackedLinear(torch.randn(200, 576), torch.randn(200), backend)
    assert lin.set_batch_invariant()
    x = torch.randn(max(ROWS), 576)
    alone = torch.cat([lin(x[r:r + 1]) for r in range(max(ROWS))])
    for m in ROWS:
        assert torch.equal(lin(x[:m]), alone[:m]), f"float panels: rows differ at M={m}"


SHARED = [(i * 29 + 7) % 250 + 3 for i in range(24)]


def _prompts() -> list[list[int]]:
    """20 prompts of 5..59 tokens; the odd ones start with the same 24 tokens."""
    out = []
    for i in range(20):
        own = [(i * 53 + j * 17 + 5) % 250 + 3 for j in range(5 + (i * 7) % 36)]
        out.append(SHARED + own if i % 2 else own)
    return out


@pytest.fixture(scope="module")
def q4_model(tmp_path_factory, make_llama_gguf):
    root = tmp_path_factory.mktemp("bi")
    path = root / "tiny-llama.Q4_0.gguf"
    make_llama_gguf(path, tied=True, quantised=True)
    return path, root / "cache"


def _llm(q4_model, monkeypatch, **kw) -> LLM:
    path, cache = q4_model
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(cache))
    # cpu_probe=off: the packed path with the modules' default settings (no timing decides).
    return LLM(str(path), dtype="float32", cpu_probe="off", block_size=4, **kw)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=OUT_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("acts", ["auto", "float32"])  # float32: the faithful kernels
def test_greedy_tokens_do_not_depend_on_the_batch(q4_model, monkeypatch, acts):
    _kernels_or_skip()
    prompts = _prompts()
    alone_llm = _llm(q4_model, monkeypatch, activation_precision=acts, enable_prefix_caching=False,
                     kv_cache_memory="4MiB")
    assert alone_llm.engine.runner.quantized
    alone = [_generate(alone_llm, [p])[0] for p in prompts]

    # Batches of 2, 7 and 16 (every prompt in one of each size), 48-token chunks, prefix cache.
    llm = _llm(q4_model, monkeypatch, activation_precision=acts, kv_cache_memory="4MiB", max_num_batched_tokens=48)
    for size in (2, 7, 16):
        for start in range(0, len(prompts), size):
            idx = [(start + i) % len(prompts) for i in range(size)]
            got = _generate(llm, [prompts[i] for i in idx])
            for i, tokens in zip(idx, got):
                assert tokens == alone[i], f"prompt {i} in a batch of {size}"
    assert llm.stats()["prefix_cache_hits"] > 0

    # Recompute preemption: a pool of 40 blocks (160 tokens) for 16 requests of up to 69.
    per_token = llm.engine.runner.kv_bytes_per_token
    tight = _llm(q4_model, monkeypatch, activation_precision=acts, kv_cache_memory=160 * per_token,
                 preemption_mode="recompute")
    got = _generate(tight, prompts[:16])
    assert tight.stats()["num_preemptions_recompute"] > 0
    for i, tokens in enumerate(got):
        assert tokens == alone[i], f"prompt {i} under preemption"


def test_flag_and_yaml_key(tmp_path):
    from server.cli import _settings, build_parser

    def parse(*argv: str):
        return _settings(build_parser().parse_args(["serve", *argv]))[0]

    assert parse().batch_invariant is True  # the default
    assert parse("--no-batch-invariant").batch_invariant is False
    f = tmp_path / "c.yaml"
    f.write_text("batch_invariant: false\n")
    assert parse("--config", str(f)).batch_invariant is False
    assert parse("--config", str(f), "--batch-invariant").batch_invariant is True


def test_gemma2_softcapped_attention_does_not_depend_on_the_batch(tmp_path):
    """Gemma 2's soft-capped scores run in the compiled decode kernel for every row (prompt
    rows included), each row's arithmetic the same in any group: a prompt's greedy tokens
    alone equal its tokens in a batch of 10 prompts chunked by a 48-token budget."""
    _kernels_or_skip()
    from engine.loading.tiny import make_tiny_model_dir

    path = make_tiny_model_dir(tmp_path / "gemma2", "gemma2")
    kw = dict(dtype="float32", cpu_probe="off", block_size=4, quantization="int4",
              kv_cache_memory="4MiB")
    prompts = _prompts()[:10]
    alone_llm = LLM(str(path), enable_prefix_caching=False, **kw)
    assert alone_llm.engine.runner.model.arch.attn_softcap
    alone = [_generate(alone_llm, [p])[0] for p in prompts]
    llm = LLM(str(path), max_num_batched_tokens=48, **kw)
    assert _generate(llm, prompts) == alone
