"""Prometheus metrics, named ``kvserve:*`` after vLLM's ``vllm:*`` so dashboards translate.

Two sources feed one private registry (one per app, so tests can build many apps):

* engine counters and gauges (running/waiting requests, KV usage, prefix-cache tokens,
  preemptions, token totals, block counts) are read from ``AsyncEngine.stats()`` at scrape time
  by :class:`_EngineCollector`, which reads the fields of the typed
  :class:`~engine.stats.EngineStats` snapshot (a misspelt field fails the scrape, loudly);
* per-request histograms and the finished-request counter are observed on the engine thread by
  :class:`ServerMetrics`, an ``EngineObserver`` (prometheus_client metrics are thread-safe).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from engine.request_output import RequestOutput
from engine.stats import EngineStats
from engine.structured.stats import COMPILE_BUCKETS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Gauges: (EngineStats field, metric name, help).
_GAUGES = [
    (lambda s: s.num_requests_running, "kvserve:num_requests_running",
     "Number of requests in the running batch."),
    (lambda s: s.num_requests_waiting, "kvserve:num_requests_waiting",
     "Number of requests waiting to be scheduled."),
    (lambda s: s.host.num_swapped_seqs, "kvserve:num_requests_swapped",
     "Sequences whose KV blocks are swapped out to the host tier."),
    (lambda s: s.kv_cache_usage_perc, "kvserve:kv_cache_usage_perc",
     "KV-cache usage: fraction of blocks in use (0..1)."),
    (lambda s: s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0,
     "kvserve:prefix_cache_hit_rate",
     "Prompt tokens found in the prefix cache over those looked up, since start (0..1)."),
    (lambda s: s.num_blocks_total, "kvserve:kv_cache_num_blocks", "Blocks in the device KV pool."),
    (lambda s: s.num_blocks_free, "kvserve:kv_cache_free_blocks",
     "Blocks held by no request (cached ones included: they are evictable)."),
    (lambda s: s.num_blocks_used, "kvserve:kv_cache_used_blocks",
     "Blocks held by at least one request."),
    (lambda s: s.num_blocks_cached, "kvserve:kv_cache_cached_blocks",
     "Free blocks that still hold a reusable prefix."),
    (lambda s: s.kv_bytes_per_token, "kvserve:kv_cache_bytes_per_token",
     "KV-cache bytes per token (2 x layers x KV heads x row bytes; int8 rows carry a 2-byte "
     "scale)."),
    (lambda s: s.kv_cache_groups, "kvserve:kv_cache_groups",
     "KV cache groups: 1, or per attention type (full / sliding window) for a hybrid model, "
     "each with its own block tables over the shared pool."),
    (lambda s: s.kv_cache_group_bytes_per_token, "kvserve:kv_cache_group_bytes_per_token",
     "KV-cache bytes per token of one group (every group has as many layers)."),
    (lambda s: s.kv_cache_max_concurrency, "kvserve:kv_cache_max_concurrency",
     "Sequences of max_model_len tokens the device pool holds at once (per-group block "
     "accounting)."),
    (lambda s: s.disk.used_bytes, "kvserve:local_storage_usage",
     "Bytes of the disk tier's directory, every fingerprint's files (LMCache's name; 0 "
     "without --kv-disk-dir)."),
    (lambda s: s.disk.capacity_bytes, "kvserve:disk_kv_cache_capacity_bytes",
     "The disk tier's size (--kv-disk-size)."),
    (lambda s: s.disk.blocks, "kvserve:disk_kv_cache_num_blocks",
     "Blocks the disk tier's index holds."),
    (lambda s: int(s.disk.disk_full), "kvserve:disk_kv_cache_full",
     "1 while the disk tier is not writing because the disk is full (it retries)."),
    (lambda s: int(s.disk.available), "kvserve:disk_kv_cache_available",
     "1 while the disk tier writes; 0 when it is off, or down after an error (full, "
     "read-only, I/O error, directory gone) and retrying with backoff."),
    (lambda s: int(s.remote.available), "kvserve:remote_kv_cache_available",
     "1 while the remote (Redis/Valkey) tier is in use; 0 when it is off, or down after an "
     "error (refused, timed out) and retrying with backoff."),
    (lambda s: s.remote.known_blocks, "kvserve:remote_kv_cache_known_blocks",
     "Blocks this server knows the remote tier holds (wrote or found)."),
    (lambda s: s.host.host_blocks_total, "kvserve:host_kv_cache_num_blocks",
     "Blocks in the host (CPU memory) KV tier; 0 when --swap-space is 0."),
    (lambda s: s.host.host_blocks_used, "kvserve:host_kv_cache_used_blocks",
     "Host-tier blocks in use."),
    (lambda s: s.host.host_blocks_cached, "kvserve:host_kv_cache_cached_blocks",
     "Host-tier blocks holding a reusable prefix."),
    (lambda s: s.host.host_kv_usage_perc, "kvserve:host_kv_cache_usage_perc",
     "Host-tier usage: fraction of blocks in use (0..1)."),
]
# Counters: (metric name, help, label name or None, [(EngineStats field, label value)]);
# prometheus_client appends "_total" to the names.
_COUNTERS = [
    ("kvserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", None,
     [(lambda s: s.prefix_cache_queries, None)]),
    ("kvserve:prefix_cache_hits", "Prompt tokens found in the prefix cache.", None,
     [(lambda s: s.prefix_cache_hits, None)]),
    ("kvserve:prefix_cache_host_hits", "Prompt tokens found in the host tier's prefix cache.",
     None, [(lambda s: s.host.prefix_cache_host_hits, None)]),
    ("kvserve:kv_cache_evicted_blocks", "KV blocks given back because they fell wholly "
     "outside every layer's sliding window, or were evicted from the middle of a sequence by "
     "--kv-eviction (sinks + window).", None,
     [(lambda s: s.num_blocks_released_window + s.num_blocks_evicted_stream, None)]),
    ("kvserve:num_preemptions", "Cumulative number of preemptions.", None,
     [(lambda s: s.num_preemptions, None)]),
    ("kvserve:num_preemptions_by_mode", "Preemptions by how the KV was given up.", "mode",
     [(lambda s: s.num_preemptions_swap, "swap"),
      (lambda s: s.num_preemptions_recompute, "recompute")]),
    ("kvserve:prompt_tokens", "Prompt tokens of accepted requests.", None,
     [(lambda s: s.prompt_tokens, None)]),
    ("kvserve:generation_tokens", "Generated tokens.", None,
     [(lambda s: s.generation_tokens, None)]),
    ("kvserve:computed_tokens", "Tokens run through the model (prefill chunks and decodes).",
     None, [(lambda s: s.computed_tokens, None)]),
    ("kvserve:engine_steps", "Engine iterations that ran the model.", None,
     [(lambda s: s.num_steps, None)]),
    ("kvserve:kv_offload_blocks", "KV blocks copied between the device pool and the host tier.",
     "direction", [(lambda s: s.host.offload_blocks_d2h, "device_to_host"),
                   (lambda s: s.host.offload_blocks_h2d, "host_to_device")]),
    ("kvserve:kv_offload_bytes", "KV bytes copied between the device pool and the host tier.",
     "direction", [(lambda s: s.host.offload_bytes_d2h, "device_to_host"),
                   (lambda s: s.host.offload_bytes_h2d, "host_to_device")]),
    ("kvserve:host_kv_cache_evictions", "Blocks evicted from the host tier.", None,
     [(lambda s: s.host.host_evictions, None)]),
    # KV cache events (--kv-events-config); all zero when they are off.
    ("kvserve:kv_events_published", "KV cache events (BlockStored, BlockRemoved, "
     "AllBlocksCleared) sent on the --kv-events-config PUB socket.", None,
     [(lambda s: s.kv_events.published_events, None)]),
    ("kvserve:kv_events_dropped", "KV cache events dropped, never sent: the publisher's queue "
     "(max_queue_size batches) was full, the engine step did not wait.", None,
     [(lambda s: s.kv_events.dropped_events, None)]),
    ("kvserve:kv_offload_spills", "Cached device blocks written back to the host on eviction.",
     None, [(lambda s: s.host.offload_spills, None)]),
    # The disk tier (--kv-disk-dir); all zero when it is off.
    ("kvserve:prefix_cache_disk_hits", "Prompt tokens whose KV was read back from the disk "
     "tier (LMCache's lmcache:num_hit_tokens for its local disk).", None,
     [(lambda s: s.disk.hit_tokens, None)]),
    ("kvserve:disk_kv_cache_blocks", "Disk-tier block look-ups that hit (read, verified) or "
     "missed.", "result", [(lambda s: s.disk.hit_blocks, "hit"),
                           (lambda s: s.disk.miss_blocks, "miss")]),
    ("kvserve:disk_kv_cache_bytes", "Bytes read from and written to the disk tier.",
     "direction", [(lambda s: s.disk.read_bytes, "read"),
                   (lambda s: s.disk.write_bytes, "write")]),
    ("kvserve:disk_kv_cache_io_seconds", "Seconds spent reading and writing disk-tier blocks "
     "(off the engine thread); divide by the block counts for mean latencies.", "direction",
     [(lambda s: s.disk.read_seconds, "read"), (lambda s: s.disk.write_seconds, "write")]),
    ("kvserve:disk_kv_cache_written_blocks", "Blocks written to the disk tier.", None,
     [(lambda s: s.disk.written_blocks, None)]),
    ("kvserve:disk_kv_cache_dropped_writes", "Blocks not written to the disk tier: the writer "
     "queue was full or the tier was down.", None, [(lambda s: s.disk.dropped_writes, None)]),
    ("kvserve:disk_kv_cache_checksum_failures", "Disk-tier blocks that failed their checksum "
     "when read (served as misses, dropped).", None,
     [(lambda s: s.disk.checksum_failures, None)]),
    ("kvserve:disk_kv_cache_evicted_blocks", "Blocks evicted (LRU) from the disk tier.", None,
     [(lambda s: s.disk.evicted_blocks, None)]),
    ("kvserve:disk_kv_cache_evicted_foreign_segments", "Segments of other fingerprints (other "
     "models or settings, unused) evicted to keep the disk tier's directory under its size.",
     None, [(lambda s: s.disk.evicted_foreign_segments, None)]),
    ("kvserve:disk_kv_cache_write_errors", "Disk-tier write errors (failed writes, directory "
     "opens and retries); the tier serves on without writing and retries.", None,
     [(lambda s: s.disk.write_errors, None)]),
    # The remote tier (--kv-remote-url); all zero when it is off.
    ("kvserve:remote_kv_cache_blocks", "Remote-tier blocks read back and verified (hit) or "
     "asked for and not held (miss: never written, or evicted by the server).", "result",
     [(lambda s: s.remote.hit_blocks, "hit"), (lambda s: s.remote.miss_blocks, "miss")]),
    ("kvserve:remote_kv_cache_bytes", "Bytes read from and written to the remote tier.",
     "direction", [(lambda s: s.remote.read_bytes, "read"),
                   (lambda s: s.remote.write_bytes, "write")]),
    ("kvserve:remote_kv_cache_written_blocks", "Blocks written to the remote tier.", None,
     [(lambda s: s.remote.written_blocks, None)]),
    ("kvserve:remote_kv_cache_dropped_writes", "Blocks not written to the remote tier: the "
     "writer queue was full or the tier was down.", None,
     [(lambda s: s.remote.dropped_writes, None)]),
    ("kvserve:remote_kv_cache_bad_records", "Remote-tier values that failed their checksum or "
     "fingerprint (never used; deleted).", None, [(lambda s: s.remote.bad_records, None)]),
    ("kvserve:remote_kv_cache_errors", "Remote-tier commands that failed (refused, timed out, "
     "error answers) and failed pings; the tier serves on without the server and retries.",
     None, [(lambda s: s.remote.errors, None)]),
    ("kvserve:spec_decode_num_drafts", "Speculative drafts verified (one per sequence and step).",
     None, [(lambda s: s.spec_decode.num_drafts, None)]),
    ("kvserve:spec_decode_num_draft_tokens", "Speculative tokens proposed in verified drafts.",
     None, [(lambda s: s.spec_decode.num_draft_tokens, None)]),
    ("kvserve:spec_decode_num_accepted_tokens", "Speculative tokens accepted by verification.",
     None, [(lambda s: s.spec_decode.num_accepted_tokens, None)]),
    ("kvserve:structured_output_grammar_cache_hits",
     "Structured-output constraints answered by the grammar cache (compiled before).",
     None, [(lambda s: s.structured.cache_hits, None)]),
    ("kvserve:structured_output_compile_failures",
     "Structured-output constraints that did not compile (each a 400).",
     None, [(lambda s: s.structured.compile_failures, None)]),
    ("kvserve:structured_output_constrained_rows",
     "Sampled rows that carried a grammar (one per constrained sequence and step).",
     None, [(lambda s: s.structured.constrained_rows, None)]),
    ("kvserve:structured_output_constrained_steps",
     "Engine steps that sampled at least one constrained row.",
     None, [(lambda s: s.structured.constrained_steps, None)]),
    ("kvserve:structured_output_jump_forward_draft_tokens",
     "Tokens a grammar forced, proposed as jump-forward drafts and verified.",
     None, [(lambda s: s.structured.jump_forward_drafted, None)]),
    ("kvserve:structured_output_jump_forward_accepted_tokens",
     "Jump-forward draft tokens kept by verification (each a decode step saved).",
     None, [(lambda s: s.structured.jump_forward_accepted, None)]),
    ("kvserve:structured_output_restricted_logit_rows",
     "Constrained rows whose logits the head computed at the allowed tokens only.",
     None, [(lambda s: s.structured.restricted_rows, None)]),
    ("kvserve:structured_output_refused_at_once",
     "Constraints refused from memory (refused before; each a 400 without compiling again).",
     None, [(lambda s: s.structured.refused_at_once, None)]),
    ("kvserve:structured_output_compile_queue_full",
     "Constraints turned away because too many waited to be compiled (each a 503).",
     None, [(lambda s: s.structured.compile_queue_full, None)]),
    ("kvserve:structured_output_mask_failures",
     "Requests ended while running by their constraint's token mask (past its deadline, an "
     "error state or nothing allowed).", None, [(lambda s: s.structured.mask_failures, None)]),
    ("kvserve:structured_output_mask_timeouts",
     "Token-mask fills given up at the mask deadline (structured_outputs_config mask_timeout).",
     None, [(lambda s: s.structured.mask_timeouts, None)]),
    ("kvserve:structured_output_vet_worker_kills",
     "Grammar vetting processes killed at the compile deadline or found dead, and replaced.",
     None, [(lambda s: s.structured.vet_worker_kills, None)]),
]

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                  100000)


def _compile_histogram(model_name: str, stats: EngineStats) -> Metric:
    """The grammar compile-time histogram, from the engine's non-cumulative bucket counts."""
    st = stats.structured
    buckets, total = [], 0
    for bound, n in zip((*COMPILE_BUCKETS, float("inf")), st.compile_buckets):
        total += n
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), float(total)))
    h = HistogramMetricFamily("kvserve:structured_output_compile_seconds",
                              "Time to compile a structured-output constraint (cache misses).",
                              labels=["model_name"])
    h.add_metric([model_name], buckets, sum_value=st.compile_seconds_sum)
    return h


class _EngineCollector(Collector):
    def __init__(self, model_name: str, stats: Callable[[], EngineStats],
                 healthy: Callable[[], bool], kv_cache_dtype: str,
                 cache_config: dict[str, str] | None = None) -> None:
        self.model_name = model_name
        self.stats = stats
        self.healthy = healthy
        self.kv_cache_dtype = kv_cache_dtype
        self.cache_config = cache_config or {}

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        for read, name, doc in _GAUGES:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model_name], float(read(stats)))
            yield g
        for name, doc, label, sources in _COUNTERS:
            c = CounterMetricFamily(name, doc, labels=["model_name"] + ([label] if label else []))
            for read, value in sources:
                c.add_metric([self.model_name] + ([value] if label else []), float(read(stats)))
            yield c
        per_pos = CounterMetricFamily(
            "kvserve:spec_decode_num_accepted_tokens_per_pos",
            "Speculative tokens accepted, by position in the draft (0 = first).",
            labels=["model_name", "position"])
        for j, n in enumerate(stats.spec_decode.accepted_per_pos):
            per_pos.add_metric([self.model_name, str(j)], float(n))
        yield per_pos
        yield _compile_histogram(self.model_name, stats)
        up = GaugeMetricFamily("kvserve:engine_healthy",
                               "1 while the engine loop runs, 0 once it has died.",
                               labels=["model_name"])
        up.add_metric([self.model_name], 1.0 if self.healthy() else 0.0)
        yield up
        info = GaugeMetricFamily("kvserve:kv_cache_dtype_info",
                                 "The KV cache's storage (--kv-cache-dtype; auto = the model's "
                                 "dtype); always 1.",
                                 labels=["model_name", "kv_cache_dtype"])
        info.add_metric([self.model_name, self.kv_cache_dtype], 1.0)
        yield info
        yield self._cache_config_info(stats)
        if stats.lora.max_loras:
            yield self._lora_info(stats)

    def _lora_info(self, stats: EngineStats) -> Metric:
        """vLLM's ``vllm:lora_requests_info``: the adapters of the running and the waiting
        requests (comma-separated names) and the slots, as labels; the value is the time."""
        lora = stats.lora
        g = GaugeMetricFamily("kvserve:lora_requests_info",
                              "LoRA adapters of the running and waiting requests (vLLM's "
                              "vllm:lora_requests_info); the value is the scrape time.",
                              labels=["max_lora", "running_lora_adapters",
                                      "waiting_lora_adapters"])
        g.add_metric([str(lora.max_loras), ",".join(lora.running), ",".join(lora.waiting)],
                     time.time())
        return g

    def _cache_config_info(self, stats: EngineStats) -> Metric:
        """vLLM's ``vllm:cache_config_info``: llm-d's scheduler reads ``block_size`` (and
        ``num_gpu_blocks``) from the metric its ``--cache-info-metric`` names."""
        cfg = {"block_size": "", "cache_dtype": self.kv_cache_dtype,
               "enable_prefix_caching": "", **self.cache_config,
               "num_gpu_blocks": str(stats.num_blocks_total),
               "num_cpu_blocks": str(stats.host.host_blocks_total)}
        g = GaugeMetricFamily("kvserve:cache_config_info",
                              "The KV cache's configuration (vLLM's vllm:cache_config_info); "
                              "always 1.", labels=["model_name", *cfg])
        g.add_metric([self.model_name, *cfg.values()], 1.0)
        return g

    def describe(self) -> Iterator[Metric]:
        return iter(())  # dynamic: do not let the registry call collect() at registration


@dataclass
class _Track:
    arrival: float
    num_prompt_tokens: int
    last_token_time: float | None = None
    num_tokens: int = 0


class ServerMetrics:
    """The registry behind ``GET /metrics``; also the engine observer for request metrics."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats],
                 healthy: Callable[[], bool] = lambda: True,
                 kv_cache_dtype: str = "auto",
                 cache_config: dict[str, str] | None = None) -> None:
        """``cache_config``: labels of ``kvserve:cache_config_info`` known at start
        (``block_size``, ``enable_prefix_caching``); the pool sizes are read at scrape time."""
        self.model_name = model_name
        # No "*_created" series (as vLLM): they double the output and dashboards ignore them.
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=False)
        labels = ["model_name"]
        reg = self.registry
        self.request_success = Counter(
            "kvserve:request_success", "Finished requests, by finish reason.",
            labels + ["finished_reason"], registry=reg)
        self.ttft = Histogram(
            "kvserve:time_to_first_token_seconds", "Time from arrival to the first token.",
            labels, buckets=_LATENCY_BUCKETS, registry=reg)
        self.itl = Histogram(
            "kvserve:inter_token_latency_seconds", "Time between successive output tokens.",
            labels, buckets=_LATENCY_BUCKETS, registry=reg)
        self.e2e = Histogram(
            "kvserve:e2e_request_latency_seconds", "Time from arrival to the last token.",
            labels, buckets=_REQUEST_BUCKETS, registry=reg)
        self.queue_time = Histogram(
            "kvserve:request_queue_time_seconds", "Time from arrival to first scheduling.",
            labels, buckets=_REQUEST_BUCKETS, registry=reg)
        self.prompt_len = Histogram(
            "kvserve:request_prompt_tokens", "Prompt length of finished requests.",
            labels, buckets=_TOKEN_BUCKETS, registry=reg)
        self.gen_len = Histogram(
            "kvserve:request_generation_tokens", "Generated tokens of finished requests.",
            labels, buckets=_TOKEN_BUCKETS, registry=reg)
        self.rejected = Counter(
            "kvserve:request_rejected", "Requests refused before reaching the engine.",
            labels + ["reason"], registry=reg)
        reg.register(_EngineCollector(model_name, stats, healthy, kv_cache_dtype, cache_config))
        self._tracks: dict[str, _Track] = {}
        self._lock = threading.Lock()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def reject(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    # ---- EngineObserver (engine thread) ----------------------------------------------------

    def on_add(self, request_id: str, arrival_time: float, num_prompt_tokens: int) -> None:
        with self._lock:
            self._tracks[request_id] = _Track(arrival_time, num_prompt_tokens)

    def on_abort(self, request_id: str, now: float) -> None:
        with self._lock:
            track = self._tracks.pop(request_id, None)
        if track is not None:
            self._finish(track, "abort", now, None)

    def on_step(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            with self._lock:
                track = self._tracks.get(out.request_id)
                if track is not None and out.finished:
                    del self._tracks[out.request_id]
            if track is None:
                continue  # aborted (already counted) or not added through us
            num_tokens = sum(len(c.token_ids) for c in out.outputs)
            if num_tokens > track.num_tokens:
                if track.last_token_time is None:
                    first = out.metrics.first_token_time if out.metrics else None
                    self.ttft.labels(self.model_name).observe(
                        max(0.0, (first or now) - track.arrival))
                else:
                    self.itl.labels(self.model_name).observe(max(0.0, now - track.last_token_time))
                track.last_token_time = now
                track.num_tokens = num_tokens
            if out.finished:
                reason = next((c.finish_reason for c in out.outputs if c.finish_reason), "stop")
                self._finish(track, reason, now, out)

    def _finish(self, track: _Track, reason: str, now: float, out: RequestOutput | None) -> None:
        name = self.model_name
        self.request_success.labels(name, reason).inc()
        m = out.metrics if out is not None else None
        end = (m.finished_time if m and m.finished_time else None) or now
        self.e2e.labels(name).observe(max(0.0, end - track.arrival))
        if m is not None and m.first_scheduled_time is not None:
            self.queue_time.labels(name).observe(max(0.0, m.first_scheduled_time - track.arrival))
        self.prompt_len.labels(name).observe(track.num_prompt_tokens)
        self.gen_len.labels(name).observe(track.num_tokens)
