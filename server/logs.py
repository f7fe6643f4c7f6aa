"""Logging for ``kvserve``: one handler on stderr for our loggers and uvicorn's.

Uvicorn is started with ``log_config=None`` so that it does not replace this set-up (its default
config would leave the ``kvserve.*`` loggers, which log the model, dtype, device, KV blocks and
maximum concurrency at start-up, without a handler).
"""

from __future__ import annotations

import logging.config

# Loggers of this project: engine code logs under "kvserve.*"; "engine"/"server"/"kvserve_kernels" cover
# modules that use getLogger(__name__).
PROJECT_LOGGERS = ("kvserve", "engine", "server", "kvserve_kernels")


def configure_logging(level: str = "info") -> None:
    lvl = level.upper()
    loggers = {name: {"handlers": ["default"], "level": lvl, "propagate": False}
               for name in PROJECT_LOGGERS}
    loggers.update({
        "uvicorn": {"handlers": ["default"], "level": lvl, "propagate": False},
        "uvicorn.error": {"level": lvl},
        "uvicorn.access": {"handlers": [], "level": "WARNING", "propagate": False},
    })
    logging.config.dictConfig({
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"default": {
            "format": "%(asctime)s %(levelname)s %(name)s: %(message)s",
            "datefmt": "%Y-%m-%d %H:%M:%S",
        }},
        "handlers": {"default": {"class": "logging.StreamHandler", "formatter": "default",
                                 "stream": "ext://sys.stderr"}},
        "loggers": loggers,
        "root": {"handlers": ["default"], "level": "WARNING"},
    })


class StartupPhases(logging.Handler):
    """Times the phases of a start (``with StartupPhases() as p: build the engine``) from the
    records the loader and the engine log anyway: the GGUF conversion ("converted X in S s"),
    the start-up probe (from "start-up probe: measuring" to its "quantization=auto:" verdict);
    what remains is the load. :meth:`describe` is the one line ``kvserve serve`` logs."""

    def __init__(self, logger_name: str = "kvserve") -> None:
        super().__init__(logging.DEBUG)
        self._logger = logging.getLogger(logger_name)
        self.start = self.end = 0.0
        self.conversion: float | None = None
        self._probe_start: float | None = None
        self.probe: float | None = None

    def __enter__(self) -> StartupPhases:
        import time

        self.start = time.perf_counter()
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        import time

        self.end = time.perf_counter()
        self._logger.removeHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        import time

        msg = str(record.msg)
        if msg.startswith("converted %s in") and record.args:
            self.conversion = float(record.args[-1])  # type: ignore[index]
        elif msg.startswith("start-up probe: measuring"):
            self._probe_start = time.perf_counter()
        elif msg.startswith("quantization=auto:") and self._probe_start is not None:
            self.probe = time.perf_counter() - self._probe_start
            self._probe_start = None

    def describe(self) -> str:
        total = max(self.end - self.start, 0.0)
        parts = [f"GGUF conversion {self.conversion:.1f} s" if self.conversion is not None
                 else "no conversion (cached or not a GGUF)"]
        if self.probe is not None:
            parts.append(f"start-up probe {self.probe:.1f} s")
        load = total - (self.conversion or 0.0) - (self.probe or 0.0)
        parts.append(f"load {max(load, 0.0):.1f} s")
        return f"model loaded in {total:.1f} s ({', '.join(parts)})"
