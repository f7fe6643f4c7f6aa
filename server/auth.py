"""API-key check: ``Authorization: Bearer <key>`` on the API routes when a key is configured.

Health, version and metrics stay open so that load balancers and Prometheus need no secret.
"""

from __future__ import annotations

import hmac

# Paths that need the key when one is set (prefix match on "/v1/", exact on the others).
PROTECTED_PREFIX = "/v1/"
PROTECTED_PATHS = frozenset({"/v1", "/tokenize", "/detokenize"})


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
