"""The profiler's bounds (``/start_profile`` / ``/stop_profile``, engine/profiling.py): a session
stops by itself at ``--profiler-max-iters`` engine steps or ``--profiler-max-seconds`` (also
while the engine is idle), a second start while one records or while its trace is being written
is a 409, and the trace is written off the engine thread: with an export that waits (torch's
own holds the GIL, so only a stand-in shows it), the engine serves requests meanwhile. Over a
real uvicorn server with the fake core (its steps are plain Python, so the
traces are small and quick)."""

from __future__ import annotations

import argparse
import json
import threading

import httpx
import pytest
import torch

from engine.async_engine import AsyncEngine
from server.app import build_app
from server.config_file import ServerSettings, add_server_arguments, resolve
from tests.server.fakes import FakeCore
from tests.server.helpers import ServerThread, assert_error


def _serve(tmp_path, **settings) -> ServerThread:
    core = FakeCore()
    srv = ServerThread(build_app(AsyncEngine(core=core), ServerSettings(
        profiler_dir=str(tmp_path / "traces"), **settings)))
    srv.core = core
    return srv


def _post(srv, path: str) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", timeout=60)


def _complete(srv, max_tokens: int, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/completions", timeout=timeout, json={
        "prompt": "x", "max_tokens": max_tokens})


def _steps_in(trace_path: str) -> int:
    events = json.loads(open(trace_path).read())["traceEvents"]
    return sum(1 for e in events if e.get("name") == "kvserve::step")


def _until(pred, tries: int = 3000) -> None:
    for _ in range(tries):
        if pred():
            return
        threading.Event().wait(0.01)
    raise AssertionError("condition not reached")


def test_a_session_stops_itself_at_max_iters(tmp_path):
    with _serve(tmp_path, profiler_max_iters=3) as srv:
        r = _post(srv, "/start_profile")
        assert r.status_code == 200, r.text
        assert_error(_post(srv, "/start_profile"), 409, code="profiler_state")
        assert _complete(srv, max_tokens=8).status_code == 200  # 8 steps
        engine = srv.server.config.app.state.engine
        _until(lambda: not engine.profiler.active)
        r = _post(srv, "/stop_profile")  # reports the session that stopped itself
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["status"] == "stopped" and body["stopped_by"] == "max_iters"
        assert body["num_steps"] == 3 and _steps_in(body["trace"]) == 3
        assert_error(_post(srv, "/stop_profile"), 409, code="profiler_state")
        assert _post(srv, "/start_profile").status_code == 200  # a new session may start
        body = _post(srv, "/stop_profile").json()
        assert body["stopped_by"] == "request" and body["num_steps"] == 0


def test_an_idle_session_stops_itself_at_max_seconds(tmp_path):
    with _serve(tmp_path, profiler_max_seconds=0.5) as srv:
        assert _post(srv, "/start_profile").status_code == 200
        engine = srv.server.config.app.state.engine
        _until(lambda: not engine.profiler.active)  # no step ran: the timer stopped it
        body = _post(srv, "/stop_profile").json()
        assert body["stopped_by"] == "max_seconds" and body["num_steps"] == 0
        assert _steps_in(body["trace"]) == 0


def test_the_trace_is_written_off_the_engine_thread(tmp_path, monkeypatch):
    writing, release = threading.Event(), threading.Event()
    export = torch.profiler.profile.export_chrome_trace

    def slow_export(self, path, *args, **kwargs):
        writing.set()
        assert release.wait(60)
        return export(self, path, *args, **kwargs)

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", slow_export)
    with _serve(tmp_path) as srv:
        assert _post(srv, "/start_profile").status_code == 200
        assert _complete(srv, max_tokens=2).status_code == 200
        stopped: dict = {}
        t = threading.Thread(target=lambda: stopped.setdefault("r", _post(srv, "/stop_profile")))
        t.start()
        try:
            assert writing.wait(60)
            # The export waits: the engine serves on meanwhile (a step on the engine thread
            # would wait with it, and this request time out).
            assert _complete(srv, max_tokens=3, timeout=20).json()["choices"][0]["text"] == "abc"
            assert_error(_post(srv, "/start_profile"), 409, code="profiler_state",
                         contains="written")
        finally:
            release.set()
            t.join(60)
        r = stopped["r"]
        assert r.status_code == 200, r.text
        assert r.json()["stopped_by"] == "request" and _steps_in(r.json()["trace"]) == 2
        assert _post(srv, "/start_profile").status_code == 200  # the writer is done
        assert _post(srv, "/stop_profile").status_code == 200


def _flags(*argv: str) -> ServerSettings:
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    return resolve(vars(parser.parse_args(argv)))[1]


def test_profiler_flags(tmp_path):
    server = _flags("--profiler-dir", str(tmp_path), "--profiler-max-seconds", "12.5",
                    "--profiler-max-iters", "40")
    assert (server.profiler_max_seconds, server.profiler_max_iters) == (12.5, 40)
    server = _flags()
    assert server.profiler_max_seconds > 0 and server.profiler_max_iters > 0  # capped
    for bad in ({"profiler_max_seconds": -1}, {"profiler_max_iters": -1},
                {"profiler_max_seconds": float("nan")}):
        with pytest.raises(ValueError, match="profiler-max"):
            ServerSettings(**bad)
