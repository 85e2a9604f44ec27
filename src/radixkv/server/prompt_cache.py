"""OpenAI's prompt-caching fields, turned into what the engine does (`CacheSpec`).

* ``prompt_cache_breakpoint`` on a chat content block: the prefix ending with that block
  (the tokens where its rendering ends) is retained for the block's ``ttl`` or the
  request's; on a recurrent model it is also a state-checkpoint boundary. At most
  `MAX_BREAKPOINTS` a request (more: 400 naming the field).
* ``prompt_cache_options``: ``mode: "implicit"`` (the default) caches as always and
  retains the whole prompt (the implicit breakpoint) and the latest three explicit
  ones; ``mode: "explicit"`` caches only up to the last breakpoint and retains the
  latest four, and a request without one neither reads nor writes the cache. ``ttl``
  (``30m``) is how long a breakpoint without its own stays.
* ``prompt_cache_retention: "24h"`` retains the whole prompt (implicit mode) and every
  breakpoint for at least 24 hours; ``"in_memory"`` is the cache as always.

A request with none of them gets no `CacheSpec`: the cache behaves as it always has
(nothing retained, nothing reported beyond ``cached_tokens``). Retention is bounded by
the server's quota (``--max-retained-tokens`` per ``cache_salt``; `radixkv.kvcache.retention`).

Owns: reading these fields. Must not touch: the cache (the engine applies the spec).
"""

from __future__ import annotations

from typing import Any

from radixkv.engine.request import CacheSpec
from radixkv.server.protocol import MAX_BREAKPOINTS, TTL_SECONDS, ApiError, ChatCompletionRequest

IMPLICIT_EXPLICIT = 3  # explicit breakpoints written beside the implicit one


def breakpoints(req: ChatCompletionRequest) -> list[tuple[int, int, str | None]]:
    """The chat's breakpoints in order: (message, content block, its own ttl or None).

    Raises:
        ApiError: more than `MAX_BREAKPOINTS`.
    """
    cuts = [
        (i, j, part.prompt_cache_breakpoint.ttl)
        for i, m in enumerate(req.messages)
        if isinstance(m.content, list)
        for j, part in enumerate(m.content)
        if part.prompt_cache_breakpoint is not None
    ]
    if len(cuts) > MAX_BREAKPOINTS:
        raise ApiError(400, f"prompt_cache_breakpoint: at most {MAX_BREAKPOINTS} a request, "
                       f"got {len(cuts)}", "prompt_cache_breakpoint")  # fmt: skip
    return cuts


def positions(
    engine: Any, req: ChatCompletionRequest, messages: list[dict], ids: list[int],
    cuts: list, tools: list[dict] | None = None,
) -> list[tuple[int, str | None]]:  # fmt: skip
    """Where each breakpoint's block ends in the rendered prompt ``ids`` (rendering the
    chat up to that block alone; ``messages`` are the request's as the template takes
    them, one per message), with its ttl. Off the event loop: it renders."""
    out = []
    for i, j, ttl in cuts:
        parts = req.messages[i].content
        head = "".join(p.text for p in parts[: j + 1])  # type: ignore[union-attr]
        msgs = [*messages[:i], {**messages[i], "content": head}]
        pos = engine.rendered_prefix(msgs, ids, tools)
        if pos > 0:
            out.append((pos, ttl))
    return out


def cache_spec(req: Any, n: int, marks: list[tuple[int, str | None]]) -> CacheSpec | None:
    """What the request's fields ask of the cache for a prompt of ``n`` tokens with
    breakpoints at ``marks``; None when it sends none of them."""
    opts, retention = req.prompt_cache_options, req.prompt_cache_retention
    if opts is None and retention is None and not marks:
        return None
    ttl = TTL_SECONDS[opts.ttl if opts is not None else "30m"]
    retain = [(pos, TTL_SECONDS[t] if t else ttl) for pos, t in marks]
    if opts is not None and opts.mode == "explicit":
        if not retain:
            return CacheSpec(limit=0, read=False)  # no breakpoint: no prompt caching
        if retention == "24h":
            retain = [(p, max(t, TTL_SECONDS["24h"])) for p, t in retain]
        return CacheSpec(retain=tuple(retain), limit=max(p for p, _ in retain))
    retain = retain[-IMPLICIT_EXPLICIT:]
    if opts is not None or retention == "24h":
        retain.append((n, ttl))
    if retention == "24h":  # at least a day, whatever else asked for less
        retain = [(p, max(t, TTL_SECONDS["24h"])) for p, t in retain]
    return CacheSpec(retain=tuple(retain))


__all__ = ["breakpoints", "cache_spec", "positions"]
