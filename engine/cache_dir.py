"""Where kvserve keeps what it builds or converts once per machine (converted GGUF files, the
compiled CPU kernels, the start-up probe's verdicts)."""

from __future__ import annotations

from pathlib import Path

from engine import envs


def default_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir``, else ``$KVSERVE_CACHE_DIR``, else ``~/.cache/kvserve``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = envs.cache_dir()
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "kvserve"
