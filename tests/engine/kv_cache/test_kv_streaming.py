"""Streaming eviction (``--kv-eviction sink:S,window:N``) below the engine: the setting's
parsing and checks, the K re-rotation against keys rotated at the new position (float and
8-bit pools), the manager's middle eviction, the policy's text/cache positions, admission and
the evicted-blocks counter."""

from __future__ import annotations

import pytest
import torch

from engine.config.engine import EngineConfig
from engine.config.kv_eviction import KVEvictionSpec
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.streaming import StreamingEviction
from engine.kv_format.formats import dequantize_rows, kv_format, quantize_rows
from engine.kv_format.rope_shift import shift_block_keys
from engine.models.arch import RopeSpec
from engine.models.rope import RotaryEmbedding, apply_rotary
from engine.params.sampling import SamplingParams
from engine.scheduling.admission import AdmissionLimits, check_request
from engine.stats import EngineStats
from server.metrics import ServerMetrics

# ---- the setting ----------------------------------------------------------------------------

def test_spec_parses_and_rounds_up_to_blocks():
    spec = KVEvictionSpec.parse(" sink:4, window:250 ")
    assert (spec.sink, spec.window) == (4, 250)
    assert spec.blocks(16) == (1, 16) and spec.max_cache_tokens(16) == 18 * 16
    assert KVEvictionSpec.parse("sink:0,window:32").blocks(16) == (0, 2)
    spec.validate(16, 512)


@pytest.mark.parametrize("text", ["sink4", "window:8,sink:4", "sink:-1,window:8", "", "sink:4"])
def test_spec_format_errors(text):
    with pytest.raises(ValueError, match="sink:S,window:N"):
        EngineConfig(kv_eviction=text)


@pytest.mark.parametrize("spec, fragment", [
    ("sink:4,window:16", "at least 2 blocks"),  # one block of 16
    ("sink:4,window:500", "max_model_len is 512"),  # 1 + 32 + 1 blocks > 512 tokens
])
def test_spec_size_errors(spec, fragment):
    with pytest.raises(ValueError, match=fragment):
        KVEvictionSpec.parse(spec).validate(16, 512)


def test_eviction_refuses_speculative_decoding():
    with pytest.raises(ValueError, match="speculative_config"):
        EngineConfig(kv_eviction="sink:4,window:64",
                     speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(kv_eviction="sink:4,window:64", tensor_parallel_size=2)


# ---- the K re-rotation ----------------------------------------------------------------------

def _rope(d=16, n=64):
    return RotaryEmbedding(RopeSpec(theta=10000.0), d, n)


def _rotated(rot, x, pos):
    return apply_rotary(x, *(t[:, None, :] for t in rot.rows(pos)))


@pytest.mark.parametrize("kind, tol", [("auto", 1e-5), ("int8", 0.03), ("fp8_e4m3", 0.15)])
def test_shifted_keys_equal_keys_rotated_at_the_new_position(kind, tol):
    """Blocks 3 and 5 of a pool hold keys of positions 12..15 and 20..23 (block size 4):
    after a shift by 8 they must equal the same raw keys rotated at 4..7 and 12..15, up to
    the 8-bit format's rounding. Other blocks stay as they were."""
    torch.manual_seed(0)
    rot, d, kvh, bs = _rope(), 16, 2, 4
    fmt = kv_format(kind, torch.float32, d)
    raw = torch.randn(6, bs, kvh, d)
    pos = torch.arange(6 * bs).view(6, bs)
    stored = torch.stack([_rotated(rot, raw[b], pos[b]) for b in range(6)])
    scale = torch.full((kvh,), 0.05) if fmt.kind == "fp8" else None
    pool = quantize_rows(stored, fmt, scale)
    before = pool.clone()
    shift_block_keys(pool, torch.tensor([3, 5]), *rot.rows(8), fmt, scale)
    got = dequantize_rows(pool, fmt, torch.float32, scale)
    for b in (3, 5):
        want = _rotated(rot, raw[b], pos[b] - 8)
        err = (got[b] - want).abs().max() / want.abs().max()
        assert err < tol, (b, float(err))
    for b in (0, 1, 2, 4):
        assert torch.equal(pool[b].view(torch.uint8) if fmt.kind == "fp8" else pool[b],
                           before[b].view(torch.uint8) if fmt.kind == "fp8" else before[b])


def test_shift_composes():
    """Two shifts of 4 are one shift of 8 (float32 rounding)."""
    torch.manual_seed(1)
    rot, fmt = _rope(), kv_format("auto", torch.float32, 16)
    pool = torch.randn(3, 4, 2, 16)
    a, b = pool.clone(), pool.clone()
    idx = torch.tensor([0, 2])
    shift_block_keys(a, idx, *rot.rows(4), fmt)
    shift_block_keys(a, idx, *rot.rows(4), fmt)
    shift_block_keys(b, idx, *rot.rows(8), fmt)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ---- the manager and the policy -------------------------------------------------------------

def test_manager_evicts_the_middle_and_keeps_the_table_dense():
    kv = KVCacheManager(16, 4, enable_prefix_caching=False)
    table = kv.allocate("s", 30)  # 8 blocks
    moved = kv.evict_middle("s", 1, 3)
    assert moved == table[4:]
    assert kv.block_table("s") == [table[0], *table[4:]]
    assert kv.num_free_blocks == 16 - 5
    kv.check_integrity()
    kv.allocate("t", 4, prefix=None)
    with pytest.raises(ValueError, match="cannot evict"):
        kv.evict_middle("s", 1, 9)
    kv.free("s")
    kv.free("t")
    kv.check_integrity()
    assert kv.num_free_blocks == 16


def test_manager_refuses_to_rotate_a_shared_block():
    from engine.kv_cache.manager import PrefixHit

    kv = KVCacheManager(16, 4, enable_prefix_caching=False)
    table = kv.allocate("s", 20)
    kv.allocate("t", 13, PrefixHit(table[:3], 12))  # shares blocks 0..2
    with pytest.raises(ValueError, match="private"):
        kv.evict_middle("s", 0, 1)


def test_policy_positions_gap_and_shifts():
    kv = KVCacheManager(32, 4, enable_prefix_caching=False)
    stream = StreamingEviction(KVEvictionSpec(sink=3, window=8), kv)  # 1 sink + 2 window
    assert (stream.sink_blocks, stream.window_blocks, stream.sink_tokens) == (1, 2, 4)
    table = kv.allocate("s", 21)  # 6 blocks
    assert stream.evict("s", 20, prompt_done=False) == 0  # never inside the prompt
    assert stream.evict("s", 20, prompt_done=True) == 2  # 5 full: keep 1 + 2
    assert kv.block_table("s") == [table[0], *table[3:]]
    [shift] = stream.take_shifts()
    assert (shift.delta, shift.block_ids) == (8, tuple(table[3:]))
    assert stream.take_shifts() == ()
    assert stream.num_evicted_tokens("s") == 8 and stream.num_evicted_blocks == 2
    assert stream.cache_pos("s", 20) == 12 and stream.cache_pos("s", 3) == 3
    # A recomputation (computed back to 0) stops at the gap, then resumes behind it.
    assert stream.chunk_limit("s", 0, 21) == 4
    assert stream.resume_point("s", 4) == 12 and stream.resume_point("s", 0) == 0
    assert stream.chunk_limit("s", 12, 9) == 9
    stream.forget("s")
    assert stream.cache_pos("s", 20) == 20


# ---- admission and metrics ------------------------------------------------------------------

def _limits(max_cache_tokens):
    return AdmissionLimits(max_model_len=64, token_id_bound=100, block_size=4, num_blocks=20,
                           swap_blocks=0, max_cache_tokens=max_cache_tokens)


def test_admission_lets_a_streaming_request_run_past_the_context():
    cfg = EngineConfig()
    long = SamplingParams(max_tokens=1000)
    with pytest.raises(ValueError, match="maximum context length"):
        check_request(cfg, _limits(None), [1] * 10, long)
    check_request(cfg, _limits(28), [1] * 10, long)  # 7 blocks of cache at most
    check_request(cfg, _limits(28), [1] * 10, SamplingParams(max_tokens=1000, n=2))
    with pytest.raises(ValueError, match="maximum context length"):
        check_request(cfg, _limits(28), [1] * 64, long)  # the prompt must fit
    with pytest.raises(ValueError, match="pool"):  # 3 samples x 7 blocks > 20, no sharing
        check_request(cfg, _limits(28), [1] * 10, SamplingParams(max_tokens=1000, n=3))


def test_evicted_blocks_counter_counts_both_kinds():
    stats = EngineStats(num_blocks_released_window=2, num_blocks_evicted_stream=5)
    text = ServerMetrics("m", lambda: stats).render().decode()
    assert 'kvserve:kv_cache_evicted_blocks_total{model_name="m"} 7.0' in text


# ---- the scheduler --------------------------------------------------------------------------

def test_scheduler_plans_cache_positions_and_recomputes_around_the_gap():
    """Decoding past sinks + window: every chunk starts at the cache length, never past
    (1 + 2 + 1) blocks, and the plan carries each eviction's shift. A recompute preemption
    then recomputes the sink block (text 0..3, cache 0..3), jumps the gap at once, and
    recomputes the kept tail at cache positions 4.. with the tail's own token ids."""
    from engine.request import Request, Sequence
    from engine.scheduling.kv_setup import KVPool
    from engine.scheduling.scheduler import Scheduler, SchedulerOutput
    from engine.step.result import StepResult

    sched = Scheduler(EngineConfig(block_size=4, enable_prefix_caching=False,
                                   kv_eviction="sink:4,window:8"), KVPool(64, max_model_len=1024))
    kv, stream = sched.kv, sched.stream
    assert stream.spec == KVEvictionSpec(sink=4, window=8) and not kv.enable_prefix_caching
    prompt = list(range(10, 16))
    req = Request(request_id="r", prompt=None, prompt_token_ids=prompt,
                  params=SamplingParams(max_tokens=100))
    seq = Sequence(seq_id="r", index=0, request=req, token_ids=list(prompt), text_state=None,
                   generator=None)
    req.seqs.append(seq)
    sched.add_request(req)
    shifts = []
    for i in range(40):
        out = sched.schedule()
        [chunk] = out.plan.seqs
        shifts += out.plan.shifts
        assert chunk.start == seq.num_computed_tokens - stream.num_evicted_tokens("r")
        assert chunk.seq_len <= 16 and kv.num_live_blocks("r") <= 4
        result = StepResult(kv_written=True)
        result.update(seq).new_token_ids.append(100 + i)
        sched.update_from_output(out, result)
        kv.check_integrity()
    evicted = stream.num_evicted_tokens("r")
    assert evicted > 0 and sum(s.delta for s in shifts) == evicted
    sched._preempt(seq, SchedulerOutput())  # recompute: the blocks go, the gap stays
    assert seq.num_computed_tokens == 0 and kv.num_live_blocks("r") == 0
    out = sched.schedule()
    [chunk] = out.plan.seqs
    assert (chunk.start, chunk.token_ids, chunk.sample) == (0, seq.token_ids[:4], False)
    sched.update_from_output(out, StepResult(kv_written=True))
    assert seq.num_computed_tokens == 4 + evicted  # jumped at once
    out = sched.schedule()
    [chunk] = out.plan.seqs
    assert chunk.start == 4 and chunk.token_ids == seq.token_ids[4 + evicted:] and chunk.sample
    assert kv.num_live_blocks("r") <= 4
    stop = StepResult()
    stop.finish(seq, "stop")
    assert sched.update_from_output(SchedulerOutput(), stop) == [seq]
    assert kv.num_free_blocks == 64 and stream.num_evicted_tokens("r") == 0
