"""The request lifecycle's managers (`radixkv.kvcache.managers`): each step of a request's
life is a loop over one manager per layer spec, in a fixed order, and a manager that
is short undoes the ones before it.

The stateful machine runs all three specs at once (full attention, sliding window in
its own slot space, recurrent states with checkpoints) with a call failing midway in
any of their pools: after every operation every slot of both KV spaces and every state
row is owned once (`check_memory`), each running request reads its own tokens' KV, and
its state row holds the state after exactly its computed tokens (a restored checkpoint
included).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from support.faults import InjectedFault
from support.window_machine import WindowLifecycleMachine

from radixkv import RadixCache
from radixkv.kvcache.lifecycle import CacheManager, Req
from radixkv.kvcache.managers import LayerManager
from radixkv.kvcache.memory import TokenToKVPoolAllocator
from radixkv.kvcache.recurrent import RecurrentStates
from radixkv.kvcache.recurrent.pool import StatePool
from radixkv.kvcache.req_table import ReqToTokenPool
from radixkv.kvcache.spec import RecurrentSpec
from radixkv.kvcache.window.component import WindowKV
from radixkv.kvcache.window.slots import WindowSlots

SPEC = RecurrentSpec(1, ((1,),), torch.float64)  # one number a state: its fingerprint


def state_of(tokens) -> float:
    """The state after ``tokens``, as the machine's model computes it."""
    return float(hash(tuple(tokens)) % 2**50)


class Recorder(LayerManager):
    """A manager that records the hooks called on it (and can be short)."""

    kind = "recorder"

    def __init__(self, log: list, name: str, short: bool = False) -> None:
        self.log, self.name, self.short = log, name, short

    def _note(self, hook: str, *args) -> None:
        self.log.append((self.name, hook, *args))

    def admitted(self, req):
        self._note("admitted", req.cached_len)

    def allocate(self, reqs, rows, kv, counts):
        self._note("allocate", counts.tolist())
        return not self.short

    def unallocate(self, rows, kv, counts):
        self._note("unallocate", counts.tolist())

    def inserted(self, req, key):
        self._note("inserted", len(key))

    def cached(self, req, upto):
        self._note("cached", upto)

    def finishing(self, req):
        self._note("finishing", req.kv_len)

    def free_tail(self, req, start):
        self._note("free_tail", start)

    def release(self, req):
        self._note("release")


def lifecycle(*managers, page=4):
    alloc = TokenToKVPoolAllocator(128, page)
    return CacheManager(RadixCache(page, allocator=alloc), alloc, ReqToTokenPool(2, 64), *managers)


def test_each_step_is_a_loop_over_the_managers_in_order():
    log: list = []
    m = lifecycle(Recorder(log, "a"), Recorder(log, "b"))
    req = Req(1, list(range(10)))
    assert m.admit(req)
    assert m.allocate(req, 10) is not None
    m.cache_unfinished_req(req)
    req.output_ids.append(7)
    assert m.allocate(req, 1) is not None
    m.finishing(req)
    m.cache_finished_req(req)
    m.check_memory()
    for name in "ab":
        assert [e[1:] for e in log if e[0] == name] == [
            ("admitted", 0), ("allocate", [10]), ("inserted", 10), ("cached", 8),
            ("allocate", [1]), ("finishing", 11), ("free_tail", 8), ("cached", 11),
            ("release",),
        ]  # fmt: skip
    # a and b alternate: each step runs every manager before the next step
    assert [e[0] for e in log[:4]] == ["a", "b", "a", "b"]


def test_a_short_manager_undoes_the_ones_before_it_and_nothing_is_allocated():
    log: list = []
    m = lifecycle(Recorder(log, "a"), Recorder(log, "b", short=True), Recorder(log, "c"))
    req = Req(1, list(range(10)))
    assert m.admit(req)
    free = m.allocator.available_size()
    assert m.allocate(req, 6) is None
    assert m.allocate_batch([req], [6]) is None
    assert m.allocator.available_size() == free and req.kv_len == 0
    steps = [e for e in log if e[1] in ("allocate", "unallocate")]
    assert steps == [("a", "allocate", [6]), ("b", "allocate", [6]), ("a", "unallocate", [6])] * 2
    m.abort(req)
    m.check_memory()


def test_managers_must_be_layer_managers_and_fit_the_lifecycle():
    with pytest.raises(TypeError, match="LayerManagers"):
        lifecycle(object())
    pool = StatePool(SPEC, 1, 4)  # one running row for a table of two
    states = RecurrentStates(pool, 2)
    alloc = TokenToKVPoolAllocator(64, 1)
    cache = RadixCache(1, allocator=alloc, components=(states.component,))
    with pytest.raises(ValueError, match="running rows"):
        CacheManager(cache, alloc, ReqToTokenPool(2, 16), states)
    with pytest.raises(ValueError, match="not a component"):
        lifecycle(states, page=1)


class AllManagersMachine(WindowLifecycleMachine):
    """`WindowLifecycleMachine` with a recurrent manager beside the window's: the states
    are fingerprinted too, and faults strike any pool."""

    def manager(self, page, window, pages, wpages, mode, retain) -> CacheManager:
        wsize = max(wpages * page, 4 * (window + 3 * page) + 8)
        alloc = TokenToKVPoolAllocator(pages * page * 4, page)
        walloc = TokenToKVPoolAllocator(wsize, page)
        wkv = WindowKV(window, walloc, retain)
        self.pool = StatePool(SPEC, 4, RecurrentStates.spare_rows(4, 3))
        states = RecurrentStates(self.pool, 3)
        cache = RadixCache(page, "lru", alloc, eviction_mode=mode,
                           components=(states.component, wkv))  # fmt: skip
        slots = WindowSlots(wkv, walloc, 4, 64, window)
        return CacheManager(cache, alloc, ReqToTokenPool(4, 64), slots, states)

    def check_req(self, req: Req) -> None:
        super().check_req(req)
        if req.kv_len:  # the row's state is the state after its computed tokens
            have = float(self.pool.tensors[0][0, req.row, 0])
            assert have == state_of(req.all_ids[: req.kv_len]), f"request {req.rid}'s state"

    def run(self, plan: list[tuple[Req, int]], slots: torch.Tensor) -> None:
        """The model's step: KV for the new tokens, the states after them, and the
        snapshots the recurrent manager asked for."""
        try:
            snaps = self.m.step_inputs(plan)["states"]
        except InjectedFault:  # the step fails before the model runs: as the engine
            for req, _ in plan:  # stops, its requests are dropped (their KV is never
                self.m.abort(req)  # computed), and what they hold is freed
            raise
        for (req, _), part in zip(plan, torch.split(slots, [n for _, n in plan]), strict=True):
            self.compute(req, part)
            self.pool.tensors[0][0, req.row, 0] = state_of(req.all_ids[: req.kv_len])
        for i, before, row in snaps:
            req, n = plan[i]
            self.pool.tensors[0][0, row, 0] = state_of(req.all_ids[: req.kv_len - n + before])

    def target(self, site: str, space: str) -> tuple[object, str]:
        """Faults strike the state rows too: taking one, or copying into it."""
        if space == "states" and site not in ("match_parts", "insert_node"):
            return self.pool, "take" if site.startswith("alloc") else "copy"
        return super().target(site, space)


AllManagersMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestAllManagersMachine = AllManagersMachine.TestCase


def test_the_state_check_catches_a_wrong_restore():
    """The machine's state check is not vacuous: a row holding another prefix's state
    fails it."""
    machine = AllManagersMachine()
    machine.setup(page=1, window=4, pages=8, wpages=8, mode="precise", retain="all")
    machine.arrive(list(range(5, 17)), [])
    machine.step_all(12, None)
    req = machine.reqs[0]
    machine.check_req(req)
    machine.pool.tensors[0][0, req.row, 0] = state_of(req.all_ids[: req.kv_len - 1])
    with pytest.raises(AssertionError, match="state"):
        machine.check_req(req)
