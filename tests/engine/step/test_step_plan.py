"""The step plan as the model side sees it: plain data in, the packed batch out.

``build_model_input`` gets only a ``StepPlan`` (no sequence, no KV manager); positions and slots
are checked against a per-token loop over the block tables. The scheduler's plan is checked
against the scheduler's own state: each chunk's tokens, start and table.
"""

from __future__ import annotations

import torch

from engine.config.engine import EngineConfig
from engine.params.sampling import SamplingParams
from engine.request import Request, Sequence
from engine.runner.batch import build_model_input
from engine.scheduling.kv_setup import KVPool
from engine.scheduling.scheduler import Scheduler
from engine.step.plan import BlockCopyOrders, PromptLogitSpan, SeqChunk, StepPlan
from engine.step.result import StepResult

BS = 4


def test_build_model_input_from_plain_data():
    plan = StepPlan((
        SeqChunk([7], 5, [3, 1], sample=True),  # a decode at position 5
        SeqChunk([10, 11, 12], 4, [0, 2], sample=False,
                 prompt_logits=PromptLogitSpan(4, 6, (11, 12), 2)),
        SeqChunk([20, 21], 0, [5], sample=True),
    ), BS)
    inp = build_model_input(plan)
    assert inp.input_ids.tolist() == [7, 10, 11, 12, 20, 21]
    want_pos, want_slot = [], []
    for chunk in plan.seqs:
        for p in range(chunk.start, chunk.seq_len):
            want_pos.append(p)
            want_slot.append(chunk.block_table[p // BS] * BS + p % BS)
    assert inp.positions.tolist() == want_pos
    assert inp.slot_mapping.tolist() == want_slot
    assert inp.num_decodes == 1 and inp.seq_lens_list == [6, 7, 2]
    assert inp.block_tables.tolist() == [[3, 1], [0, 2], [5, 0]]
    assert inp.sample_seq_indices == [0, 2] and inp.sample_indices.tolist() == [0, 5]
    assert inp.prompt_indices.tolist() == [1, 2] and inp.prompt_targets.tolist() == [11, 12]
    assert inp.prompt_top_k == 2 and len(inp.prompt_rows) == 1
    r = inp.prompt_rows[0]
    assert (r.seq_index, r.row_start, r.row_end, r.first_target) == (1, 0, 2, 5)
    assert inp.cu_seqlens_q.dtype == torch.int32


def test_a_decode_only_step_indexes_as_a_mixed_one():
    """A decode-only step computes positions and slots in Python (batch._decode_slots), a
    mixed step with tensor ops: the same decode rows get the same values in both, every KV
    group of a hybrid cache included (an entry released outside a window, -1, reads as
    block 0), and both equal the per-token loop."""
    decodes = (SeqChunk([7], 5, [3, 1], sample=True, extra_tables=([-1, 4], [6, 8])),
               SeqChunk([9], 12, [0, 2, 5, 9], sample=True, extra_tables=([-1, -1, 7, 3],
                                                                         [1, 2, 10, 11])))
    prefill = SeqChunk([20, 21], 0, [12], sample=True, extra_tables=([13], [14]))
    alone = build_model_input(StepPlan(decodes, BS))
    mixed = build_model_input(StepPlan((*decodes, prefill), BS))
    assert alone.num_decodes == 2 and mixed.num_decodes == 2
    assert alone.positions.tolist() == mixed.positions.tolist()[:2] == [5, 12]
    assert alone.slot_mapping.tolist() == mixed.slot_mapping.tolist()[:2] == [1 * BS + 1,
                                                                              9 * BS]
    for g, want in enumerate(([4 * BS + 1, 3 * BS], [8 * BS + 1, 11 * BS])):
        assert alone.extra_slot_mappings[g].tolist() == want
        assert mixed.extra_slot_mappings[g].tolist()[:2] == want
        assert alone.extra_slot_mappings[g].dtype == mixed.extra_slot_mappings[g].dtype
    assert alone.positions.dtype == mixed.positions.dtype == torch.int64
    assert alone.slot_mapping.dtype == mixed.slot_mapping.dtype == torch.int64
    wrapped = build_model_input(StepPlan((SeqChunk([1], 4, [-1, 6], sample=True),), BS))
    assert wrapped.slot_mapping.tolist() == [6 * BS]


def test_copy_orders_are_falsy_when_empty():
    assert not BlockCopyOrders() and BlockCopyOrders(d2h=((1, 2),))
    assert StepPlan((), BS).num_tokens == 0


def test_scheduler_plan_matches_its_state():
    s = Scheduler(EngineConfig(block_size=BS, max_num_batched_tokens=64),
                  KVPool(32, max_model_len=4096))
    for rid, n in (("a", 9), ("b", 3)):
        prompt = list(range(100, 100 + n))
        req = Request(request_id=rid, prompt=None, prompt_token_ids=prompt,
                      params=SamplingParams(max_tokens=4), arrival_order=0)
        req.seqs.append(Sequence(seq_id=rid, index=0, request=req, token_ids=list(prompt),
                                 text_state=None, generator=None))
        s.add_request(req)
    for _ in range(2):
        out = s.schedule()
        assert len(out.plan.seqs) == len(out.scheduled) and not out.plan.copies
        for sc, chunk in zip(out.scheduled, out.plan.seqs):
            assert chunk.start == sc.start and chunk.sample == sc.sample
            assert chunk.token_ids == sc.seq.token_ids[sc.start:sc.start + sc.num_new_tokens]
            assert chunk.block_table == s.kv.block_table(sc.seq.seq_id)
            assert len(chunk.block_table) * BS >= chunk.seq_len
        s.complete_copies()
        result = StepResult(kv_written=True)
        for sc in out.scheduled:
            if sc.sample:
                result.update(sc.seq).new_token_ids.append(1)
        s.update_from_output(out, result)
