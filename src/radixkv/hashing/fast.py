"""KV event block hashes: 64 bits a page, chained, a whole run of pages in a few numpy
calls.

A page's event hash names its whole prefix and namespace, as vLLM's block hashes do, and
is the same in every process and on every machine. It is built for speed, not strength:

* a page's *digest* is a multilinear hash of its units, ``d = sum(u_j * K_j) mod 2^64``
  with fixed odd keys ``K_j`` (from SHAKE-256 of a constant);
* the hash after page ``i`` is ``c_i = c_{i-1} * M + d_i mod 2^64`` (``M`` odd),
  starting from the namespace's root state (BLAKE2b of its ``repr``); being linear it
  vectorizes: ``c_i = M^i * (c_0 + sum_{k<=i} d_k * M^-k)``, one running sum a run.

Prefixes that differ in one token never collide (``delta * K * M^x`` is never 0 mod 2^64
for ``0 < |delta| < 2^63``: ``K`` and ``M`` are odd); other prefixes collide with
probability about 2^-64, unless someone builds the collision on purpose, which the
public keys allow, or recovers tokens from a hash, which linearity allows. So this hash
goes only where token ids travel beside it (`radixkv.events.EventCollector` with token
ids): a collision can only misroute a request (the engine still computes the right KV),
and it hides nothing the event does not show. Hash-only events, and the shared store's
page keys, use BLAKE2b-128 (`radixkv.tree.page_hash`).

Cost: 256 tokens hash in ~2.4 µs, as 256 pages of 1 or 16 pages of 16 (a running sum of
``u * W`` with each unit's key pre-scaled to its page, ``W = K_j * M^-(k+1)``), where a
BLAKE2b call a page took ~150 µs for the 256; `chain_runs` hashes many runs, a step's
inserts, in one such pass. ``python benchmarks/run.py`` times (a), (b) and (g) with events.

Owns: the fast event hash chain. Must not touch: the tree (which keeps the hashes) or
the events (which carry them).
"""

from __future__ import annotations

import hashlib
from itertools import accumulate
from typing import Any

import numpy as np

from radixkv.key import RadixKey

EVENT_HASH_BYTES = 8  # a page's chain state as stored in a node (little-endian uint64)
_U64 = np.uint64
_M = 0x9E3779B97F4A7C15  # the chain multiplier (odd, so invertible mod 2^64)
_M_INV = pow(_M, -1, 1 << 64)
_keys = np.empty(0, dtype=_U64)  # K_j, grown on demand (a prefix of one SHAKE stream)
_pow = np.ones(1, dtype=_U64)  # M^i, i = 0 .. len - 1
_ipow = np.ones(1, dtype=_U64)  # M^-i
_roots: dict[Any, int] = {}
_weights: dict[int, np.ndarray] = {}  # page_units -> _unit_weights


def _grow(width: int, pages: int) -> None:
    global _keys, _pow, _ipow
    if len(_keys) < width:
        raw = hashlib.shake_256(b"radixkv event block hash keys").digest(8 * width)
        _keys = np.frombuffer(raw, dtype="<u8").astype(_U64) | _U64(1)
        _weights.clear()
    if len(_pow) <= pages:
        n = max(pages + 1, 2 * len(_pow))
        with np.errstate(over="ignore"):
            _pow = np.concatenate(([_U64(1)], np.cumprod(np.full(n - 1, _M, dtype=_U64))))
            _ipow = np.concatenate(([_U64(1)], np.cumprod(np.full(n - 1, _M_INV, dtype=_U64))))


def _unit_weights(page_units: int, units: int) -> np.ndarray:
    """``W[k * page_units + j] = K_j * M^-(k+1)``, at least ``units`` long: a unit's
    weight in the running sum (its key, scaled to its page)."""
    w = _weights.get(page_units)
    if w is None or len(w) < units:
        pages = max(units // page_units, 2 * (len(w) // page_units if w is not None else 8))
        _grow(page_units, pages)
        w = np.outer(_ipow[1 : pages + 1], _keys[:page_units]).ravel()
        _weights[page_units] = w
    return w


def root_state(extra_key: Any) -> int:
    """The chain state before a namespace's first page."""
    state = _roots.get(extra_key)
    if state is None:
        digest = hashlib.blake2b(b"root:" + repr(extra_key).encode(), digest_size=8).digest()
        state = int.from_bytes(digest, "little")
        if len(_roots) < 4096:
            _roots[extra_key] = state
    return state


def _running_sum(units: np.ndarray, page_units: int, first: int) -> np.ndarray:
    """``first`` followed by the running sum of ``u * W`` over ``units`` (one entry a
    unit, so entry ``(k+1) * page_units`` closes page ``k``)."""
    n = len(units)
    acc = np.empty(n + 1, dtype=_U64)
    acc[0] = first
    np.multiply(units.view(_U64), _unit_weights(page_units, n)[:n], out=acc[1:])
    np.add.accumulate(acc, out=acc)
    return acc


def chain_states(units: np.ndarray, page_units: int, prev: int) -> np.ndarray:
    """The event hashes (chain states) after each whole page of ``units`` (int64 key
    units, a multiple of ``page_units`` long), continuing from state ``prev``."""
    pages = len(units) // page_units
    # uint64 array arithmetic wraps mod 2^64 without a warning (only scalars warn);
    # ``prev`` rides in front of the running sum (its weight is M^-0 = 1)
    ends = _running_sum(units, page_units, prev)[page_units::page_units]
    return ends * _pow[1 : pages + 1]


def chain_runs(
    units: np.ndarray, page_units: int, starts: list[int], pages: list[int]
) -> np.ndarray:
    """`chain_states` of several runs in one pass: ``units`` holds the runs' whole pages
    back to back (run ``r`` has ``pages[r]`` pages and continues from state
    ``starts[r]``); returns their states back to back. With ``C`` the running sum of
    ``d_h * M^-(h+1)`` over all pages, a page ``g`` of a run that begins at page ``s``
    has state ``M^(g+1) * (C[g] - C[s-1] + start * M^-s)``: one running sum for every
    run. Batching is the point: a numpy call costs about a microsecond whatever its size."""
    if len(starts) == 1:
        return chain_states(units, page_units, starts[0])
    total = len(units) // page_units
    closed = _running_sum(units, page_units, 0)[::page_units]  # C[-1] = 0, then C[g]
    counts = np.array(pages, dtype=np.int64)
    first = np.fromiter(accumulate(pages[:-1], initial=0), np.int64, len(pages))
    offsets = np.array(starts, dtype=_U64) * _ipow[first] - closed[first]
    states = closed[1:] + np.repeat(offsets, counts)
    states *= _pow[1 : total + 1]
    return states


def published(states: np.ndarray | bytes) -> list[int]:
    """The event wire's block hashes (vLLM's 64-bit integers) of stored chain states."""
    if isinstance(states, bytes | bytearray):
        return np.frombuffer(states, dtype="<u8").tolist()
    return states.tolist()


def last_state(states: bytes) -> int:
    """The final chain state of a node's stored states."""
    return int.from_bytes(states[-EVENT_HASH_BYTES:], "little")


def event_hashes(tokens: Any, extra_key: Any, page_size: int, n_pages: int) -> list[int]:
    """The block hashes a cache's events (with token ids) give the first ``n_pages``
    whole pages of ``tokens`` (token ids, not an EAGLE bigram view) in namespace
    ``extra_key``, for a subscriber that wants to name a prompt's pages as a worker
    does. (Hash-only events carry BLAKE2b chains: `radixkv.tree.chain_hashes`.)"""
    if n_pages == 0:
        return []
    units = np.frombuffer(RadixKey(tokens).unit_bytes(), dtype=np.int64)[: n_pages * page_size]
    return published(chain_states(units, page_size, root_state(extra_key)))


__all__ = [
    "EVENT_HASH_BYTES",
    "chain_runs",
    "chain_states",
    "event_hashes",
    "last_state",
    "published",
    "root_state",
]
