"""The remote store's connection: redis-py (with hiredis when installed), synchronous, safe to
share between threads (a connection pool; each thread's command takes its own connection).

Chosen over valkey-glide by measurement (docs/kv-cache.md's remote
tier section has the figures): the look-up the engine thread waits for was faster through
redis-py, and glide's Python client is asyncio-only where the tier's callers are threads.

Every command has a socket timeout and no client-side retry: a failure reaches the store at
once, which marks the tier down (``engine.kv_cache.remote.health``) instead of retrying inline."""

from __future__ import annotations

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

# what a failed command raises: the server refused, closed, timed out or answered an error
CLIENT_ERRORS = (RedisError, OSError)


class RemoteClient:
    def __init__(self, url: str, timeout_s: float, connect_timeout_s: float) -> None:
        """``url``: redis-py's (``RemoteTierConfig.url``). Connects lazily: never raises for
        the server's sake here."""
        self.redis = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 0), retry_on_timeout=False, health_check_interval=0,
            client_name="kvserve-kv-tier")

    def exists_each(self, keys: list[bytes]) -> list[bool]:
        """Whether each key exists: one pipelined ``EXISTS`` per key, one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        return [bool(n) for n in pipe.execute()]

    def mget(self, keys: list[bytes]) -> list[bytes | None]:
        return self.redis.mget(keys) if keys else []

    def set_many(self, items: list[tuple[bytes, bytes]]) -> None:
        """``SET`` each (key, value), pipelined: one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for key, value in items:
            pipe.set(key, value)
        pipe.execute()

    def delete(self, keys: list[bytes]) -> None:
        if keys:
            self.redis.unlink(*keys)

    def ping(self) -> None:
        self.redis.ping()

    def close(self) -> None:
        self.redis.close()
