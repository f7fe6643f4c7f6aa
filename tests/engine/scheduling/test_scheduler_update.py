"""``Scheduler.update_from_output``: one call a step applies the core's per-sequence outcome
(tokens, accepted drafts, finishes) in the right order, on a real KV manager without a model.
Also the KV manager's draft-room and sibling-sharing operations, and ``StepResult``'s rules."""

from __future__ import annotations

from engine.config.engine import EngineConfig
from engine.kv_cache.manager import KVCacheManager, PrefixHit
from engine.params.sampling import SamplingParams
from engine.request import Request, SeqStatus, Sequence
from engine.scheduling.kv_setup import KVPool
from engine.scheduling.scheduler import Scheduler, SchedulerOutput
from engine.step.result import StepResult

BS = 4


class _FixedDrafts:
    """A proposer that always drafts the same tokens (cut to the room it is given)."""

    def __init__(self, draft: list[int]) -> None:
        self.draft = draft
        self.released: list[str] = []

    def propose(self, batch):
        return [self.draft[:r.max_tokens] for r in batch]

    def release(self, seq_id: str) -> None:
        self.released.append(seq_id)


def _request(rid: str, prompt_len: int, n: int = 1, max_tokens: int = 32) -> Request:
    prompt = list(range(10, 10 + prompt_len))
    req = Request(request_id=rid, prompt=None, prompt_token_ids=prompt,
                  params=SamplingParams(n=n, max_tokens=max_tokens))
    for i in range(n):
        req.seqs.append(Sequence(seq_id=f"{rid}#{i}", index=i, request=req,
                                 token_ids=list(prompt), text_state=None, generator=None))
    return req


def _step(s: Scheduler, token: int = 7) -> SchedulerOutput:
    """One plain step: every sampling sequence gets ``token``."""
    out = s.schedule()
    result = StepResult(kv_written=True)
    for sc in out.scheduled:
        if sc.sample:
            result.update(sc.seq).new_token_ids.append(token)
    s.update_from_output(out, result)
    s.kv.check_integrity()
    return out


def _spec_scheduler(draft: list[int]) -> tuple[Scheduler, _FixedDrafts]:
    proposer = _FixedDrafts(draft)
    config = EngineConfig(block_size=BS, speculative_config={"method": "ngram",
                                                             "num_speculative_tokens": 3})
    return Scheduler(config, KVPool(32, max_model_len=1024), proposer), proposer


def test_accepted_drafts_count_and_the_rest_rolls_back():
    s, _ = _spec_scheduler([1, 2, 3])
    req = _request("r", 6)
    s.add_request(req)
    _step(s)  # the prompt, then its first token
    seq = req.seqs[0]
    out = s.schedule()
    [sc] = out.scheduled
    assert sc.draft == (1, 2, 3) and s.kv.num_live_blocks(seq.seq_id) == 3  # 7 + 3 tokens
    result = StepResult(kv_written=True)
    result.update(seq).new_token_ids += [9]  # every draft rejected: the target's own token
    result.update(seq).num_accepted_drafts = 0
    assert s.update_from_output(out, result) == []
    assert seq.token_ids[6:] == [7, 9] and seq.num_computed_tokens == 7
    assert s.kv.num_live_blocks(seq.seq_id) == 2  # 8 tokens: the drafts' block rolled back
    s.kv.check_integrity()
    out = s.schedule()
    result = StepResult(kv_written=True)
    result.update(seq).new_token_ids += [1, 2, 5]  # two drafts kept, then its own token
    result.update(seq).num_accepted_drafts = 2
    s.update_from_output(out, result)
    assert seq.token_ids[8:] == [1, 2, 5] and seq.num_computed_tokens == 10
    assert s.kv.num_live_blocks(seq.seq_id) == 3
    s.kv.check_integrity()


def test_a_stop_mid_draft_frees_once_and_accepts_nothing():
    s, proposer = _spec_scheduler([1, 2, 3])
    req = _request("r", 6)
    s.add_request(req)
    _step(s)
    seq = req.seqs[0]
    out = s.schedule()
    result = StepResult(kv_written=True)
    result.update(seq).new_token_ids.append(1)
    result.finish(seq, "stop", 1)
    result.finish(seq, "length")  # the first reason recorded wins
    assert s.update_from_output(out, result) == [seq]
    assert (seq.finish_reason, seq.stop_reason, seq.status) == ("stop", 1, SeqStatus.FINISHED)
    assert seq.token_ids[6:] == [7, 1] and not s.running
    assert s.kv.stats().num_used_blocks == 0 and proposer.released == [seq.seq_id]
    again = StepResult()
    again.finish(seq, "abort")
    assert s.update_from_output(SchedulerOutput(), again) == []  # already finished: no-op
    assert seq.finish_reason == "stop"
    s.kv.check_integrity()


def test_abort_in_a_step_ends_parked_samples_too():
    s = Scheduler(EngineConfig(block_size=BS, max_num_batched_tokens=8),
                  KVPool(64, max_model_len=1024))
    req = _request("big", 20, n=3)
    s.add_request(req)
    out = s.schedule()  # sample 1's first chunk; samples 2 and 3 are parked
    result = StepResult(kv_written=True)
    result.abort(req)
    assert [u.seq.seq_id for u in result.updates.values()] == ["big#0", "big#1", "big#2"]
    assert s.update_from_output(out, result) == req.seqs
    assert all(seq.finish_reason == "abort" for seq in req.seqs)
    assert s.num_waiting_seqs == 0 and not s.running and s.kv.stats().num_used_blocks == 0
    s.kv.check_integrity()


def test_nothing_commits_when_the_forward_pass_did_not_finish():
    s = Scheduler(EngineConfig(block_size=BS), KVPool(16, max_model_len=1024))
    req = _request("r", 9)
    s.add_request(req)
    out = s.schedule()
    seq = req.seqs[0]
    s.update_from_output(out, StepResult(kv_written=False))
    assert seq.num_computed_tokens == 0 and s.kv.num_committed_blocks(seq.seq_id) == 0
    s.update_from_output(out, StepResult(kv_written=True))  # (the same chunk, run again)
    assert seq.num_computed_tokens == 9 and s.kv.num_committed_blocks(seq.seq_id) == 2


def test_step_result_abort_keeps_earlier_finishes_in_place():
    req = _request("r", 3, n=2)
    a, b = req.seqs
    result = StepResult()
    result.finish(a, "stop")
    other = _request("o", 3).seqs[0]
    result.update(other).new_token_ids.append(5)
    result.abort(req)
    assert [u.seq for u in result.updates.values()] == [a, other, b]
    assert result.updates[a.seq_id].finish_reason == "stop"
    assert result.is_finished(b) and not result.is_finished(other)


def test_kv_manager_fits_drafts_and_shares_sibling_prompt_blocks():
    m = KVCacheManager(6, BS, enable_prefix_caching=False)
    assert m.allocate("a", 8) is not None  # 2 blocks, 4 free
    assert m.fit_draft("a", 8, [1, 2, 3], budget=3, reserve_blocks=1) == [1, 2]  # budget - 1
    assert m.fit_draft("a", 8, [1, 2, 3], budget=8, reserve_blocks=3) == [1, 2, 3]
    assert m.fit_draft("a", 8, [1, 2, 3], budget=8, reserve_blocks=4) == []  # would preempt
    miss = PrefixHit(block_ids=[], num_tokens=0)
    hit = m.share_sibling_prefix(miss, "a", sibling_computed=8, num_prompt_tokens=9)
    assert hit.block_ids == m.block_table("a") and hit.num_tokens == 8
    # never the prompt's last token; never more than the sibling computed
    assert m.share_sibling_prefix(miss, "a", 8, num_prompt_tokens=8).num_tokens == 4
    assert m.share_sibling_prefix(miss, "a", 3, num_prompt_tokens=9) is miss
    off = KVCacheManager(6, BS, share_siblings=False)
    off.allocate("a", 8)
    assert off.share_sibling_prefix(miss, "a", 8, 9) is miss


def test_the_core_builds_no_kv_manager():
    """The scheduler builds and owns the KV manager and the eviction policy: the engine core
    imports neither (it reads ``scheduler.kv`` for stats)."""
    import ast
    from pathlib import Path

    import engine.core

    tree = ast.parse(Path(engine.core.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not imported & {"engine.kv_cache.manager", "engine.kv_cache.hybrid",
                           "engine.kv_cache.streaming", "engine.config.kv_eviction"}
