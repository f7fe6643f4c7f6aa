"""API-key check: ``Authorization: Bearer <key>`` on the API routes when a key is configured.

Health, version and metrics stay open so that load balancers and Prometheus need no secret;
so do the routers' probes (server/router_routes.py: vllm-router sends no key with some of
them), but not ``/flush_cache`` and ``/reset_prefix_cache``, which drop the prefix cache.
The KV page's paths (``/kv``, ``/kv/state``, ``/kv/events``) also take the key as ``?key=<key>``:
a browser cannot send a header when it opens a page or an EventSource (the key then sits in the
URL: the browser's history keeps it; kvserve's own log lines show the path only).
"""

from __future__ import annotations

import hmac

# Paths that need the key when one is set (prefix match on "/v1/", exact on the others).
PROTECTED_PREFIX = "/v1/"
PROTECTED_PATHS = frozenset({"/v1", "/tokenize", "/detokenize", "/kv", "/kv/state",
                             "/kv/events", "/start_profile", "/stop_profile",
                             "/flush_cache", "/reset_prefix_cache"})
QUERY_KEY_PATHS = frozenset({"/kv", "/kv/state", "/kv/events"})


def is_protected(path: str) -> bool:
    return path.startswith(PROTECTED_PREFIX) or path in PROTECTED_PATHS


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (scheme case-insensitive)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def key_matches(authorization: str | None, api_key: str) -> bool:
    token = bearer_token(authorization)
    # compare_digest: the time taken does not reveal how much of the key matched.
    return token is not None and hmac.compare_digest(token.encode(), api_key.encode())


def query_key_matches(path: str, query_string: bytes, api_key: str) -> bool:
    """Whether ``path`` is one of :data:`QUERY_KEY_PATHS` and its query holds ``key=<api_key>``."""
    if path not in QUERY_KEY_PATHS or not query_string:
        return False
    from urllib.parse import parse_qs

    keys = parse_qs(query_string.decode("latin-1")).get("key", [])
    return any(hmac.compare_digest(k.encode(), api_key.encode()) for k in keys)
