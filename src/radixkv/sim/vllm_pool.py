"""vLLM's block pool, as the hybrid simulator's ``vllm`` row for a model with recurrent
layers: `KVCacheManager` with its `HybridKVCacheCoordinator` in ``--mamba-cache-mode
align`` (vLLM 0.33), block for block.

One idea: vLLM caches blocks, not a tree. Every block id is one page in every layer of a
layer group (full-attention groups and recurrent-state groups of equal size), all from
one pool; a block is cached under the hash of its tokens and every token before it, and
a hash may name several blocks. What follows from that, and what the tree-shaped row
missed (`benchmarks/peer_vllm_hybrid.py` found it):
- **Duplicates.** A request whose full-attention prefix is cached beyond the last
  recurrent state it can resume from computes that prefix again into new blocks, and
  caches them beside the old ones: a shared system prompt without a state at its end is
  held once per conversation until the old copies are evicted.
- **Eviction is the free queue's order.** Freed blocks go to the queue's tail (cached
  ones, tail block first) or its head (uncached ones, reused first); a new block is the
  queue's head, whose hash, if any, is forgotten. A block a hit touches leaves the queue.
- **Hits.** The longest run of cached full-attention blocks (all full groups), up to the
  prompt's last token, then the longest of those that ends on a block whose state every
  recurrent group holds.
- **States** are cached where a step of the request ends on a block's end: the prompt's
  first chunk ends on its last whole block (as vLLM's scheduler chunks it in align
  mode), then one decode step a token. A request holds two state blocks a group at a
  time (the last two it wrote), its full-attention blocks until it ends.

A request the pool cannot hold is counted in ``refused`` and served without a hit (vLLM
would refuse to start with that budget).

Owns: the pool's blocks, their hashes and the free queue, for one simulated row. Must not
touch: the tree rows (`radixkv.sim.hybrid`), which pick this class for ``vllm`` on a model
with recurrent layers and no window (vLLM's sliding-window groups are not modelled here).

Complexity: O(blocks of the request) dict operations a request. `tests/sim/
test_vllm_pool.py` checks the rules; the replay through vLLM's own code is
`benchmarks/peer_vllm_hybrid.py`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from radixkv.sim.traces import SimRequest, Trace


class _Full(Exception):
    """The pool has no free block left."""


class VllmAlignPool:
    """vLLM's cache for a hybrid model (full attention + recurrent layers), the
    simulator's interface: ``serve`` a request (its hit, in units), ``cached_prefix``,
    ``bytes_sum``, ``checkpoints``, ``page``, ``unit``."""

    def __init__(self, trace: Trace, spec: Any, capacity_bytes: int) -> None:
        if not spec.recurrent_layers or spec.window_layers:
            raise ValueError(f"{spec.name}: the vLLM pool models full attention + recurrent "
                             "layers only")  # fmt: skip
        self.trace, self.unit = trace, trace.block_size
        self.page = max(1, spec.vllm_block() // self.unit)  # units a block
        group = min(spec.full_layers, spec.recurrent_layers)
        page_bytes = max(self.page * self.unit * spec.kv_bytes, spec.state_bytes)
        self.block_bytes = page_bytes * group  # a block id: one page in each of its layers
        full, states = spec.full_layers // group, spec.recurrent_layers // group
        self.full_ids, self.state_ids = range(full), range(full, full + states)
        self.blocks = capacity_bytes // self.block_bytes
        # the free queue, head first: blocks put back uncached (``self.front`` of them),
        # then those never used (ids ``next_id`` on, counted, not listed: a budget may be
        # unbounded), then blocks put back cached; block 0 is vLLM's null block
        self.free: OrderedDict[int, None] = OrderedDict()
        self.front = 0
        self.next_id, self.never_used = 1, max(self.blocks - 1, 0)
        self.ref: dict[int, int] = {}
        self.key: dict[int, tuple[int, int]] = {}
        self.map: dict[tuple[int, int], dict[int, None]] = {}  # (group, hash): its blocks
        self.cached = {"full": 0, "states": 0}  # cached block ids of each kind
        self.checkpoints = self.refused = 0
        self._upto = 0  # the running request's full blocks cached so far
        self.bytes_sum = {"full": 0.0, "window": 0.0, "states": 0.0}

    # --- the pool -------------------------------------------------------------------------
    def _kind(self, group: int) -> str:
        return "full" if group in self.full_ids else "states"

    def free_blocks(self) -> int:
        return len(self.free) + self.never_used

    def _take(self) -> int:
        """The free queue's head, its hash forgotten (vLLM's ``get_new_blocks``)."""
        if self.front or not self.never_used:
            if not self.free:
                raise _Full
            b, _ = self.free.popitem(last=False)
            self.front = max(self.front - 1, 0)
        else:
            b, self.next_id, self.never_used = self.next_id, self.next_id + 1, self.never_used - 1
        k = self.key.pop(b, None)
        if k is not None:
            holders = self.map[k]
            del holders[b]
            if not holders:
                del self.map[k]
            self.cached[self._kind(k[0])] -= 1
        self.ref[b] = 1
        return b

    def _touch(self, b: int) -> None:
        """A hit takes a cached block (never one in the uncached front) off the queue."""
        if self.ref.get(b, 0) == 0:
            del self.free[b]
        self.ref[b] = self.ref.get(b, 0) + 1

    def _release(self, ordered: list[int]) -> None:
        """``free_blocks``: uncached blocks to the head (in order), cached to the tail."""
        first, last = [], []
        for b in ordered:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                del self.ref[b]
                (last if b in self.key else first).append(b)
        for b in reversed(first):
            self.free[b] = None
            self.free.move_to_end(b, last=False)
        self.front += len(first)
        for b in last:
            self.free[b] = None

    def _cache(self, b: int, k: tuple[int, int]) -> None:
        if b not in self.key:
            self.key[b] = k
            self.map.setdefault(k, {})[b] = None
            self.cached[self._kind(k[0])] += 1

    def _one(self, k: tuple[int, int]) -> int | None:
        holders = self.map.get(k)
        return next(iter(holders)) if holders else None

    # --- a request ------------------------------------------------------------------------
    def _hashes(self, units: Any, n: int) -> list[int]:
        g, h, out = self.page, 0, []
        for i in range(n // g):
            h = hash((h, tuple(units[i * g : (i + 1) * g])))
            out.append(h)
        return out

    def _hit(self, hashes: list[int], max_blocks: int) -> int:
        """Blocks of the longest hit (the coordinator's fixed point for full + state)."""
        full = 0
        while full < max_blocks and all(self._one((f, hashes[full])) is not None
                                        for f in self.full_ids):  # fmt: skip
            full += 1
        for i in range(full, 0, -1):
            if all(self._one((s, hashes[i - 1])) is not None for s in self.state_ids):
                return i
        return 0

    def _max_blocks(self, req: SimRequest, hashes: list[int]) -> int:
        # a hit stops before the prompt's last token (vLLM computes at least that one)
        return min(((req.prompt_tokens - 1) // self.unit) // self.page, len(hashes))

    def cached_prefix(self, req: SimRequest) -> int:
        """Units of the request's prompt a hit would serve now; no change to the pool."""
        hashes = self._hashes(req.units, req.num_prompt_units)
        return self._hit(hashes, self._max_blocks(req, hashes)) * self.page

    def serve(self, req: SimRequest, outputs: bool) -> int:
        """Run one request through the pool (hit, prefill in vLLM's chunks, one decode step
        a token, free); its hit in units."""
        g, P = self.page, req.num_prompt_units
        n = self.trace.cached_units(req, outputs)
        # only whole units are hashed (a trace's last unit may be part of a block): a
        # partial block is never cached, nor a state in it
        computed = req.prompt_tokens + (
            req.output_tokens - 1 if outputs and req.output_tokens else 0
        )
        hashes = self._hashes(req.units, min(n, computed // self.unit))
        hit = self._hit(hashes, self._max_blocks(req, hashes))
        full = {f: [self._one((f, h)) for h in hashes[:hit]] for f in self.full_ids}
        states: dict[int, list[tuple[int, int]]] = {s: [] for s in self.state_ids}
        for f in self.full_ids:
            for b in full[f]:
                self._touch(b)
        if hit:
            for s in self.state_ids:
                b = self._one((s, hashes[hit - 1]))
                self._touch(b)
                states[s].append((hit - 1, b))
        self._upto = hit  # full blocks this request has cached so far
        aligned = min(P, req.prompt_tokens // self.unit) // g * g  # the first chunk's end
        ends = [e for e in (aligned, P) if e > hit * g]
        ends = sorted(set(ends)) + list(range(P + 1, n + 1))  # then one decode step a token
        try:
            for e in ends:
                self._step(e, hashes, full, states)
        except _Full:
            self.refused += 1
            hit = 0
        for f in self.full_ids:
            self._release(full[f][::-1])  # tail blocks first
        for s in self.state_ids:
            self._release([b for _, b in states[s][::-1]])
        self._upto = 0
        for kind, count in self.cached.items():
            self.bytes_sum[kind] += count * self.block_bytes
        return hit * g

    def _step(self, end: int, hashes: list[int], full: dict, states: dict) -> None:
        """One scheduler step ending at unit ``end``: the blocks it needs, then what it
        caches (whole full-attention blocks, the state when it ends on a block's end)."""
        g = self.page
        idx = -(-end // g) - 1  # the block the step's last unit is in
        for s in self.state_ids:  # a new state block frees all but the last one written
            held = states[s]
            if not held or held[-1][0] != idx:
                self._release([b for _, b in held[:-1][::-1]])
                del held[:-1]
        whole = min(end // g, len(hashes))
        for f in self.full_ids:
            while len(full[f]) < idx + 1:
                full[f].append(self._take())
            for i in range(self._upto, whole):
                self._cache(full[f][i], (f, hashes[i]))
        self._upto = max(self._upto, whole)
        on_edge = end % g == 0 and idx < len(hashes)
        for s in self.state_ids:
            held = states[s]
            if not held or held[-1][0] != idx:
                held.append((idx, self._take()))
            if on_edge:
                self._cache(held[-1][1], (s, hashes[idx]))
        self.checkpoints += on_edge
