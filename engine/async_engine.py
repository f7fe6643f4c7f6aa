"""AsyncEngine: the asyncio face of :class:`EngineCore`, for the HTTP server.

The core is not thread-safe, so exactly one thread (the *engine thread*, started here) calls
``add_request`` / ``abort_request`` / ``step``; it sleeps on a condition variable when idle. The
event loop never runs model code: it hands work to the engine thread through a locked inbox and
receives outputs through one slot per request, filled with ``loop.call_soon_threadsafe``.
:meth:`AsyncEngine.submit` validates synchronously and raises before anything is queued (its
docstring lists the errors) and returns a :class:`RequestStream`, which yields cumulative
:class:`RequestOutput` objects from ONE slot holding the newest (a stalled reader costs O(1)
memory and loses nothing); the finished output is always yielded last, and an error supersedes a
pending unfinished output. Aborting a stream aborts the engine request. A request the core ended
on an internal error finishes with ``finish_reason == "abort"`` and ``RequestOutput.error`` set.
If ``step`` raises the engine is dead: every pending stream raises :class:`EngineDeadError`,
``is_healthy`` turns false and later submissions are refused. ``stats``, ``config``,
``tokenizer``, ``model_name``, ``max_model_len`` and ``token_id_bound`` are all the server reads."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from engine.config.engine import EngineConfig
from engine.params.prompt_image import PromptImage
from engine.params.sampling import SamplingParams
from engine.request_output import RequestOutput
from engine.stats import EngineStats

IDLE_GRACE_S = 1.0  # idle this long after a step before the runner's idle work takes a turn

logger = logging.getLogger("kvserve.async_engine")


class EngineDeadError(RuntimeError):
    """The engine loop has stopped on an unexpected error; nothing more can be served."""


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the client should retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineDrainingError(QueueFullError):
    """The server is shutting down and accepts no new work."""


class RequestAbortedError(RuntimeError):
    """Raised by a stream that was aborted (client gone, shutdown timeout) before it finished."""


class EngineObserver(Protocol):
    """Receives engine events on the engine thread (metrics). Must be cheap and not raise."""

    def on_add(self, request_id: str, arrival_time: float, num_prompt_tokens: int) -> None: ...

    def on_step(self, outputs: list[RequestOutput], now: float) -> None: ...

    def on_abort(self, request_id: str, now: float) -> None: ...


@dataclass
class _Pending:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    priority: int
    arrival_time: float
    images: tuple[PromptImage, ...] = ()


class RequestStream:
    """Async iterator over one request's cumulative outputs (see module docstring).

    State (event loop only): ``_latest`` is the newest undelivered output, ``_error`` a
    pending exception; ``_wake`` is set whenever either changes or the stream is aborted.
    """

    def __init__(self, engine: AsyncEngine, request_id: str,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._engine = engine
        self._loop = loop
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._wake = asyncio.Event()
        self._done = False  # the finished output (or an error) was consumed
        self._aborted = False

    @property
    def finished(self) -> bool:
        return self._done or self._aborted

    def _put(self, item: Any) -> None:  # runs on the event loop
        if isinstance(item, BaseException):
            if self._error is None:
                self._error = item
        elif self._latest is None or not self._latest.finished:
            self._latest = item  # cumulative: the newest output holds everything before it
        self._wake.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self._aborted:
                raise RequestAbortedError(f"request {self.request_id} was aborted")
            if self._done:
                raise StopAsyncIteration
            out = self._latest
            if out is not None and out.finished:
                self._latest, self._done = None, True
                return out
            if self._error is not None:
                err, self._error, self._done = self._error, None, True
                raise err
            if out is not None:
                self._latest = None
                return out
            self._wake.clear()
            await self._wake.wait()

    def abort(self) -> None:
        """Abort the engine request (idempotent; a no-op once the request finished)."""
        if self.finished:
            return
        self._aborted = True
        self._engine._abort(self.request_id)
        self._wake.set()  # wake a consumer blocked in __anext__

    def __del__(self) -> None:
        # Safety net for a stream dropped without being drained: free its KV blocks.
        if not self._done and not self._aborted:
            try:
                self._engine._abort(self.request_id)
            except Exception:  # pragma: no cover - interpreter shutdown
                pass


class AsyncEngine:
    """Owns an :class:`EngineCore` and the thread that drives it; the whole interface the
    server uses (``config``, ``tokenizer``, ``model_name``, ``max_model_len``,
    ``token_id_bound``, ``stats()``, ``check_request``, ``submit``/``generate``, draining;
    for routers ``model_path``, ``tokenizer_path``, ``hf_config``, ``cache_tiers()`` and
    ``reset_prefix_cache()``)."""

    def __init__(self, config: EngineConfig | None = None, *, core: Any = None,
                 observers: list[EngineObserver] | None = None, start: bool = True) -> None:
        if core is None:
            from engine.core import EngineCore  # heavy: torch and the model stack

            core = EngineCore(config or EngineConfig())
        self.core = core
        self.config: EngineConfig = core.config
        self.tokenizer = core.tokenizer
        self.model_name: str = core.model_name
        # the model's sampling defaults for fields a request leaves out (GenerationDefaults)
        self.generation_defaults = core.generation_defaults
        self.pooling = core.pooling  # engine.pooling.serving.ServedPooling
        self.max_model_len: int = core.max_model_len
        # Ids in [0, bound) are known to the model and the tokenizer (an embedding may be
        # padded past the tokenizer, as Qwen's is).
        self.token_id_bound: int = core.token_id_bound
        # Where the weights and the tokenizer were found, and the model's HF config (what
        # GET /get_server_info and /get_model_info tell routers; they load the tokenizer there).
        files = getattr(core, "files", None)
        self.model_path: str = str(files.path) if files is not None else \
            (core.config.model or self.model_name)
        self.tokenizer_path: str = getattr(core, "tokenizer_path", None) or self.model_path
        self.hf_config: Any = getattr(core, "hf_config", None)
        self.observers: list[EngineObserver] = list(observers or [])
        self._cond = threading.Condition()
        # Guarded by _cond (touched by both threads):
        self._inbox: list[_Pending] = []
        self._aborts: list[str] = []
        self._streams: dict[str, RequestStream] = {}
        self._inbox_seqs = 0  # sum of n over the inbox
        # Calls to run on the engine thread between steps (call_on_engine_thread).
        self._tasks: list[tuple[Any, concurrent.futures.Future]] = []
        # What the core holds that is not yet scheduled (upper bounds between snapshots):
        self._waiting = 0  # requests
        self._waiting_seqs = 0  # sequences: what max_waiting_requests bounds
        self._stats: EngineStats = core.stats()
        self._stop = False
        # Set once, read anywhere:
        self._dead: BaseException | None = None
        self._draining = False
        # Engine thread only:
        self._active: set[str] = set()
        # engine.profiling.StepProfiler once /start_profile ran (engine thread only).
        self.profiler: Any = None
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._done = threading.Event()  # set when the engine loop has returned
        if start:
            self.start()

    # ---- event-loop side ----------------------------------------------------------------

    def compile_structured(self, spec: Any, timeout: float | None = None,
                           client: str = "") -> None:
        """Compile a request's constraint (blocking: call it on a worker thread) into the
        engine's grammar cache; raises ``ValueError`` naming the problem, or
        ``CompileQueueFullError`` (engine.structured.cache) when too many constraints wait.
        ``client`` names whose queue it waits in. Thread-safe."""
        self.core.structured.compile(spec, timeout, client)

    def start(self) -> None:
        """Drive the engine on its own thread (tests, embedding in another program)."""
        if not self._thread.is_alive() and not self._done.is_set():
            self._thread.start()

    def claim_calling_thread(self) -> None:
        """Make the calling thread the engine's (before :meth:`run`; instead of
        :meth:`start`). ``kvserve serve`` runs the engine on the process's main thread and
        the HTTP server on another: libgomp serves OpenMP parallel regions started from a
        thread it did not start (a Python ``threading`` thread) markedly slower, enough to
        more than double a CPU decode step (chosen by measurement: see
        docs/decisions.md#engine-on-the-main-thread)."""
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            raise RuntimeError("the engine already runs on its own thread")
        self._thread = threading.current_thread()

    def run(self) -> None:
        """Drive the engine on the thread that called :meth:`claim_calling_thread`, until
        :meth:`stop` (from any other thread) or until the loop dies."""
        if self._thread is not threading.current_thread():
            raise RuntimeError("call claim_calling_thread() first, on this thread")
        self._run()

    @property
    def is_healthy(self) -> bool:
        """False once the engine loop died (or was stopped): nothing more can be served."""
        return self._dead is None and not self._done.is_set() and self._thread.is_alive()

    @property
    def dead_reason(self) -> str | None:
        """Why the engine loop died (``"<ExceptionType>: <message>"``), or None while it has
        not. Fatal: a failed forward pass or corrupted engine state; the process should exit
        (non-zero) so that a supervisor restarts it."""
        exc = self._dead
        return None if exc is None else f"{type(exc).__name__}: {exc}"

    @property
    def num_in_flight(self) -> int:
        with self._cond:
            return len(self._streams)

    def stats(self) -> EngineStats:
        """The engine counters as of the last step, waiting count including the inbox, the
        structured-output compile counters as of now (refusals never reach a step)."""
        with self._cond:
            # _waiting also covers requests taken from the inbox since the last snapshot.
            snap = self._stats.replace(num_requests_waiting=self._waiting + len(self._inbox))
        fresh = getattr(getattr(self.core, "structured", None), "with_compile_stats", None)
        return snap if fresh is None else snap.replace(structured=fresh(snap.structured))

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams, *,
                      priority: int = 0, images: tuple[PromptImage, ...] = ()) -> None:
        """Raise ValueError (a 400) if this request can never be served: the core's checks
        (``engine.scheduling.admission.check_request``: priority under fcfs, ``params.n`` above the caps,
        prompt, ids, lengths, pool). Pure; callable from any thread."""
        self.core.check_request(prompt_token_ids, params, priority=priority, images=images)

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    def submit(self, prompt_token_ids: list[int], params: SamplingParams,
               request_id: str | None = None, *, prompt: str | None = None,
               priority: int = 0, validated: bool = False,
               images: tuple[PromptImage, ...] = ()) -> RequestStream:
        """Queue a request for the engine thread; raises before anything is queued.
        ``validated``: the caller has just run :meth:`check_request` on these same arguments
        (the server does, for every prompt of a request before submitting any): not checked
        again. Either way the engine thread does not check it a second time.

        Raises ``ValueError`` (user-facing, a 400) for a request that can never be served,
        including ``n`` above ``config.seqs_per_request_cap`` or above ``max_waiting_requests``,
        and a non-zero ``priority`` under ``scheduling_policy="fcfs"``; :class:`QueueFullError`
        (503, retry) when the waiting queue, counted in SEQUENCES (``n`` per request), is
        momentarily full; :class:`EngineDeadError` once the loop has died;
        :class:`EngineDrainingError` during shutdown."""
        if not self.is_healthy:
            raise EngineDeadError("the engine is not running; see the server log")
        if self._draining:
            raise EngineDrainingError("the server is shutting down and accepts no new requests")
        prompt_token_ids = list(prompt_token_ids)
        if not validated:
            self.check_request(prompt_token_ids, params, priority=priority, images=images)
        request_id = request_id or self.new_request_id()
        loop = asyncio.get_running_loop()
        with self._cond:
            bound = self.config.max_waiting_requests
            waiting = self._waiting_seqs + self._inbox_seqs
            if waiting + params.n > bound:
                raise QueueFullError(f"the server is overloaded: {waiting} sequences are "
                                     f"already waiting and the queue holds {bound}; retry later")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            stream = RequestStream(self, request_id, loop)
            self._streams[request_id] = stream
            self._inbox.append(_Pending(request_id, prompt_token_ids, params, prompt, priority,
                                        time.time(), tuple(images)))
            self._inbox_seqs += params.n
            self._cond.notify()
        return stream

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str | None = None, *, prompt: str | None = None,
                       priority: int = 0, images: tuple[PromptImage, ...] = ()
                       ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs; closing or cancelling the consumer aborts the request."""
        stream = self.submit(prompt_token_ids, params, request_id, prompt=prompt,
                             priority=priority, images=images)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def begin_drain(self) -> None:
        """Refuse new requests from now on (the first step of a graceful shutdown)."""
        self._draining = True

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop accepting work, let requests in flight finish for up to ``timeout`` seconds,
        abort the rest and stop the engine thread."""
        self.begin_drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.num_in_flight and loop.time() < deadline and self.is_healthy:
            await asyncio.sleep(0.05)
        self.abort_all()
        await asyncio.to_thread(self.stop)

    def abort_all(self) -> int:
        """Abort every request in flight (event loop only; the end of a drain's budget): each
        consumer's next read raises ``RequestAbortedError``. Returns how many were aborted."""
        with self._cond:
            streams = list(self._streams.values())
        for stream in streams:
            stream.abort()
        return len(streams)

    def stop(self, join_timeout: float = 30.0) -> None:
        """Abort everything in the core and stop the engine thread (blocking)."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._done.wait(join_timeout)

    def cache_tiers(self) -> list[str]:
        """The KV tiers the prefix cache lives in, top down ("device", "host", "disk",
        "remote": ``EngineCore.cache_tiers``); fixed at start."""
        return list(self.core.cache_tiers())

    async def reset_prefix_cache(self, tiers: list[str] | None = None,
                                 timeout: float = 30.0) -> dict[str, int | None]:
        """Drop every cached block no request holds, in ``tiers`` (None: all), on the engine
        thread between two steps (``EngineCore.reset_prefix_cache``); returns the blocks dropped
        per tier. ``ValueError`` for a tier this engine lacks, ``EngineDeadError`` once the loop
        stopped, ``TimeoutError`` when no step ended within ``timeout`` seconds."""
        fut = self.call_on_engine_thread(lambda: self.core.reset_prefix_cache(tiers))
        return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)

    def lora_adapters(self) -> list[tuple[str, str, int]]:
        """(name, path, lora_id) of every loaded LoRA adapter, in load order (any thread)."""
        adapters = getattr(self.core, "adapters", None)
        return [] if adapters is None else list(adapters.listing)

    async def load_lora_adapter(self, name: str, path: str, timeout: float = 30.0) -> int:
        """Read the adapter at ``path`` off the loop and register it as ``name``; returns its
        lora_id. ``ValueError`` (a 400) when LoRA is off, the name is taken or the files
        cannot be served by this model."""
        adapters = getattr(self.core, "adapters", None)
        if adapters is None:
            raise ValueError("LoRA adapters are off: start the server with --enable-lora")
        if name in adapters.names:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
        adapter = await asyncio.to_thread(adapters.read, name, path)
        fut = self.call_on_engine_thread(lambda: adapters.add(adapter))
        return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)

    async def unload_lora_adapter(self, name: str, timeout: float = 30.0) -> None:
        """Forget adapter ``name``: new requests cannot select it, running ones finish on it.
        ``KeyError`` (a 404) when no adapter of that name is loaded."""
        adapters = getattr(self.core, "adapters", None)
        if adapters is None or name not in adapters.names:
            raise KeyError(name)
        fut = self.call_on_engine_thread(lambda: adapters.remove(name))
        await asyncio.wait_for(asyncio.wrap_future(fut), timeout)

    # ---- called from any thread ------------------------------------------------------------

    def call_on_engine_thread(self, fn: Any) -> concurrent.futures.Future:
        """Run ``fn()`` on the engine thread between two steps (waking it when idle) and
        return a Future of its result: how the server reads engine state that is not
        thread-safe (the KV snapshot) and drives the profiler. ``fn`` must be quick and must
        not block. Fails the Future with EngineDeadError once the loop has stopped."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._dead is not None or self._done.is_set():
                fut.set_exception(EngineDeadError("the engine is not running"))
                return fut
            self._tasks.append((fn, fut))
            self._cond.notify()
        return fut

    def _run_tasks(self) -> None:
        with self._cond:
            tasks, self._tasks = self._tasks, []
        for fn, fut in tasks:
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - the caller gets it, the loop goes on
                fut.set_exception(exc)

    def _abort(self, request_id: str) -> None:
        with self._cond:
            self._streams.pop(request_id, None)
            self._aborts.append(request_id)
            self._cond.notify()

    # ---- engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._close_core()  # tensor-parallel workers stop (or are killed) here
            self._done.set()
            self._fail_tasks()  # any call queued after the loop ended

    def _loop(self) -> None:
        has_work = False
        try:
            bind = getattr(self.core, "bind_thread", None)
            if bind is not None:  # CUDA: this thread launches on the engine's device
                bind()
            # Tensor parallel: while idle, ask the workers every `interval` seconds.
            interval = getattr(self.core, "health_check_interval", None)
            # Idle work (the runner's background probe) starts IDLE_GRACE_S after a step.
            runner = getattr(self.core, "runner", None)
            idle_work, busy_at = hasattr(runner, "idle_work"), time.monotonic()
            while True:
                with self._cond:
                    if not (self._inbox or self._aborts or self._stop or has_work
                            or self._tasks):
                        self._cond.wait(interval if not idle_work else
                                        max(busy_at + IDLE_GRACE_S - time.monotonic(), 0))
                    idle = not (self._inbox or self._aborts or self._stop or has_work)
                if idle_work and (self._tasks or not idle):
                    runner.suspend_idle_work()  # the model as it serves
                if self._tasks:
                    self._run_tasks()
                if idle:
                    if interval is not None:
                        self.core.check_health()  # outside the lock: may wait on a collective
                    if idle_work and time.monotonic() >= busy_at + IDLE_GRACE_S:
                        idle_work = runner.idle_work()
                    continue
                with self._cond:
                    if self._stop:
                        break
                    new, self._inbox = self._inbox, []
                    aborts, self._aborts = self._aborts, []
                    self._waiting += len(new)
                    self._waiting_seqs += self._inbox_seqs
                    self._inbox_seqs = 0
                self._process_aborts(aborts)
                self._process_adds(new)
                if self.core.has_unfinished_requests():
                    if self.profiler is not None and self.profiler.active:
                        with self.profiler.step_range():
                            outputs = self.core.step()
                    else:
                        outputs = self.core.step()
                    self._deliver(outputs)
                has_work, busy_at = self.core.has_unfinished_requests(), time.monotonic()
                stats = self.core.stats()
                with self._cond:
                    self._stats = stats
                    self._waiting = stats.num_requests_waiting
                    self._waiting_seqs = stats.num_seqs_waiting
            if self._active:
                self._process_aborts(list(self._active))
                self.core.step()  # lets the core release the aborted requests' blocks
            with self._cond:
                streams = list(self._streams.values())
                self._streams.clear()
                self._inbox.clear()
                self._inbox_seqs = 0
            for stream in streams:
                self._send(stream, RequestAbortedError("the engine was stopped"))
            self._fail_tasks()
        except BaseException as exc:  # noqa: BLE001 - the loop must report, whatever happened
            self._die(exc)

    def _close_core(self) -> None:
        close = getattr(self.core, "close", None)
        if close is None:
            return
        try:
            close()
        except Exception:  # noqa: BLE001
            logger.exception("closing the engine core failed")

    def _process_aborts(self, aborts: list[str]) -> None:
        live = [rid for rid in aborts if rid in self._active]
        if not live:
            return
        self.core.abort_request(live)
        now = time.time()
        for rid in live:
            self._active.discard(rid)
            self._notify("on_abort", rid, now)

    def _process_adds(self, new: list[_Pending]) -> None:
        for p in new:
            with self._cond:
                stream = self._streams.get(p.request_id)
            if stream is None:  # aborted before the engine saw it
                continue
            try:
                self.core.add_request(p.request_id, p.prompt_token_ids, p.params,
                                      prompt=p.prompt, arrival_time=p.arrival_time,
                                      priority=p.priority, validated=True,  # by submit
                                      images=p.images)
            except Exception as exc:  # a bad request must not stop the engine
                if not isinstance(exc, ValueError):
                    logger.exception("add_request failed for %s", p.request_id)
                with self._cond:
                    self._streams.pop(p.request_id, None)
                self._send(stream, exc)
                continue
            self._active.add(p.request_id)
            self._notify("on_add", p.request_id, p.arrival_time, len(p.prompt_token_ids))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            rid = out.request_id
            with self._cond:
                stream = self._streams.get(rid)
                if out.finished:
                    self._streams.pop(rid, None)
            if out.finished:
                self._active.discard(rid)
            if stream is not None:
                self._send(stream, out)
        if outputs:
            self._notify("on_step", outputs, time.time())

    def _send(self, stream: RequestStream, item: Any) -> None:
        try:
            stream._loop.call_soon_threadsafe(stream._put, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _notify(self, method: str, *args: Any) -> None:
        for obs in self.observers:
            try:
                getattr(obs, method)(*args)
            except Exception:  # metrics must never take the engine down
                logger.exception("engine observer %s.%s failed", type(obs).__name__, method)

    def _die(self, exc: BaseException) -> None:
        logger.error("engine loop died: %s: %s", type(exc).__name__, exc, exc_info=exc)
        with self._cond:
            self._dead = exc
            streams = list(self._streams.values())
            self._streams.clear()
            self._inbox.clear()
            self._inbox_seqs = 0
        for stream in streams:
            self._send(stream, EngineDeadError("the engine stopped on an internal error; see "
                                               "the server log"))
        self._fail_tasks()

    def _fail_tasks(self) -> None:
        with self._cond:
            tasks, self._tasks = self._tasks, []
        for _, fut in tasks:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineDeadError("the engine is not running"))
