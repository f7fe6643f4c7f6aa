"""The remote tier's options, frozen and validated (``ValueError`` with an actionable message).

Given as one URL, ``--kv-remote-url redis://HOST:PORT/DB``; ``valkey://`` and ``valkeys://``
are accepted as spellings of ``redis://`` and ``rediss://`` (TLS), ``unix:///path.sock?db=N``
for a socket. Optional query parameters set the tier's own knobs (anything else is refused, so
a typo is not silently a default): ``timeout`` (seconds, look-ups and connecting: the engine
thread waits at most this long), ``io_timeout`` (seconds, reads and writes, off the engine
thread), ``queue_blocks`` (blocks the writer may have queued; more are dropped), e.g.
``redis://cache:6379/0?timeout=0.1&queue_blocks=512``.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl, urlsplit, urlunsplit

SCHEMES = {"redis": "redis", "rediss": "rediss", "unix": "unix", "valkey": "redis",
           "valkeys": "rediss"}
_KNOBS = {"timeout": ("timeout_s", float), "io_timeout": ("io_timeout_s", float),
          "queue_blocks": ("queue_blocks", int)}


@dataclass(frozen=True)
class RemoteTierConfig:
    """``url``: the server, as redis-py reads it (scheme normalised, the tier's query
    parameters removed). ``timeout_s``: connecting and look-ups (pipelined ``EXISTS`` on the
    engine thread). ``io_timeout_s``: ``MGET`` reads (reader thread) and ``SET`` writes
    (writer thread). ``queue_blocks``: blocks the writer may have queued; more are dropped,
    never waited for. ``write_batch``: records per pipelined write. ``key_prefix``: the keys
    are ``{key_prefix}:{fingerprint}:{block hash}``."""

    url: str
    timeout_s: float = 0.25
    io_timeout_s: float = 2.0
    queue_blocks: int = 256
    write_batch: int = 16
    key_prefix: str = "kvserve"
    write_policy: str = "write-through"  # the remote tier alone: blocks as they are committed

    def __post_init__(self) -> None:
        scheme = urlsplit(self.url).scheme
        if scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"kv_remote_url must be redis://HOST:PORT/DB (or rediss://, "
                             f"valkey://, unix://); got {self.url!r}")
        if not 0 < self.timeout_s <= 60 or not 0 < self.io_timeout_s <= 600:
            raise ValueError(f"the remote KV tier's timeouts must be > 0 s (timeout at most "
                             f"60, io_timeout at most 600); got timeout={self.timeout_s}, "
                             f"io_timeout={self.io_timeout_s}")
        if self.queue_blocks < 1 or self.write_batch < 1:
            raise ValueError(f"the remote writer needs queue_blocks >= 1 and write_batch >= 1;"
                             f" got {self.queue_blocks}, {self.write_batch}")
        if not self.key_prefix or ":" in self.key_prefix:
            raise ValueError(f"the remote key prefix must be non-empty without ':'; got "
                             f"{self.key_prefix!r}")

    @property
    def size_bytes(self) -> int:
        """0: the server's ``maxmemory`` bounds the store, not this client (the KV page shows
        the blocks this server knows of)."""
        return 0

    @classmethod
    def from_url(cls, url: str) -> RemoteTierConfig:
        """Parse ``--kv-remote-url`` (module docstring)."""
        parts = urlsplit(str(url).strip())
        scheme = SCHEMES.get(parts.scheme.lower())
        if scheme is None or (scheme != "unix" and not parts.hostname):
            raise ValueError(f"kv_remote_url must look like redis://HOST:PORT/DB (or rediss://, "
                             f"valkey://, unix:///path.sock); got {url!r}")
        kept, knobs = [], {}
        for key, value in parse_qsl(parts.query, keep_blank_values=True):
            if key in _KNOBS:
                field, kind = _KNOBS[key]
                try:
                    knobs[field] = kind(value)
                except ValueError:
                    raise ValueError(f"kv_remote_url: {key}={value!r} is not a "
                                     f"{kind.__name__}") from None
            elif key in ("db", "password", "username", "protocol"):
                kept.append(f"{key}={value}")  # redis-py's own
            else:
                raise ValueError(f"kv_remote_url: unknown parameter {key!r}; known: "
                                 f"{', '.join([*_KNOBS, 'db', 'username', 'password'])}")
        clean = urlunsplit((scheme, parts.netloc, parts.path, "&".join(kept), ""))
        return cls(clean, **knobs)

    def redacted_url(self) -> str:
        """The URL without its password (for logs)."""
        parts = urlsplit(self.url)
        if parts.password is None:
            return self.url
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit((parts.scheme, netloc, parts.path, "", ""))
