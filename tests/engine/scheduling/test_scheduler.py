"""Scheduler policy on a real KV manager, without a model: the waiting queue's order and cost,
samples 2..n parked while sample 1 computes the prompt, fair preemption, scheduling policy.

A step is emulated as the engine core runs it: ``schedule``, then ``update_from_output`` with
one token for every sequence that sampled.
"""

from __future__ import annotations

import pytest

from engine.config.engine import EngineConfig
from engine.params.sampling import SamplingParams
from engine.request import Request, SeqStatus, Sequence
from engine.scheduling.kv_setup import KVPool
from engine.scheduling.scheduler import Scheduler
from engine.scheduling.waiting_queue import WaitingQueue
from engine.step.result import StepResult

BS = 4


def make_request(rid: str, prompt_len: int, n: int = 1, arrival: int = 0, priority: int = 0,
                 first_token: int = 0) -> Request:
    prompt = [(first_token + i) % 250 for i in range(prompt_len)]
    req = Request(request_id=rid, prompt=None, prompt_token_ids=prompt,
                  params=SamplingParams(n=n, max_tokens=64), priority=priority,
                  arrival_order=arrival)
    for i in range(n):
        req.seqs.append(Sequence(seq_id=f"{rid}#{i}", index=i, request=req,
                                 token_ids=list(prompt), text_state=None, generator=None))
    return req


def make_scheduler(num_blocks: int = 64, **cfg) -> Scheduler:
    config = EngineConfig(block_size=BS, **cfg)
    return Scheduler(config, KVPool(num_blocks, max_model_len=4096))


def step(s: Scheduler):
    out = s.schedule()
    result = StepResult(kv_written=True)
    for sc in out.scheduled:
        if sc.sample and not sc.seq.finished:
            result.update(sc.seq).new_token_ids.append(7)
    s.update_from_output(out, result)
    s.kv.check_integrity()
    return out


def test_waiting_queue_orders_by_priority_then_arrival_then_index():
    reqs = [make_request("a", 3, n=2, arrival=2, priority=1), make_request("b", 3, arrival=1),
            make_request("c", 3, arrival=3, priority=-1)]
    q = WaitingQueue(use_priority=True)
    for r in reqs:
        for seq in reversed(r.seqs):
            q.push(seq)
    assert len(q) == 4 and q.num_requests == 3
    assert [q.pop().seq_id for _ in range(4)] == ["c#0", "b#0", "a#0", "a#1"]
    assert not q and q.peek() is None
    fcfs = WaitingQueue(use_priority=False)
    for r in reqs:
        fcfs.push(r.seqs[0])
    assert [fcfs.pop().seq_id for _ in range(3)] == ["b#0", "a#0", "c#0"]


def test_waiting_queue_remove_is_lazy_and_exact():
    reqs = [make_request(f"r{i}", 2, arrival=i) for i in range(200)]
    q = WaitingQueue()
    for r in reqs:
        q.push(r.seqs[0])
    for r in reqs[::2]:
        assert q.remove(r.seqs[0])
    assert not q.remove(reqs[0].seqs[0])
    assert reqs[0].seqs[0] not in q and reqs[1].seqs[0] in q
    q.push(reqs[0].seqs[0])  # back in after a removal: one live entry
    with pytest.raises(ValueError, match="already waiting"):
        q.push(reqs[0].seqs[0])
    order = [q.pop().request.request_id for _ in range(len(q))]
    assert order == ["r0"] + [f"r{i}" for i in range(1, 200, 2)]
    assert len(q._heap) <= 2 * len(q) + 64  # dead entries do not pile up


def test_inserts_compute_one_key_each(monkeypatch):
    """O(log n) per insert: no rebuilding of the whole key list (it was O(waiting) each)."""
    calls = {"n": 0}
    real = WaitingQueue.key

    def counting(self, seq):
        calls["n"] += 1
        return real(self, seq)

    monkeypatch.setattr(WaitingQueue, "key", counting)
    s = make_scheduler()
    for i in range(500):
        s.add_request(make_request(f"r{i}", 3, arrival=i))
    assert calls["n"] == 500
    assert len(s.waiting) == 500


def test_waiting_samples_are_parked_not_requeued_every_step(monkeypatch):
    """n=32 with a chunked 40-token prefill: samples 2..n wait outside the queue while sample
    1 computes the prompt (each step used to pop and re-insert all of them), then join and
    share its full prompt blocks."""
    pushes = {"n": 0}
    real = WaitingQueue.push

    def counting(self, seq):
        pushes["n"] += 1
        return real(self, seq)

    monkeypatch.setattr(WaitingQueue, "push", counting)
    s = make_scheduler(num_blocks=256, max_num_batched_tokens=8, max_num_seqs=64)
    big = make_request("big", 40, n=32)
    s.add_request(big)
    assert pushes["n"] == 1 and s.num_waiting_seqs == 32 and s.num_waiting_requests == 1
    for _ in range(4):  # 40 prompt tokens in 8-token chunks: five steps
        step(s)
        assert pushes["n"] == 1
        assert all(seq.status is SeqStatus.WAITING for seq in big.seqs[1:])
    assert s.num_waiting_seqs == 31 and s.num_waiting_requests == 1
    step(s)  # the last chunk: the prompt is computed, the samples join the queue
    assert big.seqs[0].num_computed_tokens == 40 and pushes["n"] == 32
    step(s)
    first_table = s.kv.block_table("big#0")
    sib = big.seqs[1]
    assert sib.status is SeqStatus.RUNNING
    assert s.kv.block_table(sib.seq_id)[:9] == first_table[:9]  # the prompt's full blocks


def test_aborting_parked_samples_frees_everything():
    s = make_scheduler(max_num_batched_tokens=8)
    big = make_request("big", 40, n=4)
    s.add_request(big)
    step(s)
    s.abort_request(big)
    assert s.num_waiting_seqs + len(s.running) == 0 and s.num_waiting_seqs == 0 and not s.waiting
    assert s.kv.stats().num_used_blocks == 0
    s.kv.check_integrity()


def test_large_n_request_yields_its_own_samples_before_newer_requests():
    """A large-n request admitted first fills the pool; a newer single request must not be
    the one preempted each time (plain LIFO did that): the request running the most
    sequences gives back its newest sample."""
    s = make_scheduler(num_blocks=24, max_num_seqs=16)
    big = make_request("big", 4, n=6, arrival=0)
    s.add_request(big)
    step(s)  # sample 1 computes the prompt
    small = make_request("small", 4, arrival=1, first_token=100)
    s.add_request(small)
    preempted = []
    for _ in range(20):
        out = step(s)
        preempted += [p.request.request_id for p in out.preempted]
        if preempted:
            break
    assert preempted and set(preempted) == {"big"}
    assert small.seqs[0].status is SeqStatus.RUNNING


def test_ties_keep_lifo_and_priority_policy_preempts_low_priority_first():
    s = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    a, b = make_request("a", 8, arrival=0), make_request("b", 8, arrival=1, first_token=50)
    s.add_request(a)
    s.add_request(b)
    step(s)  # both admitted: 4 of 6 blocks
    preempted = []
    for _ in range(12):
        preempted += [p.request.request_id for p in step(s).preempted]
    assert preempted and preempted[0] == "b"  # one sequence each: the newest goes

    p = make_scheduler(num_blocks=6, max_num_batched_tokens=64, scheduling_policy="priority")
    lo = make_request("lo", 8, arrival=0, priority=5)
    hi = make_request("hi", 8, arrival=1, priority=0, first_token=50)
    p.add_request(lo)
    p.add_request(hi)
    step(p)
    preempted = []
    for _ in range(12):
        preempted += [x.request.request_id for x in step(p).preempted]
    assert preempted and set(preempted) == {"lo"}


def test_fcfs_ignores_priority_in_the_queue():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("old", 3, arrival=0, priority=9))
    s.add_request(make_request("new", 3, arrival=1, priority=-9))
    assert [sc.seq.request.request_id for sc in step(s).scheduled] == ["old"]
