"""Test helpers: a uvicorn server on a background thread, /metrics parsing,
the OpenAI error shape."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from loadgen.serve import free_port


class ServerThread:
    """A real uvicorn server for ``app`` on 127.0.0.1, run on a daemon thread."""

    def __init__(self, app, port: int | None = None, **config_kwargs) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_config=None,
                                access_log=False, lifespan="on",
                                **{"timeout_graceful_shutdown": 5, **config_kwargs})
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def scrape(url: str, headers: dict[str, str] | None = None) -> dict[tuple[str, tuple], float]:
    """``/metrics`` as {(sample name, sorted labels): value}, via prometheus_client's parser."""
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(metrics: dict, name: str, **labels: str) -> float:
    """The value of one sample whose labels include ``labels`` (0.0 when absent)."""
    total = 0.0
    for (n, labs), v in metrics.items():
        if n == name and all(dict(labs).get(k) == val for k, val in labels.items()):
            total += v
    return total


def assert_error(r: httpx.Response, status: int, *, param: str | None = None,
                 contains: str = "", code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    assert contains in err["message"]
    return err


ROOT = Path(__file__).resolve().parents[2]


def start_server_process(args: list[str], log: Path,
                         timeout: float = 120) -> tuple[subprocess.Popen, str]:
    """``python ARGS --port P`` from the repository root (``PYTHONPATH`` set, output to
    ``log``), once ``/health`` answers 200; fails with the log when the process exits first or
    ``timeout`` seconds pass. Returns the process and its base URL."""
    port = free_port()
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, *args, "--port", str(port)], cwd=ROOT,
                                stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    try:
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
    except BaseException:  # no server outlives a start that failed: the caller never got it
        proc.kill()
        proc.wait()
        raise
