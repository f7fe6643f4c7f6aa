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
