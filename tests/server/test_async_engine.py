"""AsyncEngine against a deterministic fake core: delivery, abort, bounds, death, drain."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineDrainingError,
    QueueFullError,
    RequestAbortedError,
)
from engine.params.sampling import SamplingParams
from tests.server.fakes import FakeCore


def _wait_until(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.005)


async def _await_until(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.005)


@pytest.fixture
def engine():
    core = FakeCore()
    eng = AsyncEngine(core=core)
    yield eng
    core.resume()
    eng.stop()


def test_generate_yields_cumulative_outputs_until_finished(engine):
    async def run():
        outs = [o async for o in engine.generate([65, 66], SamplingParams(max_tokens=5), "r1")]
        return outs

    outs = asyncio.run(run())
    assert outs[-1].finished and outs[-1].outputs[0].text == "abcde"
    assert outs[-1].outputs[0].finish_reason == "length"
    texts = [o.outputs[0].text for o in outs]
    assert all("abcde".startswith(t) for t in texts)  # cumulative prefixes
    assert engine.core.requests == {}


def test_validation_error_is_raised_before_first_item(engine):
    async def run():
        with pytest.raises(ValueError, match="maximum context length is 256"):
            async for _ in engine.generate([65] * 250, SamplingParams(max_tokens=10), "r"):
                pass
        with pytest.raises(ValueError, match="empty"):
            engine.submit([], SamplingParams())

    asyncio.run(run())


def test_breaking_out_of_the_stream_aborts_the_request(engine):
    core = engine.core

    async def run():
        core.allow(2)
        agen = engine.generate([65], SamplingParams(max_tokens=100), "r-abort")
        first = await agen.__anext__()
        assert not first.finished
        await agen.aclose()  # what a disconnected client's handler does
        await _await_until(lambda: bool(engine._aborts))
        core.resume()
        await _await_until(lambda: "r-abort" in core.aborted)

    asyncio.run(run())
    assert core.requests == {} and core.blocks_used == 0
    assert core.generation_tokens < 100


def test_cancelling_the_consumer_task_aborts_the_request(engine):
    core = engine.core

    async def consume():
        async for _ in engine.generate([65], SamplingParams(max_tokens=100), "r-cancel"):
            pass

    async def run():
        core.pause()
        task = asyncio.create_task(consume())
        await _await_until(lambda: bool(core.requests))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        core.resume()
        await _await_until(lambda: "r-cancel" in core.aborted)

    asyncio.run(run())
    assert core.blocks_used == 0


def test_queue_bound_raises_queue_full():
    core = FakeCore(max_waiting_requests=2)
    engine = AsyncEngine(core=core)
    try:
        async def run():
            core.pause()
            streams = [engine.submit([65], SamplingParams(max_tokens=3), f"q{i}")
                       for i in range(2)]
            with pytest.raises(QueueFullError, match="2 sequences are already waiting") as info:
                engine.submit([65], SamplingParams(max_tokens=3), "q-over")
            assert info.value.retry_after >= 1
            core.resume()
            for s in streams:
                outs = [o async for o in s]
                assert outs[-1].outputs[0].text == "abc"

        asyncio.run(run())
    finally:
        core.resume()
        engine.stop()


def test_engine_death_fails_pending_requests_and_refuses_new_ones(engine):
    core = engine.core

    async def run():
        core.fail_next_step = RuntimeError("kernel exploded")
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate([65], SamplingParams(max_tokens=3), "dies"):
                pass
        assert not engine.is_healthy
        with pytest.raises(EngineDeadError):
            engine.submit([65], SamplingParams(max_tokens=3), "after")

    asyncio.run(run())


def test_idle_engine_does_not_spin(engine):
    core = engine.core

    async def run():
        outs = [o async for o in engine.generate([65], SamplingParams(max_tokens=2), "x")]
        assert outs[-1].finished

    asyncio.run(run())
    _wait_until(lambda: not core.requests)
    time.sleep(0.05)  # let the loop reach its wait
    checks = core.idle_checks
    time.sleep(0.3)
    assert core.idle_checks == checks  # asleep on the condition variable, not polling


def test_shutdown_drains_in_flight_and_refuses_new_work():
    core = FakeCore(step_delay=0.002)
    engine = AsyncEngine(core=core)

    async def run():
        stream = engine.submit([65], SamplingParams(max_tokens=20), "drain")
        shutdown = asyncio.create_task(engine.shutdown(timeout=30))
        await asyncio.sleep(0)
        with pytest.raises(EngineDrainingError):
            engine.submit([65], SamplingParams(max_tokens=2), "late")
        outs = [o async for o in stream]
        await shutdown
        return outs

    outs = asyncio.run(run())
    assert outs[-1].outputs[0].finish_reason == "length"
    assert len(outs[-1].outputs[0].token_ids) == 20
    assert not engine._thread.is_alive()


def test_shutdown_timeout_aborts_what_is_left():
    core = FakeCore()
    engine = AsyncEngine(core=core)

    async def run():
        core.allow(1)
        stream = engine.submit([65], SamplingParams(max_tokens=50), "slow")
        await _await_until(lambda: core.steps == 1)
        task = asyncio.create_task(engine.shutdown(timeout=0.05))
        with pytest.raises(RequestAbortedError):
            async for _ in stream:
                pass
        core.resume()
        await task

    asyncio.run(run())
    assert "slow" in core.aborted and core.blocks_used == 0
    assert not engine._thread.is_alive()


def test_queue_bound_counts_sequences_not_requests():
    core = FakeCore(max_waiting_requests=4, max_num_seqs=4)
    engine = AsyncEngine(core=core)
    try:
        async def run():
            core.pause()
            first = engine.submit([65], SamplingParams(n=3, max_tokens=2), "three")
            with pytest.raises(QueueFullError, match="3 sequences are already waiting"):
                engine.submit([65], SamplingParams(n=2, max_tokens=2), "two")
            last = engine.submit([65], SamplingParams(max_tokens=2), "one")
            with pytest.raises(QueueFullError):
                engine.submit([65], SamplingParams(max_tokens=2), "over")
            core.resume()
            for s in (first, last):
                outs = [o async for o in s]
                assert outs[-1].finished and outs[-1].outputs[-1].text == "ab"

        asyncio.run(run())
    finally:
        core.resume()
        engine.stop()


def test_requests_that_can_never_fit_are_value_errors_not_queue_full():
    core = FakeCore(max_waiting_requests=3, max_num_seqs=8)
    engine = AsyncEngine(core=core)
    try:
        assert engine.config is core.config and engine.config.seqs_per_request_cap == 8

        async def run():
            with pytest.raises(ValueError, match="asks for 4 sequences.*max_waiting_requests"):
                engine.submit([65], SamplingParams(n=4, max_tokens=2), "a")
            with pytest.raises(ValueError, match="asks for 4 sequences"):
                engine.check_request([65], SamplingParams(n=4, max_tokens=2))

        asyncio.run(run())
        capped = AsyncEngine(core=FakeCore(max_num_seqs=8, max_seqs_per_request=2))
        try:
            with pytest.raises(ValueError, match="at most 2 are allowed per request"):
                capped.check_request([65], SamplingParams(n=3, max_tokens=2))
        finally:
            capped.stop()
    finally:
        engine.stop()


def test_priority_is_refused_unless_the_policy_is_priority():
    fcfs = AsyncEngine(core=FakeCore())
    prio = AsyncEngine(core=FakeCore(scheduling_policy="priority"))
    try:
        async def run():
            with pytest.raises(ValueError, match="start the server with --scheduling-policy"):
                fcfs.submit([65], SamplingParams(max_tokens=2), "p", priority=2)
            with pytest.raises(ValueError, match="--scheduling-policy priority"):
                fcfs.check_request([65], SamplingParams(max_tokens=2), priority=-1)
            outs = [o async for o in prio.generate([65], SamplingParams(max_tokens=2), "q",
                                                   priority=2)]
            assert outs[-1].finished

        asyncio.run(run())
    finally:
        fcfs.stop()
        prio.stop()


def test_a_stalled_reader_holds_one_output_not_a_backlog(engine):
    """Outputs are cumulative: the stream keeps only the newest; the final is never lost."""
    import gc

    from engine.request_output import RequestOutput

    async def run():
        stream = engine.submit([65], SamplingParams(max_tokens=60), "stalled")
        # Finished and every output handed to the loop; nobody read.
        await _await_until(lambda: engine.core.generation_tokens == 60
                           and not engine.num_in_flight)
        await asyncio.sleep(0.05)  # let every delivery callback run
        gc.collect()
        held = [o for o in gc.get_objects()
                if isinstance(o, RequestOutput) and o.request_id == "stalled"]
        # The slot, plus the engine thread's last step (its locals): not one per step (60).
        assert len(held) <= 3
        outs = [o async for o in stream]
        assert len(outs) == 1 and outs[0].finished and len(outs[0].outputs[0].token_ids) == 60

    asyncio.run(run())


def test_an_error_supersedes_a_pending_output_and_is_never_dropped(engine):
    from engine.request_output import CompletionOutput, RequestOutput

    async def run():
        engine.core.pause()
        stream = engine.submit([65], SamplingParams(max_tokens=5), "err")
        partial = RequestOutput("err", None, [65], [CompletionOutput(0, "a", [97])])
        stream._put(partial)
        stream._put(RuntimeError("boom"))
        stream._put(partial)  # a late output does not hide the error
        with pytest.raises(RuntimeError, match="boom"):
            await stream.__anext__()
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        final = RequestOutput("f", None, [65], [CompletionOutput(0, "ab", [97, 98], "stop")],
                              finished=True)
        other = engine.submit([65], SamplingParams(max_tokens=5), "f")
        other._put(final)
        other._put(partial)  # cannot replace the final output
        other._put(RuntimeError("late"))
        assert [o async for o in other] == [final]
        engine.core.resume()

    asyncio.run(run())


def test_dead_reason_names_the_fatal_error(engine):
    core = engine.core
    assert engine.is_healthy and engine.dead_reason is None

    async def run():
        core.fail_next_step = RuntimeError("forward pass exploded")
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate([65], SamplingParams(max_tokens=3), "dies"):
                pass

    asyncio.run(run())
    assert not engine.is_healthy
    assert engine.dead_reason == "RuntimeError: forward pass exploded"
