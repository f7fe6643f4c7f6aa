"""A real ``redis-server`` for the remote KV tier's tests (tests/**/test_kv_remote*.py): started on
a free loopback port in a temporary directory, no persistence (``--save ''``), a small
``maxmemory`` with ``allkeys-lru``, killed and started again on the same port to stage an
outage. Tests skip with the reason when ``redis-server`` is not installed (``.ci/run`` installs
the Debian package where it may). No mock of the store anywhere."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis

from loadgen.serve import free_port

REDIS_SERVER = shutil.which("redis-server")


def require_redis_server() -> str:
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server; "
                    ".ci/run installs it where it may)")
    return REDIS_SERVER


class RedisServer:
    def __init__(self, directory: Path, maxmemory: str = "64mb") -> None:
        self.exe = require_redis_server()
        self.dir = directory
        self.maxmemory = maxmemory
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> RedisServer:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log = open(self.dir / "redis.log", "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.dir), "--maxmemory", self.maxmemory,
             "--maxmemory-policy", "allkeys-lru", "--protected-mode", "yes"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while True:
            assert self.proc.poll() is None, (self.dir / "redis.log").read_text()
            try:
                if self.client().ping():
                    return self
            except (redis.RedisError, OSError):
                pass
            assert time.monotonic() < deadline, "redis-server did not answer in 15 s"
            time.sleep(0.05)

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-run (its data with it: no persistence)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None
        if hasattr(self, "log"):
            self.log.close()

    def stopped_port_refuses(self) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) != 0

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()
