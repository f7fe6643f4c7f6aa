"""The remote KV tier (``--kv-remote-url redis://HOST:PORT/DB``): prefix blocks in a Redis or
Valkey server, shared by every replica that uses it, beside (or instead of) the disk tier and
driven by the same facade (``engine.kv_cache.disk.tier.DiskTier``).

- the URL and the tier's knobs: :mod:`engine.config.kv_remote` (frozen, validated);
- :mod:`.record`: a value is the disk tier's checksummed record behind its fingerprint header;
- :mod:`.client`: redis-py with timeouts and no inline retries;
- :mod:`.health`: failing open: a server down or slow costs misses, one WARNING, retries;
- :mod:`.store`: look-ups (pipelined EXISTS), reads (MGET), the bounded writer;
- :mod:`.chain`: disk then remote behind the disk store's interface.
"""

from engine.kv_cache.remote.stats import RemoteTierStats

__all__ = ["RemoteTierStats"]
