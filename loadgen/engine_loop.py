"""Drive an engine in-process as a closed-loop client: keep N requests in flight.

The engine is ``LLM.engine`` (its ``add_request`` / ``step`` / ``abort_request``): the bench
needs per-step timing, which ``LLM.generate`` does not expose.

Used by ``bench offline`` for the concurrency and shared-prefix sweeps, where per-request
latencies are wanted without HTTP in the way. Times are taken when ``step()`` returns, so TTFT
covers queueing plus prefill, exactly what a client of the engine would see.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from loadgen.stats import RequestRecord

_ids = itertools.count()


def drive_engine(core: Any, requests: Sequence[tuple[list[int], int]],
                 concurrency: int | None = None, progress: Any = None,
                 max_idle_steps: int = 10_000) -> tuple[list[RequestRecord], float]:
    """Run ``(prompt_token_ids, max_tokens)`` requests, greedy with ``ignore_eos``, keeping at
    most ``concurrency`` in flight (None: all at once). Returns records in request order and
    the wall time. Bounded: if the engine makes no progress for ``max_idle_steps`` steps, the
    rest is aborted and counted as failed.
    """
    from engine import SamplingParams

    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1; got {concurrency}")
    records: list[RequestRecord | None] = [None] * len(requests)
    inflight: dict[str, tuple[int, RequestRecord, list[float]]] = {}
    next_req = 0
    idle = 0
    t0 = time.perf_counter()
    while next_req < len(requests) or inflight:
        while next_req < len(requests) and (concurrency is None or len(inflight) < concurrency):
            ids, max_tokens = requests[next_req]
            rid = f"bench-{next(_ids)}"
            now = time.perf_counter()
            rec = RequestRecord(ok=False, start=now, end=now, max_tokens=max_tokens,
                                expected_prompt_tokens=len(ids), prompt_tokens=len(ids))
            try:
                core.add_request(rid, list(ids), SamplingParams(
                    max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            except ValueError as e:
                rec.error = str(e)
                records[next_req] = rec
            else:
                inflight[rid] = (next_req, rec, [now])
            next_req += 1
        if not inflight:
            continue
        outputs = core.step()
        now = time.perf_counter()
        progressed = False
        for out in outputs:
            if out.request_id not in inflight:
                continue
            index, rec, last = inflight[out.request_id]
            n = len(out.outputs[0].token_ids) if out.outputs else 0
            if n > rec.stream_tokens:
                progressed = True
                if rec.ttft is None:
                    rec.ttft = now - rec.start
                else:
                    rec.itl.append(now - last[0])
                last[0] = now
                rec.stream_tokens = n
            if out.finished:
                progressed = True
                rec.end = now
                rec.output_tokens = n
                rec.cached_tokens = out.num_cached_tokens
                rec.finish_reason = out.outputs[0].finish_reason if out.outputs else None
                rec.ok = out.error is None and rec.finish_reason not in (None, "abort")
                rec.error = out.error or (None if rec.ok else f"finished: {rec.finish_reason}")
                records[index] = rec
                del inflight[out.request_id]
                if progress is not None:
                    progress.update(1)
        idle = 0 if progressed else idle + 1
        if idle > max_idle_steps:
            core.abort_request(list(inflight))
            for index, rec, _ in inflight.values():
                rec.end, rec.error = time.perf_counter(), "no progress: aborted by the bench"
                records[index] = rec
            inflight.clear()
    duration = time.perf_counter() - t0
    return [r for r in records if r is not None], duration
