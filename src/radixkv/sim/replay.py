"""Replay a trace through the real `RadixCache` and measure what prefix caching saves.

Per request, as an engine does it: look up the prompt's units (a hit), lock the hit,
evict just enough to fit the new units, insert the prompt (and the output, when outputs
are cached), unlock. Capacity is in units (blocks); ``None`` means unbounded.

Policies: every policy of `radixkv.tree.policy`, plus ``belady`` (offline optimal: evict the
unit whose next use lies farthest in the future). Because a unit id stands for its whole
prefix, a child's next use is never earlier than its parent's, so the farthest unit is
always at a leaf's tail and leaf-first eviction loses nothing.

Owns: one replay's measurements. Must not touch: the cache's internals (it uses the
public API).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from radixkv.key import RadixKey
from radixkv.sim.traces import SimRequest, Trace
from radixkv.tree import RadixCache, TreeNode
from radixkv.tree.policy import POLICIES


class Served(NamedTuple):
    """One request through a simulated cache (`serve_request`)."""

    hit: int  # prompt units served from the cache
    evicted: int  # units evicted to make room


# and the session-aware order (`radixkv.sim.sessions`), for agentic traces: named, not in "all"
SESSION = "session"
POLICY_NAMES = (*(p for p in POLICIES if p != SESSION), "belady")
BLOCK_POLICIES = ("lru", "fifo")
SCOPES = ("tree", "block")


@dataclass
class SimResult:
    """What one replay measured (hit rates over the requests after the warm-up)."""

    trace: str
    policy: str
    capacity_units: int | None
    capacity_tokens: int | None
    requests: int
    prompt_tokens: int
    hit_tokens: int
    token_hit_rate: float
    request_hit_rate: float
    block_hit_rate: float
    evicted_units: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Belady:
    """Sort key 'minus the next use of the node's last unit'; ``now`` must be the index
    of the request being replayed, set before it touches the cache."""

    def __init__(self, trace: Trace) -> None:
        self.uses: dict[int, list[int]] = defaultdict(list)
        for t, req in enumerate(trace.requests):
            for u in req.units[: req.num_prompt_units]:
                self.uses[u].append(t)
        self.ptr: dict[int, int] = defaultdict(int)
        self.never = len(trace.requests) + 1
        self.now = -1

    def next_use(self, unit: int) -> int:
        occ = self.uses.get(unit)
        if not occ:
            return self.never
        i = self.ptr[unit]
        while i < len(occ) and occ[i] <= self.now:
            i += 1
        self.ptr[unit] = i
        return occ[i] if i < len(occ) else self.never

    def key(self, node: TreeNode) -> tuple[int, int]:
        last = int.from_bytes(node.key_bytes[-8:], "little", signed=True)
        return (-self.next_use(last), node.id)


def simulate(
    trace: Trace,
    capacity_units: int | None,
    policy: str = "lru",
    cache_outputs: bool = False,
    warmup: float = 0.0,
    check_every: int = 0,
    scope: str = "tree",
) -> SimResult:
    """Replay ``trace`` once.

    Args:
        capacity_units: cache size in units (blocks); ``None`` for unbounded.
        policy: a name from ``POLICY_NAMES`` (``BLOCK_POLICIES`` for block scope).
        cache_outputs: insert prompt + output when a request finishes (engines do).
        warmup: fraction of the first requests left out of the reported rates.
        check_every: run ``check_integrity`` every this many requests (0: never).
        scope: ``tree`` evicts leaves only, as a radix cache does; ``block`` evicts any
            block, as a hash-based block pool (vLLM) does, even a prefix's head block
            while the rest stays cached (unreachable until the head returns).
    """
    if scope not in SCOPES:
        raise ValueError(f"unknown scope {scope!r}; valid: {', '.join(SCOPES)}")
    valid = (*POLICY_NAMES, SESSION) if scope == "tree" else BLOCK_POLICIES
    if policy not in valid:
        raise ValueError(f"unknown policy {policy!r} for {scope} scope; valid: {', '.join(valid)}")
    if capacity_units is not None and capacity_units < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity_units}")
    if not 0.0 <= warmup < 1.0:
        raise ValueError(f"warmup must be in [0, 1), got {warmup}")
    if scope == "block":
        return _simulate_blocks(trace, capacity_units, policy, cache_outputs, warmup)
    belady = _Belady(trace) if policy == "belady" else None
    sessions = None
    if policy == SESSION:
        from radixkv.sim.sessions import SessionOrder

        sessions = SessionOrder()
    sort_key: str | Callable = belady.key if belady else "lru" if sessions else policy
    # the engine's cache: precise eviction, chains merged under LRU (see radixkv.tree)
    cache = RadixCache(
        page_size=1, eviction_policy=sort_key, precise=True,
        merge_chains=sort_key == "lru" and sessions is None,  # (its leaves end where used)
    )  # fmt: skip
    tally, evicted = _Tally(trace, warmup), 0
    for t, req in enumerate(trace.requests):
        if belady:
            belady.now = t
        if sessions is not None:
            sessions.arrive(req)
        evict = (lambda n: sessions.evict(cache, n)) if sessions is not None else None
        hit, freed = serve_request(cache, req, capacity_units, cache_outputs, evict)
        evicted += freed
        if check_every and t % check_every == 0:
            cache.check_integrity()
        tally.add(t, req, hit)
    return tally.result(policy, capacity_units, evicted)


def serve_request(
    cache: RadixCache, req: SimRequest, capacity_units: int | None, cache_outputs: bool,
    evict: Callable[[int], int] | None = None,
) -> Served:  # fmt: skip
    """One request through a cache of ``capacity_units`` (``None``: unbounded): match
    its prompt, then cache it (evicting what does not fit: ``evict(units)``, the cache's
    own order by default). Returns (prompt units hit, units evicted)."""
    prompt = RadixKey(array("q", req.units[: req.num_prompt_units]))
    hit = cache.match_prefix(prompt)
    units = req.units if cache_outputs else req.units[: req.num_prompt_units]
    evicted = 0
    if capacity_units is None:
        cache.insert(RadixKey(array("q", units)))
        return Served(hit.prefix_len, 0)
    cache.inc_lock_ref(hit.last_node)
    need = len(units) - hit.prefix_len
    over = cache.total_size() + need - capacity_units
    if over > 0:
        evicted = (evict or cache.evict)(over)
    room = capacity_units - cache.total_size()
    if need > room:  # the request alone overflows what is left: keep its head
        units = units[: hit.prefix_len + max(room, 0)]
    if len(units) > hit.prefix_len:
        cache.insert(RadixKey(array("q", units)))
    cache.dec_lock_ref(hit.last_node)
    return Served(hit.prefix_len, evicted)


class _Tally:
    """Hit accounting over the requests after the warm-up, shared by both scopes."""

    def __init__(self, trace: Trace, warmup: float) -> None:
        self.trace, self.first = trace, int(len(trace.requests) * warmup)
        self.hit_tokens = self.prompt_tokens = self.hit_units = self.prompt_units = 0
        self.rates: list[float] = []

    def add(self, t: int, req: SimRequest, hit_units: int) -> None:
        if t < self.first:
            return
        h = self.trace.hit_tokens(req, hit_units)
        self.hit_tokens += h
        self.prompt_tokens += req.prompt_tokens
        self.hit_units += hit_units
        self.prompt_units += req.num_prompt_units
        self.rates.append(h / req.prompt_tokens if req.prompt_tokens else 0.0)

    def result(self, policy: str, capacity_units: int | None, evicted: int) -> SimResult:
        n = len(self.rates)
        return SimResult(
            trace=self.trace.name,
            policy=policy,
            capacity_units=capacity_units,
            capacity_tokens=None
            if capacity_units is None
            else capacity_units * self.trace.block_size,
            requests=n,
            prompt_tokens=self.prompt_tokens,
            hit_tokens=self.hit_tokens,
            token_hit_rate=self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            request_hit_rate=sum(self.rates) / n if n else 0.0,
            block_hit_rate=self.hit_units / self.prompt_units if self.prompt_units else 0.0,
            evicted_units=evicted,
        )


def reuse_ceiling(trace: Trace, cache_outputs: bool = False) -> float:
    """Token hit rate with unbounded capacity, computed without the tree: a unit hits
    when some earlier request carried it (a unit id names its whole prefix)."""
    seen: set[int] = set()
    hit = total = 0
    for req in trace.requests:
        n = 0
        for u in req.units[: req.num_prompt_units]:
            if u not in seen:
                break
            n += 1
        hit += trace.hit_tokens(req, n)
        total += req.prompt_tokens
        seen.update(req.units if cache_outputs else req.units[: req.num_prompt_units])
    return hit / total if total else 0.0


def _simulate_blocks(
    trace: Trace, capacity_units: int | None, policy: str, cache_outputs: bool, warmup: float
) -> SimResult:
    """Block scope: one flat ordered set of blocks. A hit is the leading run of the
    prompt's blocks that are cached. ``lru`` refreshes a request's blocks tail first, so
    its head blocks are the most recent (vLLM frees blocks in that order); ``fifo`` keeps
    insertion order and never refreshes. New blocks are added in order, each evicting the
    oldest block when the cache is full."""
    cache: OrderedDict[int, None] = OrderedDict()
    lru = policy == "lru"
    tally, evicted = _Tally(trace, warmup), 0
    for t, req in enumerate(trace.requests):
        prompt = req.units[: req.num_prompt_units]
        hit = 0
        for u in prompt:
            if u not in cache:
                break
            hit += 1
        units = req.units if cache_outputs else prompt
        for u in units if not lru else reversed(units):
            if u in cache:
                if lru:
                    cache.move_to_end(u)
            else:
                cache[u] = None
                if capacity_units is not None and len(cache) > capacity_units:
                    cache.popitem(last=False)
                    evicted += 1
        tally.add(t, req, hit)
    return tally.result(policy, capacity_units, evicted)
