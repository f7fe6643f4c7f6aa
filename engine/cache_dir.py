"""Where kvserve keeps what it builds or converts once per machine (converted GGUF files, the
compiled CPU kernels, the start-up probe's verdicts)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir``, else ``$KVSERVE_CACHE_DIR``, else ``~/.cache/kvserve``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("KVSERVE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "kvserve"
