"""How deeply a JSON-like value nests, counted without recursion: a value nested thousands of
levels deep (a 14 KB body can hold 5,000) must be refused before any recursive walk of it (a
canonical form, a template's ``tojson``, a grammar library) overflows the stack."""

from __future__ import annotations

from typing import Any


def deeper_than(value: Any, limit: int) -> str | None:
    """The path (``a.b.0``) of the first container nested more than ``limit`` levels deep in
    ``value`` (dicts and lists count one level each), else None."""
    stack: list[tuple[Any, int, str]] = [(value, 0, "")]
    while stack:
        v, depth, path = stack.pop()
        if isinstance(v, dict):
            items = ((str(k), item) for k, item in v.items())
        elif isinstance(v, list):
            items = ((str(i), item) for i, item in enumerate(v))
        else:
            continue
        if depth >= limit:
            return path or "(the top level)"
        for key, item in items:
            if isinstance(item, (dict, list)):
                stack.append((item, depth + 1, f"{path}.{key}" if path else key))
    return None
