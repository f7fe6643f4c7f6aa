"""The connection layer (server/connections.py, server/write_progress.py) on a real uvicorn
server around a fake core, quick enough for the default run (the real-model versions are in
test_net_hardening.py): idle and slowloris connections are closed at the header/body timeouts,
one address's connections are capped, and a stream whose client reads nothing is aborted
though every byte of it fits in the kernel's buffers."""

from __future__ import annotations

import json
import socket
import time

import httpx

from engine.async_engine import AsyncEngine
from server.app import build_app
from server.config_file import ServerSettings
from server.connections import protocol_class
from tests.server.fakes import FakeCore
from tests.server.helpers import ServerThread


def _serve(core: FakeCore, **settings) -> ServerThread:
    app = build_app(AsyncEngine(core=core), ServerSettings(**settings))
    return ServerThread(app, http=protocol_class(app.state.connections))


def _until_closed(sock: socket.socket, within: float = 10.0) -> bytes:
    sock.settimeout(within)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_idle_and_slow_requests_are_closed_at_their_timeouts():
    with _serve(FakeCore(), header_timeout=0.5, body_timeout=0.5) as srv:
        addr = ("127.0.0.1", srv.port)
        with socket.create_connection(addr) as idle, socket.create_connection(addr) as head, \
                socket.create_connection(addr) as body:
            head.sendall(b"GET /health HTTP/1.1\r\nHost")
            body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n"
                         b"\r\n{")
            assert _until_closed(idle) == b""  # sent nothing: closed without an answer
            for sock, flag in ((head, b"--header-timeout"), (body, b"--body-timeout")):
                raw = _until_closed(sock)
                assert raw.startswith(b"HTTP/1.1 408 ") and flag in raw
                err = json.loads(raw.partition(b"\r\n\r\n")[2])["error"]
                assert err["code"] == "request_timeout" and err["type"]
        # A kept-alive connection answers its requests as before.
        with httpx.Client(base_url=srv.url) as client:
            assert [client.get("/health").status_code for _ in range(3)] == [200] * 3


def test_one_address_is_capped():
    with _serve(FakeCore(), max_connections_per_client=2) as srv:
        addr = ("127.0.0.1", srv.port)
        with socket.create_connection(addr), socket.create_connection(addr):
            time.sleep(0.2)
            with socket.create_connection(addr) as third:
                raw = _until_closed(third)
        assert raw.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in raw
        assert httpx.get(f"{srv.url}/health").status_code == 200  # the others closed: room


def test_a_stream_never_read_is_aborted_though_the_kernel_takes_all_of_it():
    """~2000 events of ~150 bytes: they fit in the kernel's buffers, so no send ever blocks."""
    core = FakeCore(max_model_len=4096, step_delay=0.01)
    with _serve(core, stream_timeout=1.0) as srv:
        body = json.dumps({"prompt": "x", "max_tokens": 2000, "stream": True}).encode()
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", srv.port))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            deadline = time.monotonic() + 15
            while not core.aborted:
                assert time.monotonic() < deadline, "the unread stream was not aborted"
                time.sleep(0.02)
            time.sleep(0.2)
            assert core.blocks_used == 0 and core.generation_tokens < 2000
