"""``python -m tests.server.fake_server_main --port P``: the real CLI serving path
(``run_server``: signals, graceful drain) around a fake core, for the SIGTERM test."""

from __future__ import annotations

import argparse

from engine.async_engine import AsyncEngine
from server.app import build_app
from server.cli import run_server
from server.config_file import ServerSettings
from server.logs import configure_logging
from tests.server.fakes import FakeCore


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--step-delay", type=float, default=0.02)
    ap.add_argument("--shutdown-timeout", type=float, default=30.0)
    args = ap.parse_args()
    settings = ServerSettings(port=args.port, shutdown_timeout=args.shutdown_timeout)
    configure_logging(settings.log_level)
    engine = AsyncEngine(core=FakeCore(max_model_len=4096, step_delay=args.step_delay))
    run_server(build_app(engine, settings), engine, settings)


if __name__ == "__main__":
    main()
