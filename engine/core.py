"""EngineCore: one synchronous engine step = schedule, run the model, sample, update.

The scheduler builds and owns the KV manager and its host tier. ``Scheduler.schedule`` gives the
plain-data ``StepPlan``; the runner takes it in one call (``Runner.execute``: key shifts and
block copies, then the forward pass) and returns a ``StepOutput`` indexed by the plan's chunks;
once the core has sampled, verified drafts and checked stops, ``Scheduler.update_from_output``
applies the step's ``StepResult``. Between steps a request ends through
``Scheduler.abort_request``.

Not thread-safe: one thread drives ``add_request`` / ``abort_request`` / ``step``; only
``check_request`` (pure) may be called from elsewhere. An accepted request always ends with a
final ``RequestOutput``; its KV blocks are freed exactly once. Inside ``step`` the per-request
work after the forward pass runs guarded: an exception there ends THAT request ("abort",
``RequestOutput.error`` set); device out-of-memory aborts the step's requests; any other
exception propagates (the engine's state can no longer be trusted: ``AsyncEngine`` dies)."""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
from collections.abc import Collection, Iterable

import torch

from engine.adapters import Adapters
from engine.assembly import assemble
from engine.config.engine import EngineConfig
from engine.core_stats import engine_stats
from engine.kv_cache.hashing import media_key
from engine.kv_cache.reset import cache_tiers, reset_prefix_cache
from engine.kv_cache.snapshot import KVSnapshot
from engine.params.prompt_image import PromptImage
from engine.params.sampling import SamplingParams
from engine.pooling.accumulate import add_rows, finish_vector
from engine.postprocess.builder import (
    bare_error_output,
    build_request_output,
    record_prompt_logprobs,
    record_sample_logprobs,
)
from engine.postprocess.stop import SequenceTextState
from engine.request import Request, Sequence
from engine.request_output import RequestOutput
from engine.runner.device import set_device_for_thread
from engine.runner.protocol import Runner
from engine.sampling.row import SamplingRow
from engine.sampling.sampler import Sampler, SamplerOutput
from engine.scheduling.admission import check_request
from engine.scheduling.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from engine.spec_decode.verifier import DraftRun, rows_for_draft, split_rows, verify
from engine.stats import EngineStats
from engine.step.output import StepOutput
from engine.step.plan import SeqChunk
from engine.step.result import StepResult
from engine.structured.head_columns import GrammarColumns, RowSource
from engine.structured.masking import FilledRows
from engine.structured.state import (
    ConstraintFailedError,
    PendingMask,
    StructuredOutputs,
    failure_error,
)

logger = logging.getLogger("kvserve.engine")
_OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


class EngineCore:
    # Its parts, built once by ``assemble`` (engine/assembly.py); among them:
    config: EngineConfig
    runner: Runner  # the model side: one call per step, ``execute(plan)``
    scheduler: Scheduler  # builds and owns the KV manager (``kv``: read-only here)
    structured: StructuredOutputs  # constrained decoding
    adapters: Adapters | None  # LoRA adapters (engine/adapters.py), None when LoRA is off
    sampler: Sampler

    def __init__(self, config: EngineConfig) -> None:
        self._awaiting_grammar: list[Request] = []  # constrained, grammar still compiling
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._finished_unreported: list[Request] = []
        # The running step's per-sequence outcome (None between steps): filled by the guarded
        # per-request work, applied by ``Scheduler.update_from_output`` once per step.
        self._result: StepResult | None = None
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "num_steps": 0,
                         "computed_tokens": 0, "restricted_logit_rows": 0}
        # The model, runner, scheduler (and its KV manager), tiers, sampler, limits, pooling
        # and constrained decoding: engine/assembly.py.
        assemble(self, config)

    # ---- requests ------------------------------------------------------------------------

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams, *,
                      priority: int = 0, images: tuple[PromptImage, ...] = ()) -> None:
        """Raise ValueError (user-facing) if this request can never be served. Pure; see
        ``engine.scheduling.admission.check_request``; ``images`` must sit on the prompt's
        image placeholders (``engine.vision.prompt_format``), and only a vision model takes
        them."""
        check_request(self.config, self.limits, prompt_token_ids, params, priority)
        fmt = self.image_format
        if images and fmt is None:
            raise ValueError(f"model {self.model_name} does not take images")
        if fmt is not None:
            fmt.check(tuple(images), prompt_token_ids)
            budget = self.config.max_num_batched_tokens
            if images and fmt.tokens_per_image > budget:
                raise ValueError(f"an image takes {fmt.tokens_per_image} tokens, more than "
                                 f"one step computes (max_num_batched_tokens {budget})")
        if params.lora_name is not None:
            if self.adapters is None:
                raise ValueError("this engine serves no LoRA adapters (start it with "
                                 "--enable-lora)")
            self.adapters.check(params.lora_name)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    *, prompt: str | None = None, arrival_time: float | None = None,
                    priority: int = 0, validated: bool = False,
                    images: tuple[PromptImage, ...] = ()) -> None:
        """Queue a request. ValueError (user-facing) for one that can never be served, unless
        ``validated``: the caller ran :meth:`check_request` on these same arguments
        (``AsyncEngine.submit`` does, on its own thread)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_token_ids = list(prompt_token_ids)
        if not validated:
            self.check_request(prompt_token_ids, params, priority=priority, images=images)
        if params.max_tokens is None:
            params = params.clone(max_tokens=self.max_model_len - len(prompt_token_ids))
        req = Request(request_id=request_id, prompt=prompt, prompt_token_ids=prompt_token_ids,
                      params=params, priority=priority, arrival_order=next(self._arrivals))
        if arrival_time is not None:
            req.metrics.arrival_time = arrival_time
        if params.cache_salt:
            req.cache_extra_keys = (("salt", params.cache_salt),)
        if self.adapters is not None:
            self.adapters.resolve(req)  # its lora_id, and its adapter in its KV keys
        if images:  # each image's content keys the blocks its placeholders touch
            req.images = tuple(images)  # in prompt order: check_request pairs them with the runs
            req.cache_extra_keys = (*req.cache_extra_keys, media_key(
                [(i.offset, i.length, i.key) for i in req.images]))
        for i in range(params.n):
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device="cpu").manual_seed(params.seed + i)
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            req.seqs.append(Sequence(
                seq_id=seq_id, index=i, request=req, token_ids=list(prompt_token_ids),
                text_state=SequenceTextState(self.tokenizer, prompt_token_ids, params,
                                             self.eos_token_ids),
                generator=generator,
                logprobs=[] if params.logprobs is not None else None))
        self.requests[request_id] = req
        self.counters["prompt_tokens"] += len(prompt_token_ids)
        if self.disk is not None and not req.wants_prompt_logprobs:
            # Looked up on arrival: its disk blocks load into host memory while it waits.
            self.disk.on_arrival(req.seqs[0], prompt_token_ids, req.cache_extra_keys)
        if params.structured is None and params.thinking is not None:
            for seq in req.seqs:  # a thinking budget alone: forced where it is spent
                seq.matcher = self.structured.gated(params.thinking)
        if params.structured is not None:
            req.grammar = self.structured.submit(params.structured)
            if not req.grammar.done():
                self._awaiting_grammar.append(req)
                return
            self._start_constrained(req)
            if req.finished:
                self._finished_unreported.append(req)
                return
        self.scheduler.add_request(req)

    def _start_constrained(self, req: Request) -> None:
        """Give each sequence of ``req`` (grammar compiled) its matcher; a grammar that did not
        compile ends the request ("abort", ``error`` naming the problem)."""
        exc = req.grammar.exception()
        if exc is not None:
            req.error = str(exc)
            req.error_code = "invalid_constraint" if isinstance(exc, ValueError) else None
            self.scheduler.abort_request(req)
            return
        compiled = req.grammar.result()
        gate = req.params.thinking
        for seq in req.seqs:  # a reasoning model's constraint applies after its thought
            seq.matcher = (self.structured.matcher(compiled) if gate is None
                           else self.structured.gated(gate, compiled))

    def _admit_compiled(self, touched: dict[str, Request]) -> None:
        """Requests whose grammar has compiled join the scheduler. When nothing else can run,
        wait (briefly) for a compile instead of spinning."""
        if not self._awaiting_grammar:
            return
        if not self.scheduler.running and not self.scheduler.num_waiting_seqs:
            pending = [r.grammar for r in self._awaiting_grammar if not r.finished]
            if pending:
                concurrent.futures.wait(pending, timeout=0.05,
                                        return_when=concurrent.futures.FIRST_COMPLETED)
        still = []
        for req in self._awaiting_grammar:
            if req.finished:  # aborted while compiling
                continue
            if not req.grammar.done():
                still.append(req)
                continue
            self._start_constrained(req)
            if req.finished:
                touched[req.request_id] = req
            else:
                self.scheduler.add_request(req)
        self._awaiting_grammar = still

    def abort_request(self, request_ids: Iterable[str]) -> None:
        """Finish the named requests with reason "abort" (unknown or finished ids: no-op)."""
        for rid in list(request_ids):
            req = self.requests.get(rid)
            if req is None:
                continue
            self.scheduler.abort_request(req)
            self._finished_unreported.append(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the model and sample, update. Returns the (cumulative)
        outputs of requests that progressed."""
        touched = self._between_steps()
        out = self.scheduler.schedule()
        result, completed = self._run_step(out, touched)
        self.scheduler.update_from_output(out, result)
        if self.kv_events is not None:  # this step's committed and evicted blocks, at once
            self.kv_events.flush()
        return self._outputs(touched, completed)

    def _between_steps(self) -> dict[str, Request]:
        """The requests to report whatever the step does (ended since the last one), after the
        disk tier's loads are polled and the requests whose grammar compiled are admitted."""
        touched: dict[str, Request] = {r.request_id: r for r in self._finished_unreported}
        self._finished_unreported = []
        if self.disk is not None:
            self.disk.poll()
        self._admit_compiled(touched)
        return touched

    def _run_step(self, out: SchedulerOutput, touched: dict[str, Request],
                  ) -> tuple[StepResult, bool]:
        """The runner's call and every request's share of its outcome (``_run``), as the
        ``StepResult`` for ``update_from_output``; True when some sequence sampled. Out of
        device memory ends the step's requests (``_fail_step``)."""
        self._result = result = StepResult()
        completed = False
        try:
            if out.empty:  # the runner moves blocks (key shifts, copies) before any forward pass
                self._execute(out)
            else:
                try:
                    completed = self._run(out, touched)
                except _OUT_OF_MEMORY:
                    self._fail_step(out, touched)
        finally:
            self._result = None
        return result, completed

    def _outputs(self, touched: dict[str, Request], completed: bool) -> list[RequestOutput]:
        """A cumulative ``RequestOutput`` per touched request (one whose output fails to build
        ends, "abort"); finished requests are forgotten."""
        if completed:
            now = time.time()
            for req in touched.values():
                if req.finished and req.metrics.finished_time is None:
                    req.metrics.finished_time = now
        outputs = []
        for req in touched.values():
            try:
                outputs.append(build_request_output(req))
            except Exception as exc:  # noqa: BLE001 - that request ends, the others go on
                self._fail_request(req, exc, {})
                outputs.append(bare_error_output(req))
            if req.finished:
                self.requests.pop(req.request_id, None)
                if self.disk is not None:
                    for seq in req.seqs:
                        self.disk.forget(seq.seq_id)
                if req.num_cached_tokens:  # the KV page's largest shared prefixes
                    self.kv_snapshots.prefixes.observe(req.num_cached_tokens, req.request_id,
                                                       req.prompt_token_ids)
        return outputs

    @property
    def health_check_interval(self) -> float | None:
        """Seconds between :meth:`check_health` calls while idle (None: not needed)."""
        return self.runner.health_check_interval

    def check_health(self) -> None:
        """Raise when the engine can no longer run a step (a tensor-parallel worker died)."""
        self.runner.check_health()

    def close(self) -> None:
        """Release what outlives the object (tensor-parallel workers). Idempotent."""
        self.structured.close()
        if self.disk is not None:
            self.disk.close()
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
        self.runner.close()

    def bind_thread(self) -> None:
        """Call on the thread that will drive ``step``: kernels launch on the engine's device
        (``cuda:N``), not on the thread's default device 0."""
        set_device_for_thread(self.runner.device)

    def _fail_step(self, out: SchedulerOutput, touched: dict[str, Request]) -> None:
        """The device ran out of memory inside this step: its requests end ("abort", told
        why in the log; their blocks are freed by ``update_from_output``); the engine serves
        the others."""
        ids = sorted({s.seq.request.request_id for s in out.scheduled})
        logger.error("out of device memory in a step of %d tokens; aborting its %d "
                     "request(s): %s", out.num_batched_tokens, len(ids), ", ".join(ids[:8]))
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()
        for rid in ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            req.error = req.error or "out of device memory while running this request"
            self._result.abort(req)
            touched[rid] = req

    def _fail_request(self, req: Request, exc: BaseException,
                      touched: dict[str, Request]) -> None:
        """End ``req`` after an error in its own work: finish_reason "abort", ``error`` set,
        blocks freed (once: in a step by ``update_from_output``, after it at once). An internal
        error logs its traceback; a constraint that failed (the request's own input) logs one
        line and sets ``error_code``. The engine goes on."""
        if isinstance(exc, ConstraintFailedError):
            logger.warning("request %s aborted: %s", req.request_id, exc)
            req.error = req.error or str(exc)
            req.error_code = req.error_code or "constraint_failed"
            if req.params.structured is not None:
                self.structured.refuse(req.params.structured, str(exc))
        else:
            logger.error("request %s failed inside the engine step and is aborted: %s: %s",
                         req.request_id, type(exc).__name__, exc, exc_info=exc)
            req.error = req.error or f"internal error: {type(exc).__name__}: {exc}"
        if self._result is not None:
            self._result.abort(req)
        else:
            self.scheduler.abort_request(req)
        touched[req.request_id] = req

    def _guarded(self, req: Request, touched: dict[str, Request], fn, *args) -> None:
        """Run one request's share of the step; an exception ends that request only."""
        if req.error is not None:
            return
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - isolation is the point
            self._fail_request(req, exc, touched)

    def _execute(self, out: SchedulerOutput, columns: GrammarColumns | None = None,
                 ) -> StepOutput:
        """The runner's one call for this step (key shifts, block copies, forward pass); the
        copies' host blocks are released after it, whatever happens. ``columns``: the
        grammar-restricted sampled rows, for a runner that ``restricts_logits``."""
        try:
            if out.empty and not (out.plan.copies or out.plan.shifts):
                return StepOutput()
            if columns is not None:
                return self.runner.execute(out.plan, sample_columns=columns)
            return self.runner.execute(out.plan)
        finally:
            self.scheduler.complete_copies()

    def _grammar_rows(self, out: SchedulerOutput, pending: PendingMask | None,
                      touched: dict[str, Request],
                      ) -> tuple[dict[int, FilledRows], GrammarColumns | None]:
        """The speculating constrained sequences' verification bitmasks (by entry of
        ``out.scheduled``), filled before the forward pass, and the step's sampled rows as
        vocabulary columns when the runner can restrict its logits head to them
        (engine/runner/logit_columns.py)."""
        drafts: dict[int, FilledRows] = {}
        rows: list[RowSource] = []
        plain = 0
        for i, (s, c) in enumerate(zip(out.scheduled, out.plan.seqs, strict=True)):
            if not c.sample:
                continue
            matcher = s.seq.matcher
            if s.draft:
                filled = None
                if matcher is not None:
                    try:
                        drafts[i] = filled = self.structured.fill_draft(matcher, s.draft)
                    except ConstraintFailedError as exc:  # this request ends; the step goes on
                        self._fail_request(s.seq.request, exc, touched)
                    except Exception:  # noqa: BLE001  (refilled in _verify_one, guarded there)
                        logger.exception("filling a draft's bitmasks failed")
                if filled is not None:
                    rows += [((lambda f=filled: f), j) for j in range(len(s.draft) + 1)]
                else:
                    rows += [None] * (len(s.draft) + 1)
            else:
                rows.append((pending.result, plain)
                            if matcher is not None and pending is not None else None)
                plain += 1
        restrict = self.restrict_logits_head and any(r is not None for r in rows)
        return drafts, self.structured.columns(rows) if restrict else None

    def _run(self, out: SchedulerOutput, touched: dict[str, Request]) -> bool:
        """The forward pass and every request's share of its outcome, recorded in
        ``self._result``. True when it ran to the end (some sequence sampled)."""
        now = time.time()
        self.counters["num_steps"] += 1
        self.counters["computed_tokens"] += out.num_batched_tokens
        for s in out.scheduled:
            m = s.seq.request.metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
        # Constrained rows' bitmasks: filled during the forward pass or before it (measured).
        pending = self.structured.start_mask([
            s.seq.matcher for s, c in zip(out.scheduled, out.plan.seqs, strict=True)
            if c.sample and not s.draft]) if self.structured.in_use else None
        drafts, columns = (self._grammar_rows(out, pending, touched) if self.structured.in_use
                           else ({}, None))
        result = self._execute(out, columns)  # a failure here is the engine's, not a request's
        self._result.kv_written = True
        if result.prompt_logprobs is not None:
            for rows in result.prompt_rows:
                req = out.scheduled[rows.seq_index].seq.request
                self._guarded(req, touched, record_prompt_logprobs, req, rows,
                              result.prompt_logprobs, self.token_text)
                touched[req.request_id] = req
        pooled = self._take_pooled(out, result, touched) if result.pooled or any(
            s.seq.request.params.pooling is not None for s in out.scheduled) else False
        if not result.sampled:
            return pooled
        logits = result.sample_logits
        restricted = set(result.restricted_rows)
        self.counters["restricted_logit_rows"] += len(restricted)
        scheduled = [out.scheduled[i] for i, _ in result.sampled]
        if any(s.draft for s in scheduled):  # rows: 1 per plain sequence, 1 + k speculating
            plain, spec = split_rows([len(rows) for _, rows in result.sampled])
            self._verify_drafts([scheduled[i] for i, _ in spec], logits,
                                [r for _, r in spec], touched,
                                [drafts.get(result.sampled[i][0]) for i, _ in spec], restricted)
            scheduled = [scheduled[i] for i, _ in plain]
            plain_skip = {k for k, (_, r) in enumerate(plain) if r.start in restricted}
            if scheduled:
                logits = logits.index_select(0, torch.tensor([r.start for _, r in plain],
                                                             device=logits.device))
        else:
            plain_skip = restricted
        seqs = [s.seq for s in scheduled]
        picks = self._sample(logits, seqs, touched, pending, plain_skip) if seqs else []
        now = time.time()
        for seq, pick in zip(seqs, picks, strict=True):
            if pick is not None and not self._result.is_finished(seq):
                self._guarded(seq.request, touched, self._append_token, seq, pick[0], pick[1],
                              now)
            touched[seq.request.request_id] = seq.request
        return True

    def _take_pooled(self, out: SchedulerOutput, result: StepOutput,
                     touched: dict[str, Request]) -> bool:
        """Pooling requests (``engine.pooling``): add the step's pooled rows to each one's
        sum; a chunk that reached the prompt's end finishes its request ("stop") with the
        vector. Per request and guarded. True when one finished."""
        vectors = dict(result.pooled)
        done = False
        for i, (s, chunk) in enumerate(zip(out.scheduled, out.plan.seqs, strict=True)):
            req = s.seq.request
            if req.params.pooling is None:
                continue
            self._guarded(req, touched, self._pool_one, s, chunk, vectors.get(i))
            if self._result.is_finished(s.seq):
                touched[req.request_id] = req
                done = True
        return done

    def _pool_one(self, s: ScheduledSeq, chunk: SeqChunk, vec: torch.Tensor | None) -> None:
        seq = s.seq
        req = seq.request
        if vec is not None:
            req.pooled_sum = add_rows(req.pooled_sum, vec)
            req.pooled_upto = chunk.pool.last
        if s.start + s.num_new_tokens < req.num_prompt_tokens:
            return
        if req.pooled_sum is None:
            raise RuntimeError("the prompt ran to its end but no row was pooled")
        req.pooled = finish_vector(req.pooled_sum, req.pooled_upto, req.params.pooling)
        now = time.time()
        m = req.metrics
        m.first_token_time = m.first_token_time or now
        m.last_token_time = now
        self._result.finish(seq, "stop")

    def _row(self, s: Sequence) -> SamplingRow:
        return SamplingRow(params=s.request.params, prompt_token_ids=s.request.prompt_token_ids,
                           output_token_ids=s.text_state.token_ids, generator=s.generator,
                           eos_token_ids=self.eos_token_ids, cache=s.request.sampler_cache)

    def _verify_drafts(self, spec: list[ScheduledSeq], logits: torch.Tensor,
                       row_ranges: list[range], touched: dict[str, Request],
                       masks: list[FilledRows | None], restricted: set[int]) -> None:
        """Verify each speculating sequence's rows (``engine.spec_decode.verifier``), take
        the kept tokens one by one (a stop ends the sequence where one-token decoding would)
        and record how many drafts were accepted (``update_from_output`` rolls its KV back to
        them). Per sequence and guarded: a failure ends that request."""
        now = time.time()
        for s, rows, mask in zip(spec, row_ranges, masks, strict=True):
            touched[s.seq.request.request_id] = s.seq.request
            skip = {r - rows.start for r in rows if r in restricted}
            self._guarded(s.seq.request, touched, self._verify_one, s, logits[rows.start:rows.stop],
                          now, mask, skip)

    def _verify_one(self, s: ScheduledSeq, logits: torch.Tensor, now: float,
                    mask: FilledRows | None = None, skip: set[int] | None = None) -> None:
        seq = s.seq
        if seq.matcher is not None:
            # The scheduler cut the draft to what the grammar allows (scheduling/drafts.py);
            # each row is masked as one-token decoding would have masked it (the rows the
            # logits head computed at their allowed tokens only are so already). A mask that
            # failed before the forward pass is filled again here, where a failure ends only
            # this request.
            if mask is None:
                mask = self.structured.fill_draft(seq.matcher, s.draft)
            self.structured.apply_draft(logits, mask, skip or ())
        run = DraftRun(s.draft, rows_for_draft(self._row(seq), s.draft))
        [v], sampled = verify(self.sampler, logits, [run], self._spec_gen)
        counters = self.jump_forward if s.forced else self.spec_counters
        counters.observe(len(s.draft), v.num_accepted)
        for j in range(len(v.tokens)):
            if self._result.is_finished(seq):
                return
            self._append_token(seq, sampled, v.row + j, now)
        self._result.update(seq).num_accepted_drafts = v.num_accepted

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], touched: dict[str, Request],
                pending: PendingMask | None = None, restricted: Collection[int] = (),
                ) -> list[tuple[SamplerOutput, int] | None]:
        """One token per sequence: ``(sampler output, row)``, or None for a sequence whose
        request failed. The batch is sampled at once; if that raises (a request's parameters
        broke a logit processor), row by row, so that only the culprit's request ends."""
        rows = [self._row(s) for s in seqs]
        # Constrained rows (bitmasks filled by start_mask, one per entry of ``seqs``):
        # forbidden tokens to -inf before penalties, temperature, top-k/p, min-p and logprobs.
        # Unconstrained batches have nothing pending.
        for i, failure in self.structured.finish_mask(logits, pending, restricted).items():
            self._fail_request(seqs[i].request, ConstraintFailedError(failure_error(failure)),
                               touched)
        try:
            sampled = self.sampler(logits, rows)
            return [(sampled, i) for i in range(len(rows))]
        except _OUT_OF_MEMORY:
            raise
        except Exception:  # noqa: BLE001
            logger.exception("sampling %d rows failed; sampling them one by one", len(rows))
        picks: list[tuple[SamplerOutput, int] | None] = []
        for i, seq in enumerate(seqs):
            try:
                picks.append((self.sampler(logits[i:i + 1], rows[i:i + 1]), 0))
            except Exception as exc:  # noqa: BLE001
                self._fail_request(seq.request, exc, touched)
                picks.append(None)
        return picks

    def _append_token(self, seq: Sequence, sampled: SamplerOutput, row: int, now: float) -> None:
        """Take the sampled token: logprobs, text, stop checks, metrics; the token and any
        finish are recorded for ``update_from_output``. Per request."""
        token = sampled.token_ids[row]
        if seq.matcher is not None and not seq.matcher.accept(token):
            raise RuntimeError(f"token {token} is not allowed by the request's grammar (every "
                               f"allowed token was masked by another logit processor?)")
        self._result.update(seq).new_token_ids.append(token)
        self.counters["generation_tokens"] += 1
        record_sample_logprobs(seq, sampled, row, self.token_text)
        m = seq.request.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        finish = seq.text_state.append(token)
        if finish is not None:
            self._result.finish(seq, finish.reason, finish.stop_reason)
        elif seq.matcher is not None and seq.matcher.is_terminated():
            # The grammar ended (it took a stop token that the text state does not end on,
            # e.g. under ignore_eos): nothing more may follow.
            info = seq.text_state.finish("stop")
            self._result.finish(seq, info.reason, info.stop_reason)

    # ---- introspection -------------------------------------------------------------------

    def kv_snapshot(self) -> KVSnapshot:
        """A read-only picture of the KV cache (``engine.kv_cache.snapshot``); engine thread
        only (``AsyncEngine.call_on_engine_thread``), between steps."""
        return self.kv_snapshots.take(self.scheduler.running)

    def cache_tiers(self) -> list[str]:
        """The tiers the prefix cache lives in, top down: "device", then "host" (``swap_space``,
        or the staging area of a stored tier), "disk" and "remote" when on. Fixed at start."""
        return cache_tiers(self.kv, self.disk)

    def reset_prefix_cache(self, tiers: Collection[str] | None = None) -> dict[str, int | None]:
        """Drop every cached block no request holds, in ``tiers`` (None: all of
        :meth:`cache_tiers`); blocks per tier dropped. Engine thread only, between steps
        (``engine.kv_cache.reset``)."""
        return reset_prefix_cache(self.kv, self.disk, tiers)

    def stats(self) -> EngineStats:
        return engine_stats(self)
