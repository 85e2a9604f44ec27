"""Routing decisions as pure functions of what a router knows, shared by ``radixkv
route`` and the replica simulator (`radixkv.sim.replicas`).

Workers are any hashable names, listed in a fixed order (ties go to the earlier one).

Owns: the policies' arithmetic. Must not touch: state; each is a pure function of its
arguments.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Hashable, Mapping, Sequence
from typing import NamedTuple


class KeyHome(NamedTuple):
    """Where a ``prompt_cache_key`` lives (`key_home`)."""

    worker: Hashable
    spilled: bool  # past the key's first choice (that one was too loaded)


POLICIES = ("round_robin", "least_load", "approx", "kv")
# SGLang router's cache-aware defaults
APPROX_CACHE_THRESHOLD = 0.3
APPROX_BALANCE_ABS = 64
APPROX_BALANCE_REL = 1.5
# Weight on prefill blocks in the kv cost. Dynamo's default overlap_score_weight is 1.0;
# it lets one request in flight outweigh a whole cached conversation, so chats scatter
# (measured: 3 replicas, multi-turn, hit rate 0.46 at 1.0 vs 0.69 at 4.0). With the
# worker's queued prefills in the weighted term a high weight still balances (Mooncake
# conversation trace, 16 simulated replicas: hit 0.338 / 0.355 / 0.361 / 0.367 at weight
# 4 / 8 / 16 / 32, imbalance 1.04-1.08).
DYNAMO_DEFAULT_WEIGHT = 1.0
KV_OVERLAP_WEIGHT = 16.0
# What a block queued for prefill on a worker costs against one of this request's own.
# At 1 a chat's turn leaves the worker holding its history whenever another chat's first
# turn is queued there (3 replicas, multi-turn: hit 0.903-0.997x SGLang's router over 3
# runs); at 1/4 it stays (0.997x in 3 of 3) and balance holds (imbalance <= 1.29).
KV_QUEUE_SHARE = 0.25
# prompt_cache_key: a key's worker takes it while its load is within this many times the
# fleet's mean (Mirrokni, Thorup, Zadimoghaddam: consistent hashing with bounded loads).
# A spill recomputes the tenant's prefix elsewhere, so the bound is looser than the usual
# 1.25: 24 tenants in a burst over 3 replicas, 16 at a time (bench_route.py keys, 2 runs)
# got hit 0.65-0.66 with 18-20 tenants spread over 2-3 workers at 1.25, and 0.70-0.72
# with half of them on one worker at 2.0, TTFT p90 no worse, imbalance 1.17-1.21.
KEY_LOAD_SLACK = 2.0
# ... and always while it has fewer than this many in flight (an engine runs several at
# once: a tenant's short burst stays on its worker)
KEY_MIN_BOUND = 4
# kv: a conversation's next turn stays on the worker holding its history while that
# worker's load is within this many times the mean, and a cold prompt is placed by
# demand among the workers within the second bound (`RoutingCore._place`). Simulated
# (radixkv.sim.fleet, bench_route's chats over 3 replicas, StepCost(0.009, 4.5e-5,
# 6.5e-4), no wire delay, one seed): a stickiness bound of 1.5 or 2.0 moved chats off
# their history on load spikes (hit 0.821 / 0.815 against 0.850 at 65,536 tokens with a
# shared system prompt); 3.0 moved none. A placement bound of 1.5 against 2.0 at 10,240
# tokens: hit 0.074 vs 0.077 at imbalance 1.18 vs 1.27.
KV_STICK_SLACK = 3.0
KV_PLACE_SLACK = 1.5
# kv: a cold prompt goes only to a worker whose recent prefill work is within this many
# times the fleet's mean (`RoutingCore._place`). Simulated (radixkv.sim.replicas, 3
# replicas x 256k tokens, 40 kv-cache-tester sessions, seeds 1-6): 1.5 kept imbalance
# <= 1.28 with or without the workers' pools known; 1.25 let one seed reach 1.44, 1.1
# another 1.32. Mooncake at 16 / 64 replicas: imbalance 1.17 / 1.31 (1.19 / 1.44 before).
KV_WORK_SLACK = 1.5
# kv: a new conversation sharing another's prefix (a sub-agent's, or one behind a long
# common prefix) goes where that prefix is only while that worker's recent work is within
# this many times the mean. Simulated (radixkv.sim.replicas, 3 replicas x 256k tokens, 40
# kv-cache-tester sessions, seeds 1-3): with the client's 50% warm prefix, hit 0.7663 /
# 0.6405 / 0.7081 at imbalance 1.13 / 1.15 / 1.23; at 1.5 imbalance reached 1.32 / 1.36;
# at 1.0 hit fell (0.6896 at seed 3); never placing by the prefix: 0.7428 / 0.6125 /
# 0.6830 without the warm prefix (0.7574 / 0.6304 / 0.6947 at 1.25).
KV_NEAR_SLACK = 1.25


def round_robin(workers: Sequence[Hashable], turn: int) -> Hashable:
    return workers[turn % len(workers)]


def least_load(workers: Sequence[Hashable], in_flight: Mapping[Hashable, int]) -> Hashable:
    """The worker with the fewest requests in flight."""
    return min(workers, key=lambda w: in_flight.get(w, 0))


def approx(
    workers: Sequence[Hashable],
    in_flight: Mapping[Hashable, int],
    matched: Mapping[Hashable, int],
    request_len: int,
    tree_size: Mapping[Hashable, int],
) -> Hashable:
    """SGLang router's cache-aware choice: the least loaded worker when loads are
    imbalanced (max - min > 64 and max > 1.5 x min); else the worker whose tree of
    routed prompts matches the request best, if that match exceeds 0.3 of it; else the
    worker with the smallest tree."""
    loads = [in_flight.get(w, 0) for w in workers]
    hi, lo = max(loads), min(loads)
    if hi - lo > APPROX_BALANCE_ABS and hi > lo * APPROX_BALANCE_REL:
        return workers[loads.index(lo)]
    best = max(workers, key=lambda w: matched.get(w, 0))
    if request_len and matched.get(best, 0) / request_len > APPROX_CACHE_THRESHOLD:
        return best
    return min(workers, key=lambda w: tree_size.get(w, 0))


def key_home(
    workers: Sequence[Hashable],
    key: str,
    salt: str | None,
    in_flight: Mapping[Hashable, int],
    slack: float = KEY_LOAD_SLACK,
    floor: int = KEY_MIN_BOUND,
) -> KeyHome:
    """The worker a ``prompt_cache_key`` lives on: rendezvous hashing of (salt, key,
    worker) orders the workers the same way on every router and keeps a key in place
    when others come and go; the first whose load stays within ``slack`` x the fleet's
    mean (counting this request: consistent hashing with bounded loads), or under
    ``floor``, takes it.
    Returns (the worker, whether it spilled past the key's first choice)."""

    def rank(w: Hashable) -> bytes:
        text = f"{salt or ''}\0{key}\0{w}".encode()
        return hashlib.blake2b(text, digest_size=8).digest()

    order = sorted(workers, key=rank)
    for w in order:
        if within_bound(workers, w, in_flight, slack, floor):
            return KeyHome(w, w is not order[0])
    return KeyHome(order[0], False)


def within_bound(
    workers: Sequence[Hashable],
    worker: Hashable,
    in_flight: Mapping[Hashable, int],
    slack: float = KEY_LOAD_SLACK,
    floor: int = KEY_MIN_BOUND,
) -> bool:
    """Whether ``worker`` may take one more request: its load, counting it, stays within
    ``slack`` x the fleet's mean (consistent hashing with bounded loads), or under
    ``floor``."""
    total = sum(in_flight.get(w, 0) for w in workers)
    bound = max(math.ceil(slack * (total + 1) / len(workers)), floor)
    return in_flight.get(worker, 0) + 1 <= bound


def kv(
    workers: Sequence[Hashable],
    overlap_blocks: Mapping[Hashable, int],
    request_blocks: int,
    active_blocks: Mapping[Hashable, int],
    weight: float = KV_OVERLAP_WEIGHT,
    cached_blocks: Mapping[Hashable, int] | None = None,
    queued_blocks: Mapping[Hashable, float] | None = None,
    shared_blocks: int = 0,
    queue_share: float = KV_QUEUE_SHARE,
) -> Hashable:
    """Dynamo's KV router: cost = weight x (``queue_share`` x blocks the worker still has
    to prefill for requests already sent to it + this request's blocks after the
    worker's cached overlap) + blocks of the requests in flight there; the lowest cost
    wins.

    The queued prefills bring the wait a request would see into the weighted term: a
    worker holding a prefix keeps the requests that continue it until its queue costs
    more than the prefix saves; then an emptier worker (a restarted one) takes the next.

    ``shared_blocks``: the request's leading blocks that many cached prompts continue (a
    system prompt, by the index's fan-out). They are priced as held by every worker: one
    that lacks them computes them once and then serves every later prompt sharing them,
    so a shared prefix alone never pins the traffic to its first holder, while a
    conversation's own history still does. Ties (a cold prompt on idle workers, above
    all) go to the worker caching the fewest blocks, so new prefixes spread instead of
    piling onto the first worker."""
    cached = cached_blocks or {}
    queued = queued_blocks or {}

    def cost(w: Hashable) -> tuple[float, int]:
        held = max(overlap_blocks.get(w, 0), shared_blocks)
        prefill = queue_share * queued.get(w, 0) + request_blocks - held
        return (weight * prefill + active_blocks.get(w, 0), cached.get(w, 0))

    return min(workers, key=cost)
