"""The port is bound before the model loads (issue 27, item 6): a second server on a busy port
fails at once with one clear line instead of loading the whole model first."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from server.listen import PortUnavailableError, bind_socket
from tests.server.helpers import ROOT


def test_bind_socket_names_the_taken_port_and_the_flag():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortUnavailableError, match=f"127.0.0.1:{port}: the port is already "
                                                        "in use.*--port"):
            bind_socket("127.0.0.1", port)
    sock = bind_socket("127.0.0.1", 0)  # bound, not listening: nothing is accepted yet
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(sock.getsockname(), timeout=5).close()
    finally:
        sock.close()


def test_kvserve_serve_on_a_taken_port_fails_before_loading_the_model(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "server.cli", "serve", "--port", str(port)], cwd=ROOT,
            capture_output=True, text=True, timeout=300,
            env={**os.environ, "PYTHONPATH": str(ROOT), "KVSERVE_CACHE_DIR": str(tmp_path)})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert f"kvserve: error: cannot listen on 127.0.0.1:{port}: the port is already in use" \
        in out
    assert "Traceback" not in out and "loading" not in out  # the model was never loaded
    assert not any(tmp_path.iterdir())  # nor converted into the (empty) cache
