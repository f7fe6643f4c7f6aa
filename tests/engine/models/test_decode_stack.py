"""The C++ decode-step layer stack (engine/models/cpu_decode_stack.py) against the Python loop.

Every decode step of a real generation runs twice: the Python layer loop on a copy of the KV
pools, then the C++ stack on the engine's own pools. The stack calls the same kernels in the
same order, so hidden states and the K/V written must be bit-identical (``torch.equal``), for
each linear kind it serves (float ``nn.Linear``, AVX2 panels, 4-bit base and VNNI kernels,
the 4-bit tiles, 8-bit kernels, lanes and the interleaved layout) and each layer shape (qkv
bias, q/k norms, sliding windows), with several sequences of different lengths decoding
together.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.loading.tiny import make_tiny_model_dir
from engine.models.cpu_decode_stack import CpuDecodeStack, build_decode_stack
from engine.quantization.linear import (
    BATCH_TILE_ROWS,
    QuantLinear,
    amx_available,
    interleaved_available,
    quant_kernels,
    vnni_available,
)

pytestmark = pytest.mark.skipif(quant_kernels() is None, reason="CPU kernels unavailable")

PROMPTS = [list(b"hello world, "), list(b"The quick brown fox jumps"), list(b"0123456789" * 3)]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _skip_float_without_panels(quantization: str) -> None:
    """Float projections reach the stack as AVX2 panels; a build without AVX2 (scalar
    kernels) has none, and its float engine keeps the Python loop."""
    if quantization == "none" and quant_kernels().quant_gemm_isa() != "avx2":
        pytest.skip("float projections reach the stack as AVX2 panels; this build has none")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {kind: make_tiny_model_dir(tmp_path_factory.mktemp(kind), kind)
            for kind in ("llama", "qwen2", "qwen3", "mistral")}


def _checked(llm: LLM) -> dict[str, int]:
    """Make every model forward of ``llm`` also run the Python loop on copied pools and assert
    both agree wherever the stack ran; returns the counters of steps (stack, python-only)."""
    model = llm.engine.runner.model
    stack = model.decode_stack
    assert isinstance(stack, CpuDecodeStack)
    counts = {"stack": 0, "python": 0}
    forward = model.forward

    def checked(input_ids, positions, kv_caches, meta, backend, ops=None):
        # One copy per pool: a hybrid KV cache's groups share pools (layers of different
        # groups hold the same tensor), so the copies must share them the same way.
        clones: dict = {}

        def copy(t: torch.Tensor) -> torch.Tensor:
            key = (t.data_ptr(), t.shape, t.dtype)
            if key not in clones:
                clones[key] = t.clone()
            return clones[key]

        copies = [(copy(k), copy(v)) for k, v in kv_caches]
        model.decode_stack = None
        ref = forward(input_ids, positions, copies, meta, backend, ops)
        model.decode_stack = stack
        calls = stack.calls
        out = forward(input_ids, positions, kv_caches, meta, backend, ops)
        if stack.calls == calls:
            counts["python"] += 1
            return out
        counts["stack"] += 1
        assert torch.equal(out, ref)
        for (k, v), (k_ref, v_ref) in zip(kv_caches, copies):
            assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
        return out

    model.forward = checked
    return counts


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("quantization", ["int4", "int8", "none"])
def test_stack_equals_python_loop(model_dirs, kind, quantization):
    _skip_float_without_panels(quantization)
    llm = LLM(str(model_dirs[kind]), kv_cache_memory="16MiB", quantization=quantization)
    counts = _checked(llm)
    llm.generate(PROMPTS, PARAMS)
    assert counts["stack"] >= PARAMS.max_tokens - 1  # every decode step ran the stack
    # The prefill did not, unless batch-invariant (the default): there every prompt row is a
    # decode row of the attention and every linear one kernel at any size, so a prefill
    # within the stack's rows runs it too (checked equal to the loop like any other step).
    assert counts["python"] >= 1 or llm.config.batch_invariant


@pytest.mark.parametrize("scheme", ["int4", "int8"])
@pytest.mark.parametrize("kernel", ["base", "vnni"])
def test_stack_serves_both_decode_kernels(model_dirs, scheme, kernel):
    if kernel == "vnni" and not vnni_available():
        pytest.skip("no AVX-512 VNNI kernels on this CPU")
    llm = LLM(str(model_dirs["llama"]), kv_cache_memory="16MiB", quantization=scheme)
    model = llm.engine.runner.model
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            mod.choose(q4_kernel=kernel)
            mod.choose(q8_kernel=kernel)
    model.decode_stack, why = build_decode_stack(model)  # rebuilt: its kernels are fixed at build
    assert why == ""
    counts = _checked(llm)
    llm.generate(PROMPTS, PARAMS)
    assert counts["stack"] >= PARAMS.max_tokens - 1


@pytest.mark.parametrize("kernel", ["base", "vnni"])
def test_stack_serves_4bit_batches_on_tiles(model_dirs, kernel):
    """``q4_batch = "tiles"``: decode steps of ``BATCH_TILE_ROWS`` or more rows run the tiled
    kernel in the stack as in Python (smaller steps, the decode kernel), bit-identically (with
    the VNNI kernels, on the VNNI tiles)."""
    if kernel == "vnni" and not vnni_available():
        pytest.skip("no AVX-512 VNNI kernels on this CPU")
    # Not batch-invariant: that mode stores 4-bit weights blocked (no per-size routes).
    llm = LLM(str(model_dirs["llama"]), kv_cache_memory="16MiB", quantization="int4",
              batch_invariant=False)
    model = llm.engine.runner.model
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            mod.choose(q4_kernel=kernel)
            mod.choose(q4_batch="tiles")
            mod.choose(q4_tiles="vnni" if kernel == "vnni" else "avx2")
    model.decode_stack, why = build_decode_stack(model)
    assert why == ""
    counts = _checked(llm)
    prompts = [PROMPTS[i % len(PROMPTS)] + [i] for i in range(BATCH_TILE_ROWS + 1)]
    outs = llm.generate(prompts, PARAMS)  # 4 rows per step (ignore_eos: none finishes early)
    assert counts["stack"] >= PARAMS.max_tokens - 1
    assert all(len(o.outputs[0].token_ids) == PARAMS.max_tokens for o in outs)


def _q8_one_and_seventeen_rows(model_dirs, invariant: bool, settings: dict[str, str],
                               vnni: bool) -> None:
    """An int8 engine (every linear 8-bit; the VNNI kernels built where ``vnni``, else the
    interleaved kernel) with ``settings`` on every linear and the stack rebuilt: a request
    alone (one row per step), then 17 (17 rows per step), each stack step checked against the
    Python loop (``_checked``)."""
    if not (vnni_available() if vnni else interleaved_available()):
        pytest.skip("the kernels these settings need are not built on this CPU")
    llm = LLM(str(model_dirs["qwen2"]), kv_cache_memory="16MiB", quantization="int8",
              batch_invariant=invariant)
    model = llm.engine.runner.model
    mods = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert mods and all(m.is_q8 for m in mods)
    for mod in mods:
        for key, value in settings.items():
            mod.choose(**{key: value})
    model.decode_stack, why = build_decode_stack(model)
    assert why == ""
    counts = _checked(llm)
    llm.generate(PROMPTS[:1], PARAMS)
    prompts = [PROMPTS[i % len(PROMPTS)] + [i] for i in range(17)]
    outs = llm.generate(prompts, PARAMS)  # ignore_eos: none finishes early
    assert counts["stack"] >= 2 * (PARAMS.max_tokens - 1)
    assert all(len(o.outputs[0].token_ids) == PARAMS.max_tokens for o in outs)


def test_stack_serves_8bit_batches_on_the_lanes(model_dirs):
    """``q8_batch = "lanes"`` (not batch-invariant, the rows layout whatever the probe chose):
    decode steps of ``LANES_ROWS`` or more rows run ``quant_gemm_q8_batch`` in the stack as in
    Python (fewer rows, the decode kernel), bit-identically."""
    _q8_one_and_seventeen_rows(model_dirs, False, {"q8_layout": "rows", "q8_batch": "lanes"},
                               vnni=True)


@pytest.mark.parametrize("invariant", [True, False])
def test_stack_serves_interleaved_8bit_weights(model_dirs, invariant):
    """``q8_layout = "interleaved"``: every decode step, one row or a batch, runs
    ``quant_gemm_q8_interleaved`` in the stack as in Python, bit-identically (batch-invariant
    or per-size)."""
    _q8_one_and_seventeen_rows(model_dirs, invariant, {"q8_layout": "interleaved"}, vnni=False)


@pytest.mark.parametrize("invariant", [True, False])
def test_stack_serves_interleaved_8bit_batches_on_amx_tiles(model_dirs, invariant):
    """``q8_tiles = "amx"`` from 8 rows: the stack's interleaved linears run a step of 17 rows
    on the AMX tiles (one row on VNNI), bit-identically to the Python loop."""
    if not amx_available():
        pytest.skip("no AMX tiles on this CPU")
    _q8_one_and_seventeen_rows(model_dirs, invariant, {"q8_layout": "interleaved",
                                                       "q8_tiles": "amx", "q8_amx_from": "8"},
                               vnni=True)


@pytest.mark.parametrize("tiles", ["avx2", "vnni", "amx"])
def test_stack_serves_blocked_4bit_weights(model_dirs, tiles):
    """``q4_layout = "blocked"``: every decode step, one row or a batch, runs the blocked
    kernel (on either tiles, ``q4_tiles``; ``amx``: on VNNI, AMX tiles from 16 rows) in the
    stack as in Python, bit-identically."""
    if tiles != "avx2" and not vnni_available():
        pytest.skip("no AVX-512 VNNI kernels on this CPU")
    if tiles == "amx" and not amx_available():
        pytest.skip("no AMX tiles on this CPU")
    llm = LLM(str(model_dirs["llama"]), kv_cache_memory="16MiB", quantization="int4")
    model = llm.engine.runner.model
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            mod.choose(q4_layout="blocked")
            mod.choose(q4_tiles="avx2" if tiles == "avx2" else "vnni")
            if tiles == "amx":
                mod.choose(q4_amx="on")
                mod.choose(q4_amx_from="16")
    model.decode_stack, why = build_decode_stack(model)
    assert why == ""
    counts = _checked(llm)
    llm.generate(PROMPTS[:1], PARAMS)  # one row per step
    batch = 17 if tiles == "amx" else 4  # AMX tiles from 16 rows
    outs = llm.generate([PROMPTS[i % len(PROMPTS)] + [i] for i in range(batch)], PARAMS)
    assert counts["stack"] >= 2 * (PARAMS.max_tokens - 1)
    assert all(len(o.outputs[0].token_ids) == PARAMS.max_tokens for o in outs)


def _skip_without_faithful_kernels(activation: str) -> None:
    from engine.cpu import kernels_faithful

    if activation != "int8" and kernels_faithful.load() is None:
        pytest.skip("the faithful kernels are not built here")


@pytest.mark.parametrize("activation", ["float32", "bf16"])
@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_stack_serves_faithful_activations(model_dirs, quantization, activation):
    """The faithful kernels (float32 / bf16 activations) have stack kinds of their own: every
    decode step runs the stack, bit-identical to the Python loop."""
    _skip_without_faithful_kernels(activation)
    llm = LLM(str(model_dirs["llama"]), kv_cache_memory="16MiB", quantization=quantization,
              activation_precision=activation)
    mods = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantLinear)]
    assert mods and all(m.faithful and m.kernels.activation == activation for m in mods)
    counts = _checked(llm)
    llm.generate(PROMPTS, PARAMS)
    assert counts["stack"] >= PARAMS.max_tokens - 1


@pytest.mark.parametrize("activation", ["int8", "bf16"])
def test_mixed_format_projections(make_llama_gguf, tmp_path, monkeypatch, activation):
    """A Q4_K_M-style GGUF: Q/K/V packed as Q4_K and Q6_K rows (a QuantConcat), down as Q5_K
    (8-bit with mins), a Q6_K token table; on the int8 kinds and on the faithful ones."""
    from engine.quantization.linear import QuantConcat

    _skip_without_faithful_kernels(activation)
    path = tmp_path / "tiny-llama.Q4_K_M.gguf"
    make_llama_gguf(path, tied=True, kquants=True)
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KVSERVE_QUANT_FORCE", "1")
    llm = LLM(str(path), kv_cache_memory="16MiB", activation_precision=activation)
    assert isinstance(llm.engine.runner.model.layers[0].qkv_proj, QuantConcat)
    counts = _checked(llm)
    llm.generate(PROMPTS, PARAMS)
    assert counts["stack"] >= PARAMS.max_tokens - 1


def test_plain_linears(model_dirs, monkeypatch):
    monkeypatch.setenv("KVSERVE_PACKED_LINEAR", "0")  # nn.Linear, F.linear
    llm = LLM(str(model_dirs["qwen2"]), kv_cache_memory="16MiB", quantization="none")
    counts = _checked(llm)
    llm.generate(PROMPTS, PARAMS)
    assert counts["stack"] >= PARAMS.max_tokens - 1


@pytest.mark.parametrize("kind,kv_cache_dtype", [("llama", "int8"), ("qwen3", "int8"),
                                                ("llama", "float16"), ("qwen3", "bfloat16"),
                                                ("llama", "int4"), ("qwen3", "int4")])
def test_narrow_pools(model_dirs, kind, kv_cache_dtype):
    """Rows converted to an int8 / float16 / bfloat16 / int4 pool's bytes exactly as
    formats.quantize_rows does, read by that pool's decode kernel (int4: the query rotated in,
    the output back; head_dim 16 (llama) takes the portable loop, 32 (qwen3) the vector path):
    pools and hidden states equal to the Python loop's."""
    llm = LLM(str(model_dirs[kind]), kv_cache_memory="16MiB", quantization="int4",
              kv_cache_dtype=kv_cache_dtype)
    pool_dtype = torch.uint8 if kv_cache_dtype == "int4" else getattr(torch, kv_cache_dtype)
    assert llm.engine.runner.kv_caches[0][0].dtype == pool_dtype
    counts = _checked(llm)
    llm.generate(PROMPTS, PARAMS)
    assert counts["stack"] >= PARAMS.max_tokens - 1


def test_fp8_pool_keeps_the_python_loop(model_dirs):
    llm = LLM(str(model_dirs["llama"]), kv_cache_memory="16MiB", quantization="int4",
              kv_cache_dtype="fp8_e4m3")
    counts = _checked(llm)
    out = llm.generate(PROMPTS, PARAMS)
    assert counts["stack"] == 0 and all(len(o.outputs[0].token_ids) == 12 for o in out)


def test_off_switch_and_reasons(model_dirs, monkeypatch):
    monkeypatch.setenv("KVSERVE_DECODE_STACK", "0")
    llm = LLM(str(model_dirs["llama"]), kv_cache_memory="16MiB", quantization="int4")
    model = llm.engine.runner.model
    assert model.decode_stack is None
    assert build_decode_stack(model) == (None, "KVSERVE_DECODE_STACK=0")
    monkeypatch.delenv("KVSERVE_DECODE_STACK")
    model.layers[1].o_proj = torch.nn.Linear(64, 64).to(torch.bfloat16)
    stack, why = build_decode_stack(model)
    assert stack is None and why == "layer 1 o_proj: torch.bfloat16 linear"


@pytest.mark.parametrize("quantization", ["int4", "int8"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_gemma3_hybrid_kv(tmp_path, quantization, kv_cache_dtype):
    """Gemma 3 (sandwich norms, GeGLU, QK-norm, query_pre_attn_scalar, a local RoPE table for
    the window layers) over a hybrid KV cache (window and full groups, each with its own slots
    and block tables), prompts longer than the window so window blocks are freed mid-run:
    every decode step in the stack, hidden states and every group's pools equal to the
    Python loop's."""
    path = make_tiny_model_dir(tmp_path / "gemma3", "gemma3_text")
    llm = LLM(str(path), kv_cache_memory="16MiB", block_size=4, quantization=quantization,
              kv_cache_dtype=kv_cache_dtype)
    assert build_decode_stack(llm.engine.runner.model)[1] == ""
    counts = _checked(llm)
    prompts = [p * 2 for p in PROMPTS]  # 26-60 tokens against a window of 8
    outs = llm.generate(prompts, PARAMS)
    assert counts["stack"] >= PARAMS.max_tokens - 1
    assert all(len(o.outputs[0].token_ids) == PARAMS.max_tokens for o in outs)
    llm.engine.kv.check_integrity()


@pytest.mark.parametrize("quantization", ["int4", "none"])
def test_one_kv_head_attention_loads_the_next_weights_meanwhile(tmp_path, monkeypatch,
                                                                quantization):
    """One sequence of a one-KV-head model (Gemma 3): its attention is a single task, and the
    other thread loads the next linears' weights meanwhile (weight_prefetch.h). Bits do not
    change (every step equals the Python loop, and the tokens those with the loads off); the
    loads happen, and stay off with ``KVSERVE_STACK_PREFETCH=0``."""
    _skip_float_without_panels(quantization)
    path = make_tiny_model_dir(tmp_path / "gemma3", "gemma3_text")
    tokens, loaded = {}, {}
    for ahead in ("4194304", "0"):
        monkeypatch.setenv("KVSERVE_STACK_PREFETCH", ahead)
        llm = LLM(str(path), kv_cache_memory="16MiB", block_size=4, quantization=quantization)
        stack = llm.engine.runner.model.decode_stack
        assert llm.engine.hf_config.num_key_value_heads == 1 and stack._stack.prefetch == int(ahead)
        counts = _checked(llm)
        out = llm.generate([PROMPTS[2] * 2], PARAMS)[0]
        assert counts["stack"] >= PARAMS.max_tokens - 1
        tokens[ahead] = out.outputs[0].token_ids
        loaded[ahead] = stack._stack.prefetched_bytes
    assert tokens["4194304"] == tokens["0"]
    assert loaded["0"] == 0
    if torch.get_num_threads() > 1:
        assert loaded["4194304"] > 0


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "int4"])
def test_gemma2_softcapped_attention(tmp_path, kv_cache_dtype):
    """Gemma 2 (sandwich norms, GeGLU, soft-capped attention scores, every layer one window):
    every decode step in the stack, the compiled kernel capping the scores as the Python
    loop's backend call does: hidden states and pools equal to the Python loop's."""
    path = make_tiny_model_dir(tmp_path / "gemma2", "gemma2")
    llm = LLM(str(path), kv_cache_memory="16MiB", block_size=4, quantization="int4",
              kv_cache_dtype=kv_cache_dtype)
    model = llm.engine.runner.model
    assert model.arch.attn_softcap and build_decode_stack(model)[1] == ""
    counts = _checked(llm)
    outs = llm.generate([p * 2 for p in PROMPTS], PARAMS)
    assert counts["stack"] >= PARAMS.max_tokens - 1
    assert all(len(o.outputs[0].token_ids) == PARAMS.max_tokens for o in outs)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("quantization", ["int4", "none"])
def test_mixture_of_experts(tmp_path, kind, quantization):
    """Qwen3-MoE (a dense layer among sparse ones, normalised top-k) and Mixtral: the router,
    the top-k choice and each routed expert's rows (packed with int4, float slices with none)
    in the stack, several sequences per step so experts get different row sets: hidden states
    and pools equal to the Python loop's."""
    _skip_float_without_panels(quantization)
    path = make_tiny_model_dir(tmp_path / kind, kind)
    llm = LLM(str(path), kv_cache_memory="16MiB", quantization=quantization)
    model = llm.engine.runner.model
    assert model.moe_blocks() and build_decode_stack(model)[1] == ""
    counts = _checked(llm)
    outs = llm.generate(PROMPTS, PARAMS)
    assert counts["stack"] >= PARAMS.max_tokens - 1
    assert all(len(o.outputs[0].token_ids) == PARAMS.max_tokens for o in outs)


def test_packed_experts_from_a_gguf(tmp_path, monkeypatch):
    """Q4_0/Q8_0 experts kept packed from a GGUF (PackedExperts) run in the stack too; a
    step whose router choices are being recorded stays in Python."""
    from engine.loading.tiny_gguf import write_moe_gguf
    from engine.models.moe import PackedExperts

    path = tmp_path / "tiny-qwen3_moe.gguf"
    write_moe_gguf(path, "qwen3_moe")
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    llm = LLM(str(path), kv_cache_memory="16MiB", cpu_probe="off", activation_precision="int8")
    model = llm.engine.runner.model
    blocks = model.moe_blocks()
    assert blocks and all(isinstance(b.experts, PackedExperts) for b in blocks.values())
    counts = _checked(llm)
    llm.generate(PROMPTS, PARAMS)
    assert counts["stack"] >= PARAMS.max_tokens - 1
    for b in blocks.values():
        b.record = True
    stack_calls = model.decode_stack.calls
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert model.decode_stack.calls == stack_calls
