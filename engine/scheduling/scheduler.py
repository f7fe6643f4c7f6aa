"""Iteration-level scheduler: which sequences run this step, and how many tokens each.

Policy (step by step on :class:`Scheduler`): running sequences advance first, in admission order,
from the step's token budget (``max_num_batched_tokens``), preempting a victim when the KV pool
cannot hold one's new tokens (``engine.scheduling.preemption``; ``preemption_mode`` recompute,
swap or auto); if nothing was preempted, waiting sequences are admitted in (priority, arrival)
order while the budget, ``max_num_seqs`` and the pool allow, after a prefix-cache look-up;
speculative drafts and jump-forward tokens join decoding sequences
(``engine.scheduling.speculation``); streaming eviction (``engine.kv_cache.streaming``) drops
middle blocks before a running sequence's chunk.
The scheduler owns the waiting (a heap: ``engine.scheduling.waiting_queue``) and running sets and
the KV manager with its host tier: every allocate, free, look-up and commit goes through it. The
seam with the core is two calls a step: ``schedule`` (its ``plan``, a plain-data
``engine.step.plan.StepPlan``, goes to the model side) and ``update_from_output(out, result)``
(the core's decisions, ``engine.step.result``). A request ends between steps only by abort."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.config.engine import EngineConfig
from engine.kv_cache.manager import PrefixHit
from engine.lora.slots import LoRASlots
from engine.pooling.span import pool_span
from engine.request import Request, SeqStatus, Sequence
from engine.scheduling.image_chunks import chunk_images, fit_chunk
from engine.scheduling.kv_setup import KVPool, build_kv
from engine.scheduling.preemption import pick_victim
from engine.scheduling.prompt_span import prompt_logit_span
from engine.scheduling.speculation import forced_drafts, propose_drafts
from engine.scheduling.waiting_queue import WaitingQueue
from engine.spec_decode.proposer import Proposer
from engine.step.plan import BlockCopyOrders, SeqChunk, StepPlan
from engine.step.result import StepResult
from engine.structured.jump_forward import JumpForward

_NO_COPIES = BlockCopyOrders()


@dataclass
class ScheduledSeq:
    """The scheduler's own record of one scheduled sequence (the core's view); the model side
    gets the matching :class:`~engine.step.plan.SeqChunk` of ``SchedulerOutput.plan``."""

    seq: Sequence
    num_new_tokens: int  # the draft included
    sample: bool  # the chunk reaches the last known token: sample the next one
    draft: tuple[int, ...] = ()  # speculative tokens after the last known one
    forced: bool = False  # the draft is the grammar's forced text (jump-forward), not a guess

    @property
    def start(self) -> int:
        return self.seq.num_computed_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # decodes first
    preempted: list[Sequence] = field(default_factory=list)  # either mode
    swapped_out: list[Sequence] = field(default_factory=list)  # the preempted ones swapped
    swapped_in: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0
    # Plain data for the model side: ``scheduled`` in the same order, plus the step's copies.
    plan: StepPlan = field(default_factory=lambda: StepPlan((), 1))

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Policy, whole:

    1. Running sequences advance first, in admission order: a decode takes one token, a chunked
       prefill its next chunk; each takes from the step's token budget
       (``max_num_batched_tokens``). When the KV pool cannot hold a running sequence's new
       tokens, a victim is preempted (``engine.scheduling.preemption``): among the running
       sequences of the lowest priority class (one class under ``scheduling_policy="fcfs"``),
       the request running the MOST SEQUENCES gives back its most recently admitted one; on a
       tie, the most recently admitted sequence goes (vLLM's LIFO rule: the least work lost).
       Charging per running sequence makes a large-``n`` request yield its own samples first
       instead of keeping the pool while every newer request is preempted in turn. A sequence
       may end up preempting itself. ``preemption_mode``: recompute frees its blocks (its full
       blocks usually survive in the prefix cache, or spill to the host tier); swap moves its
       computed KV to the host tier; auto swaps when moving the blocks out and back is expected
       to cost less than recomputing its tokens. Swap falls back to recompute when there is no
       host tier or it has no room.
    2. If nothing was preempted, waiting sequences are admitted in (priority, arrival) order
       (arrival only under fcfs) while the budget, the sequence cap (``max_num_seqs``) and the
       pool allow. A swapped-out sequence is swapped back in and resumes where it stopped. Any
       other admission first looks up the prefix cache (device, then host); the rest of its
       tokens is its prefill, chunked to the budget, never ending inside an image's span
       (``engine.scheduling.image_chunks``). Samples 2..n of a request are parked
       outside the queue until sample 1 has computed the prompt (then they share its full
       blocks), so they cost nothing per step while they wait.
    3. Speculative decoding (``speculative_config``; ``engine.scheduling.speculation``): before
       the running sequences advance, decoding ones get drafts from the proposer (unless the
       batch is above the adaptive switch); a sequence with a draft takes ``1 + len(draft)``
       tokens of the budget. After the step the core reports the tokens verification kept and
       ``update_from_output`` rolls the KV back to them. Constrained sequences with no such
       draft get their grammar's forced tokens as one (jump-forward, ``ScheduledSeq.forced``).
    4. Streaming eviction (``--kv-eviction``; ``engine.kv_cache.streaming``): before a running
       sequence's chunk its middle blocks past sinks + window are evicted (the plan carries the
       kept keys' re-rotation); the KV manager and the plan count cache positions, the
       ``Sequence`` text positions. Prefix caching and sibling sharing are off under it.

    ``schedule`` returns a ``SchedulerOutput``: the core runs the copies of its ``plan`` and
    calls ``complete_copies``, then runs the forward pass, samples and checks stops;
    ``update_from_output(out, result)`` commits the chunks' K/V, appends the tokens, rolls
    rejected drafts back and frees finished sequences exactly once. The KV manager is built
    from the runner's pool geometry (``engine.scheduling.kv_setup``).
    """

    def __init__(self, config: EngineConfig, pool: KVPool,
                 proposer: Proposer | None = None,
                 jump_forward: JumpForward | None = None) -> None:
        """Builds the KV manager over ``pool`` (``engine.scheduling.kv_setup.build_kv``):
        ``self.kv``, which others may read (stats, snapshots) but never change. With a
        sliding window on every layer, a running sequence's blocks wholly behind it are
        given back each step. With ``config.kv_eviction`` (``self.stream``) a running
        sequence's middle blocks beyond sinks + window are evicted before each chunk; the KV
        manager and the plan then count cache positions (``stream.cache_pos``), the
        ``Sequence`` text positions. ``proposer`` drafts tokens when
        ``config.speculative_config`` is set. ``jump_forward`` drafts constrained sequences'
        forced tokens (not under eviction: a draft's rollback does not cross evicted
        blocks). ValueError for an eviction setting the model cannot take."""
        self.config = config
        self.spec = config.speculative_config if proposer is not None else None
        self.proposer = proposer
        setup = build_kv(config, pool)
        self.kv = setup.kv  # owned: nothing outside the scheduler allocates, frees or looks up
        self.stream = setup.stream
        self.eviction = setup.eviction  # the parsed --kv-eviction setting, None when off
        self.sliding_window = pool.sliding_window
        # A hybrid KV cache (engine.kv_cache.hybrid): per-group tables, per-group windows.
        self.hybrid = pool.is_hybrid
        self.jump_forward = jump_forward if self.stream is None else None
        # The host tier, when there is one (swap_space > 0): swap preemption and swap-in.
        self.has_host_tier = self.kv.host is not None
        self.use_priority = config.scheduling_policy == "priority"
        self.waiting = WaitingQueue(self.use_priority)
        self.running: list[Sequence] = []  # admission order
        # Samples 2..n waiting for sample 1 to compute the prompt, by request id.
        self._parked: dict[str, list[Sequence]] = {}
        self._num_parked = 0
        self._admit_counter = 0
        self.num_preemptions = 0
        self.num_preemptions_swap = 0
        self.num_preemptions_recompute = 0
        # A hook (the disk KV tier's): ``gate(seq, busy)`` False keeps ``seq`` waiting this
        # step (its KV blocks are still on their way); ``busy``: other sequences run.
        self.admission_gate: Callable[[Sequence, bool], bool] | None = None
        # A hook (the disk KV tier's write-through): called by ``update_from_output`` with
        # the scheduled sequences' ids once their chunks' blocks are committed, before any of
        # them is rolled back or freed.
        self.after_commit: Callable[[list[str]], object] | None = None
        # LoRA slots (engine.adapters, when LoRA is on): a sequence of an adapter pins its
        # slot from admission until it leaves the running set; with every slot pinned by
        # other adapters it waits at the head of the queue.
        self.lora: LoRASlots | None = None

    # ---- queue management --------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        first, *rest = request.seqs
        self._enqueue(first)
        if rest:
            for seq in rest:
                seq.status = SeqStatus.WAITING
            self._parked[request.request_id] = rest
            self._num_parked += len(rest)

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.push(seq)

    def _release_parked(self, request: Request) -> None:
        """Sample 1 has computed the prompt (or ended): queue the parked samples 2..n."""
        parked = self._parked.pop(request.request_id, None)
        if parked:
            self._num_parked -= len(parked)
            for seq in parked:
                if not seq.finished:
                    self._enqueue(seq)

    def abort_request(self, request: Request) -> None:
        """End every sequence of ``request`` ("abort") and free its blocks; sequences already
        finished are left as they are. For ends outside a step's ``update_from_output``: an
        abort from the API, a grammar that did not compile, an output that could not be
        built."""
        for seq in request.seqs:
            self._finish(seq, "abort")

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Take ``seq`` out of the queues and free its blocks (exactly once)."""
        if seq.finished:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif not self.waiting.remove(seq):
            parked = self._parked.get(seq.request.request_id)
            if parked is not None and seq in parked:
                parked.remove(seq)
                self._num_parked -= 1
                if not parked:
                    del self._parked[seq.request.request_id]
        self.kv.free(seq.seq_id)
        self._unpin_lora(seq)
        if self.stream is not None:
            self.stream.forget(seq.seq_id)
        if self.proposer is not None:
            self.proposer.release(seq.seq_id)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if seq.index == 0:
            self._release_parked(seq.request)  # they must now compute the prompt themselves

    def parked_seqs(self) -> list[list[Sequence]]:
        """Samples 2..n waiting for their sample 1, per request (read-only)."""
        return list(self._parked.values())

    @property
    def num_waiting_seqs(self) -> int:
        """Sequences not running and not finished (queued, parked, swapped out)."""
        return len(self.waiting) + self._num_parked

    @property
    def num_waiting_requests(self) -> int:
        """Requests with at least one waiting sequence."""
        extra = sum(1 for rid, seqs in self._parked.items()
                    if seqs and seqs[0].request.seqs[0] not in self.waiting)
        return self.waiting.num_requests + extra

    # ---- the step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        drafts = (propose_drafts(self.running, self.proposer, self.spec)
                  if self.spec is not None else {})
        forced = (forced_drafts(self.running, self.jump_forward, drafts)
                  if self.jump_forward is not None else {})
        drafts.update(forced)
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted earlier in this loop
                continue
            if self.stream is not None:  # jump a recomputation's gap, evict the middle
                self.stream.before_chunk(seq)
            remaining = self._remaining(seq, seq.num_computed_tokens)
            num_new = fit_chunk(seq.request.images, seq.num_computed_tokens,
                                min(remaining, budget), remaining)
            if not num_new:  # the rest of an image's span waits for a step with room
                continue
            draft = drafts.get(seq.seq_id)
            if draft:
                draft = self.kv.fit_draft(seq.seq_id, seq.num_tokens, draft, budget,
                                          len(self.running))
                num_new += len(draft)
            if not self._allocate_or_preempt(seq, self._cached(seq) + num_new, out):
                continue
            out.scheduled.append(ScheduledSeq(seq, num_new, self._samples(seq, num_new),
                                              tuple(draft) if draft else (),
                                              bool(draft) and seq.seq_id in forced))
            budget -= num_new
        if not out.preempted:
            budget = self._admit(out, budget)
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        # Decodes first: the attention backends take a fast path for the leading q_len == 1 run
        # (the torch backend extends it over the speculating decodes that follow).
        out.scheduled.sort(key=lambda s: 0 if s.num_new_tokens == 1 else 1 if s.draft else 2)
        out.plan = self._plan(out.scheduled)
        return out

    def _plan(self, scheduled: list[ScheduledSeq]) -> StepPlan:
        """The step as plain data: per sequence its new tokens, block table, sampling and prompt
        logit rows; plus the block copies recorded while scheduling (their host blocks stay
        pinned until ``complete_copies``)."""
        kv = self.kv
        table = kv.block_table
        chunks = []
        for s in scheduled:
            seq = s.seq
            start = seq.num_computed_tokens
            if s.draft:
                chunks.append(SeqChunk([seq.token_ids[start], *s.draft], start,
                                       table(seq.seq_id), True, None, len(s.draft),
                                       lora_slot=seq.lora_slot))
            else:
                chunks.append(SeqChunk(seq.token_ids[start:start + s.num_new_tokens],
                                       self._cached(seq), table(seq.seq_id), s.sample,
                                       prompt_logit_span(s.seq, s.start, s.num_new_tokens),
                                       pool=pool_span(seq, start, s.num_new_tokens),
                                       lora_slot=seq.lora_slot,
                                       images=chunk_images(seq.request.images, start,
                                                           s.num_new_tokens)))
            if self.hybrid:  # every KV group's table (engine.kv_cache.hybrid)
                tables = kv.group_tables(seq.seq_id)
                chunks[-1].block_table, chunks[-1].extra_tables = tables[0], tables[1:]
        seqs = tuple(chunks)
        shifts = self.stream.take_shifts() if self.stream is not None else ()
        copies = kv.take_copies() if self.has_host_tier else None
        if copies:
            return StepPlan(seqs, kv.block_size, BlockCopyOrders(tuple(copies.d2h),
                                                                 tuple(copies.h2d)), shifts)
        return StepPlan(seqs, kv.block_size, _NO_COPIES, shifts)

    def complete_copies(self) -> None:
        """The copies of the last plan have run (or failed): release the host blocks they
        pinned. Call once after every ``schedule``, before the next one."""
        if self.has_host_tier:
            self.kv.complete_copies()

    def _cached(self, seq: Sequence) -> int:
        """Tokens of ``seq`` in its KV cache: its computed tokens less any evicted ones."""
        if self.stream is None:
            return seq.num_computed_tokens
        return self.stream.cache_pos(seq.seq_id, seq.num_computed_tokens)

    def _remaining(self, seq: Sequence, start: int) -> int:
        """Tokens still to compute from text position ``start`` (under streaming eviction,
        a recomputation stops at the evicted gap: the sinks first)."""
        num_new = seq.num_tokens - start
        if self.stream is None:
            return num_new
        return self.stream.chunk_limit(seq.seq_id, start, num_new)

    @staticmethod
    def _samples(seq: Sequence, num_new: int) -> bool:
        # a pooling request (engine.pooling) never samples: its prompt's end finishes it
        return (seq.num_computed_tokens + num_new >= seq.num_tokens
                and seq.request.params.pooling is None)

    def _allocate_or_preempt(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        while self.kv.allocate(seq.seq_id, num_tokens) is None:
            victim = pick_victim(self.running, self.use_priority)
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        if self._swap_out(seq):
            self.num_preemptions_swap += 1
            out.swapped_out.append(seq)
        else:
            self.kv.free(seq.seq_id)
            self._unpin_lora(seq)
            seq.num_computed_tokens = 0
            self.num_preemptions_recompute += 1
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]
        self._enqueue(seq)

    def _swap_out(self, seq: Sequence) -> bool:
        """Swap ``seq`` out if the mode (and, for auto, the expected cost) says so and the host
        has room; False means: recompute it. Its computed tokens stay computed."""
        mode = self.config.preemption_mode
        if not self.has_host_tier or mode == "recompute":
            return False
        cached = self._cached(seq)
        if mode == "auto" and not self.kv.swap_is_cheaper(seq.seq_id, cached):
            return False
        return self.kv.swap_out(seq.seq_id, cached)

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.peek()
            if self.has_host_tier and self.kv.is_swapped(seq.seq_id):
                num_new = self._swap_in(seq, budget, out)
                if num_new is None:
                    break
                budget -= num_new
                continue
            if self.admission_gate is not None and not self.admission_gate(
                    seq, bool(self.running or out.scheduled)):
                break
            if not self._pin_lora(seq):
                break
            prefix = self._prefix_for(seq)
            start = prefix.num_tokens
            if self.stream is not None:  # a recomputation resuming past the evicted gap
                start = self.stream.resume_point(seq.seq_id, start)
            remaining = self._remaining(seq, start)
            if remaining > budget and not self.config.enable_chunked_prefill:
                break
            num_new = fit_chunk(seq.request.images, start, min(remaining, budget), remaining)
            if not num_new:  # an image's span waits for a step with room for all of it
                break
            cached = self.stream.cache_pos(seq.seq_id, start) if self.stream else start
            if self.kv.allocate(seq.seq_id, cached + num_new, prefix) is None:
                self._unpin_lora(seq)
                break
            self.waiting.pop()
            self.kv.record_prefix_stats(seq.num_tokens, prefix.num_tokens)
            seq.num_computed_tokens = start
            if seq.request.num_cached_tokens is None:
                seq.request.num_cached_tokens = prefix.num_tokens  # device and host hits
            self._start_running(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new, self._samples(seq, num_new)))
            budget -= num_new
        return budget

    def _swap_in(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int | None:
        """Resume swapped ``seq`` (at the head of the queue) with its next tokens; returns how
        many it computes this step, or None if it cannot run now (it keeps waiting)."""
        remaining = self._remaining(seq, seq.num_computed_tokens)
        if remaining > budget and not self.config.enable_chunked_prefill:
            return None
        num_new = fit_chunk(seq.request.images, seq.num_computed_tokens,
                            min(remaining, budget), remaining)
        if not num_new:
            return None
        if self.kv.swap_in(seq.seq_id, self._cached(seq) + num_new) is None:
            return None
        self.waiting.pop()
        self._start_running(seq)
        out.swapped_in.append(seq)
        out.scheduled.append(ScheduledSeq(seq, num_new, self._samples(seq, num_new)))
        return num_new

    def _pin_lora(self, seq: Sequence) -> bool:
        """Pin the slot of ``seq``'s adapter (placing it when not resident); False when every
        slot is pinned by other adapters. True at once for the base model."""
        lora_id = seq.request.lora_id
        if not lora_id or seq.lora_slot >= 0 or self.lora is None:
            return True
        slot = self.lora.acquire(lora_id)
        if slot is None:
            return False
        seq.lora_slot = slot
        return True

    def _unpin_lora(self, seq: Sequence) -> None:
        if seq.lora_slot >= 0 and self.lora is not None:
            self.lora.release(seq.lora_slot)
        seq.lora_slot = -1

    def _start_running(self, seq: Sequence) -> None:
        seq.status = SeqStatus.RUNNING
        seq.admit_order = self._admit_counter
        self._admit_counter += 1
        self.running.append(seq)

    def _prefix_for(self, seq: Sequence) -> PrefixHit:
        request = seq.request
        if request.wants_prompt_logprobs and (
                request.prompt_logprobs is None
                or len(request.prompt_logprobs) < request.num_prompt_tokens):
            return PrefixHit(block_ids=[], num_tokens=0)  # every prompt position needs logits
        if request.params.pooling is not None and request.params.pooling.needs_every_row:
            return PrefixHit(block_ids=[], num_tokens=0)  # mean / CLS pool every row
        hit = self.kv.find_prefix(seq.seq_id, seq.token_ids, request.cache_extra_keys,
                                  record_stats=False)
        first = request.seqs[0]
        if seq.index > 0 and first.status is SeqStatus.RUNNING:
            hit = self.kv.share_sibling_prefix(hit, first.seq_id, first.num_computed_tokens,
                                               seq.num_prompt_tokens)
        return hit

    def update_from_output(self, out: SchedulerOutput, result: StepResult) -> list[Sequence]:
        """Apply one step's outcome; returns the sequences it finished. In this order:

        1. when ``result.kv_written``: every scheduled sequence advances ``num_computed_tokens``
           by its chunk (a speculating one by its known token only), its newly full blocks go
           to the prefix cache and blocks behind the sliding window are given back; then the
           ``after_commit`` hook runs;
        2. per update, in the order the core decided them: its tokens are appended; a
           speculating sequence that goes on keeps its accepted drafts' K/V and the rest is
           rolled back (``KVCacheManager.truncate``); a finished one leaves the queues and
           its blocks are freed, exactly once (a sequence finished before is left alone)."""
        if result.kv_written:
            for s in out.scheduled:
                self._commit_chunk(s.seq, s.num_new_tokens - len(s.draft))
            if self.after_commit is not None:
                self.after_commit([s.seq.seq_id for s in out.scheduled])
        finished = []
        for u in result.updates.values():
            seq = u.seq
            if seq.finished:
                continue
            seq.token_ids.extend(u.new_token_ids)
            if u.finished:
                self._finish(seq, u.finish_reason, u.stop_reason)
                finished.append(seq)
            elif u.num_accepted_drafts is not None:
                self._accept_drafts(seq, u.num_accepted_drafts)
        return finished

    def _commit_chunk(self, seq: Sequence, num_computed: int) -> None:
        """``seq``'s chunk of ``num_computed`` tokens ran: count it and commit its newly full
        blocks (a speculating sequence counts its drafts once accepted)."""
        seq.num_computed_tokens += num_computed
        if self.stream is not None:  # a recomputation that redid the sinks: skip the gap
            seq.num_computed_tokens = self.stream.resume_point(seq.seq_id,
                                                               seq.num_computed_tokens)
        if not seq.finished:
            self._commit(seq)
        if (seq.index == 0 and seq.num_computed_tokens >= seq.num_prompt_tokens
                and seq.request.request_id in self._parked):
            self._release_parked(seq.request)

    def _accept_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """After verification: the first ``num_accepted`` draft tokens of ``seq``'s step and
        one token of the target's own have been appended to ``seq.token_ids``. Their K/V (all
        but the last token's) count as computed; the rest of what the step wrote is rolled
        back (``KVCacheManager.truncate``) and newly full blocks are committed."""
        seq.num_computed_tokens += num_accepted
        if seq.num_tokens != seq.num_computed_tokens + 1:
            raise RuntimeError(f"{seq.seq_id}: {seq.num_tokens} tokens but "
                               f"{seq.num_computed_tokens} computed after verification")
        self.kv.truncate(seq.seq_id, seq.num_tokens)
        self._commit(seq)

    def _commit(self, seq: Sequence) -> None:
        """Register ``seq``'s newly full computed blocks in the prefix cache and give back
        those wholly behind the sliding window."""
        self.kv.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens,
                       seq.request.cache_extra_keys)
        if self.sliding_window is not None or self.hybrid:
            self.kv.release_outside_window(seq.seq_id, seq.num_computed_tokens,
                                           self.sliding_window)
