"""What an engine served, written down so that it can be replayed: one JSON line per
finished request, after a header holding the engine's cache knobs.

Why a replay of it is exact: nothing the cache decides reads a KV value or a logit
(`radixkv.sim.serve_replay`). What a live server adds is timing: which requests had
arrived when the scheduler ran. So each record names the engine *step* it arrived at
(``Engine.counters.steps`` when it was queued: steps that ran a batch) and, for a
request that left early (aborted, failed), the step it left at. Fed the same requests
at the same steps, in the same order (``order``), with the same knobs, the engine makes
the same decisions at any concurrency, and each request's ``cached`` (the prompt tokens
the server served from the cache) is the replay's too. Not exact: the ``session``
eviction policy and retention TTLs read the wall clock; host / store tiers (their
contents outlive the log).

Format (``radixkv simulate --format served`` reads it):

    {"radixkv_served_log": 1, "config": {page_size, chunk_size, max_running, ...}}
    {"order": 0, "step": 0, "token_ids": [...], "output_ids": [...], "boundaries": [...],
     "extra_key": "salt" | null, "group": its leader | null, "cache_limit": n | null,
     "cache_read": true, "retain": [[pos, seconds], ...], "finish": "length",
     "left_step": null, "cached": 0}

Security: the log holds every prompt's token ids (what users sent): the file is created
for its owner only (0600), never through a symlink, and stops growing at ``limit`` bytes
(a warning once; a replay of a cut log misses the requests past the cut).

Owns: the log's format and its writing. Must not touch: the engine's state (it reads a
finished request).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch

log = logging.getLogger(__name__)

VERSION = 1
LIMIT = 1 << 30  # bytes a log grows to at most
# the knobs a replay builds its engine with (device, storage and secrets are not logged)
KNOBS = ("prefix_cache", "page_size", "schedule_policy", "chunk_size", "max_running",
         "kv_tokens", "max_context_len", "eviction_policy", "dtype", "host_tokens",
         "max_checkpoints", "checkpoint_every", "max_retained_tokens", "window_tokens",
         "cache_bytes", "cache_split")  # fmt: skip


def knobs_of(cfg: Any) -> dict[str, Any]:
    """The replay-relevant knobs of an `EngineConfig`, as JSON values."""
    out = {k: getattr(cfg, k) for k in KNOBS}
    out["dtype"] = str(cfg.dtype).removeprefix("torch.")
    return out


def knobs_from(raw: dict[str, Any]) -> dict[str, Any]:
    """`knobs_of`'s inverse (an `EngineConfig` validates the values).

    Raises:
        ValueError: an unknown knob or dtype.
    """
    unknown = sorted(set(raw) - set(KNOBS))
    if unknown:
        raise ValueError(f"config: unknown knob {unknown[0]!r:.60}")
    out = dict(raw)
    if "dtype" in out:
        dtype = getattr(torch, str(out["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"config: dtype {out['dtype']!r:.40} is not a torch dtype")
        out["dtype"] = dtype
    return out


def namespace(key: Any) -> str | int | None:
    """A cache namespace as JSON: strings and integers as they are, others by type and
    repr (distinct keys stay distinct; the replay only compares them)."""
    if key is None or isinstance(key, str) or (isinstance(key, int) and not isinstance(key, bool)):
        return key
    return f"{type(key).__name__}:{key!r}"


def _ints(xs: Any) -> list[int]:
    return [int(x) for x in xs]


class ServedLog:
    """Appends each finished request to ``path`` (see the module's format)."""

    def __init__(self, path: str, cfg: Any, limit: int = LIMIT) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as e:
            raise ValueError(f"served_log: cannot write {path!r}: {e.strerror or e}") from None
        self.file = os.fdopen(fd, "a", encoding="utf-8")
        self.path, self.limit = path, limit
        self.written = os.fstat(fd).st_size
        self.full = False
        self._write({"radixkv_served_log": VERSION, "config": knobs_of(cfg)})

    def record(self, r: Any, step: int) -> None:
        """Log finished request ``r`` (an `EngineReq`); ``step``: the engine's step now."""
        left = r.finish_reason in ("abort", "error")
        self._write({
            "order": r.order, "step": r.arrived_step, "token_ids": _ints(r.input_ids),
            "output_ids": _ints(r.output_ids), "boundaries": _ints(r.boundaries),
            "extra_key": namespace(r.extra_key), "group": namespace(r.group),
            "cache_limit": r.cache_limit, "cache_read": r.cache_read,
            "retain": [[int(p), float(t)] for p, t in r.retain], "finish": r.finish_reason,
            "left_step": step if left else None, "cached": max(r.prompt_cached, 0),
        })  # fmt: skip

    def _write(self, rec: dict[str, Any]) -> None:
        if self.full:
            return
        line = json.dumps(rec, separators=(",", ":")) + "\n"
        if self.written + len(line) > self.limit:
            self.full = True
            log.warning("served log %s reached %d bytes: no more requests are logged",
                        self.path, self.limit)  # fmt: skip
            return
        self.file.write(line)
        self.file.flush()  # (whole lines on disk: the server may be killed at any time)
        self.written += len(line)
