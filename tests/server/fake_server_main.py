"""``python -m tests.server.fake_server_main --port P``: the real CLI serving path
(``run_server``: signals, graceful drain, the engine-death watcher, the exit status) around a
fake core, for the SIGTERM and engine-death tests. A request whose prompt is ``DIE_PROMPT``
makes the core's step raise, as a failed forward pass would: the engine loop dies."""

from __future__ import annotations

import argparse
import sys

from engine.async_engine import AsyncEngine
from server.app import build_app
from server.cli import run_server
from server.config_file import ServerSettings
from server.logs import configure_logging
from tests.server.fakes import FakeCore

DIE_PROMPT = "die!"


class DyingCore(FakeCore):
    def step(self):
        die = [ord(c) for c in DIE_PROMPT]
        if any(req.prompt == die for req in self.requests.values()):
            raise RuntimeError("simulated forward-pass failure")
        return super().step()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--step-delay", type=float, default=0.02)
    ap.add_argument("--shutdown-timeout", type=float, default=30.0)
    args = ap.parse_args()
    settings = ServerSettings(host=args.host, port=args.port,
                              shutdown_timeout=args.shutdown_timeout)
    configure_logging(settings.log_level)
    # start=False: run_server drives it on the main thread, as `kvserve serve` does.
    engine = AsyncEngine(core=DyingCore(max_model_len=4096, step_delay=args.step_delay),
                         start=False)
    sys.exit(run_server(build_app(engine, settings), engine, settings))


if __name__ == "__main__":
    main()
