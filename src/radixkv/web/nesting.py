"""How deeply a client's JSON value nests, bounded: a tool's schema, a call's arguments.

Both APIs (OpenAI's and Anthropic's) refuse values nested deeper than `MAX_DEPTH`: a
template renders them with recursive filters, and JSON Schema checks recurse, so a deep
one costs every request behind it (a recursion error, or a long walk).

Owns: `depth`. Must not touch: anything else.
"""

from __future__ import annotations

from typing import Any

MAX_DEPTH = 64  # how deeply a schema or a call's arguments may nest


def depth(value: Any, limit: int = MAX_DEPTH) -> int:
    """How deeply ``value`` nests (lists and objects), counted up to ``limit + 1``,
    breadth first (no recursion)."""
    level, frontier = 0, [value]
    while frontier and level <= limit:
        nxt: list[Any] = []
        for v in frontier:
            if isinstance(v, dict):
                nxt.extend(v.values())
            elif isinstance(v, list):
                nxt.extend(v)
        level, frontier = level + 1, nxt
    return level if not frontier else limit + 1


__all__ = ["MAX_DEPTH", "depth"]
