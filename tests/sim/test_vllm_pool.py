"""The hybrid simulator's ``vllm`` row for a recurrent model (`radixkv.sim.vllm_pool`):
vLLM's block pool rules, each on a trace small enough to count by hand. Its equality with
vLLM's own manager is `tests/differential/test_peer_vllm_hybrid.py` (needs the peer)."""

from __future__ import annotations

import pytest
from support.traces import marconi_chats

from radixkv.sim.hybrid import ModelSpec, simulate_hybrid
from radixkv.sim.traces import SimRequest, Trace, load_trace
from radixkv.sim.vllm_pool import VllmAlignPool

# one full-attention layer, one recurrent layer whose state fills a page: blocks of
# G = 16 tokens (vLLM's kernel block, `ModelSpec.vllm_block`), a block id one page
SPEC = ModelSpec("tiny", full_layers=1, kv_bytes=16, recurrent_layers=1, state_bytes=256)
G = 16
BLOCK = G * 16


def toks(blocks: float, start: int = 0) -> list[int]:
    return list(range(start, start + int(blocks * G)))


def req(units: list[int], outputs: int = 0) -> SimRequest:
    n = len(units) - outputs
    return SimRequest(units=units, num_prompt_units=n, prompt_tokens=n, output_tokens=outputs)


def pool(blocks: int) -> VllmAlignPool:
    assert SPEC.vllm_block() == G
    return VllmAlignPool(Trace("t", 1), SPEC, blocks * BLOCK)


def test_a_hit_needs_a_state_where_it_ends_and_stops_before_the_last_token():
    p = pool(100)
    assert p.serve(req(toks(2.5)), False) == 0
    # the first request's state sits at 2 blocks (its first chunk's end): resume there
    assert p.serve(req(toks(3)), False) == 2 * G
    # the same 3 blocks again: all cached with a state at the end, but the last token is
    # always computed, so the hit is the block before
    assert p.serve(req(toks(3)), False) == 2 * G
    # the full-attention blocks match 1 block of this one, but no state is there
    assert p.cached_prefix(req(toks(1) + toks(2, 900))) == 0


def test_a_prefix_computed_again_is_cached_twice():
    """Two chats behind one system prompt with no state at its end: the second computes
    the prompt again, and both copies stay cached (vLLM keeps every block of a hash)."""
    p = pool(100)
    system = toks(2, 100)
    p.serve(req(system + toks(1, 1000)), False)
    assert p.cached["full"] == 3
    assert p.serve(req(system + toks(1, 2000)), False) == 0
    assert p.cached["full"] == 6  # the system prompt's two blocks, twice
    assert p.cached["states"] == 2


def test_eviction_takes_the_free_queues_head_tail_blocks_first():
    """A request's blocks go back tail first, so the next one's new blocks take its tail
    before its head: what is left cached is a prefix that still hits."""
    p = pool(9)  # 8 usable: the first takes 5 full blocks and 2 state blocks
    first = toks(4)
    assert p.serve(req(first + [99]), False) == 0
    assert p.free_blocks() == 8 and p.cached == {"full": 4, "states": 1}
    # a stranger of 2 blocks and a token takes 3 full blocks and 2 state blocks from the
    # free head: the 2 uncached blocks and the one never used, then the first's tail
    p.serve(req(toks(2, 5000) + [1]), False)
    hashes = p._hashes(first, len(first))
    kept = [i for i in range(4) if p._one((0, hashes[i])) is not None]
    assert kept == [0, 1]  # its head survives, and still hits as far as a state is:
    assert p.cached_prefix(req(first + [99])) == 0  # none (its state was at block 4)


def test_a_request_the_pool_cannot_hold_is_refused_and_leaks_nothing():
    p = pool(4)
    assert p.serve(req(toks(10)), False) == 0
    assert p.refused == 1
    assert p.free_blocks() == 3 and not p.ref  # every block back, none held
    row = simulate_hybrid(Trace("t", 1, [req(toks(10))]), SPEC, 4 * BLOCK, "vllm")
    assert row.refused == 1


@pytest.mark.parametrize("outputs", [True, False])
def test_with_room_for_everything_it_hits_where_the_tree_row_did(tmp_path, outputs):
    """No eviction, so duplicates and the queue's order cannot matter: the hits are the
    tree row's (states at the first chunk's end and at each decode block)."""
    from radixkv.sim import hybrid

    trace = load_trace(str(marconi_chats(tmp_path / "chats.jsonl", sessions=12)), "marconi", 1)
    spec = ModelSpec("small", full_layers=4, kv_bytes=16384, recurrent_layers=24,
                     state_bytes=1116160)  # fmt: skip
    cap = 10**12
    pool_row = VllmAlignPool(trace, spec, cap)
    tree_row = hybrid._Sim(trace, spec, cap, "vllm")
    for r in trace.requests:
        assert pool_row.serve(r, outputs) == tree_row.serve(r, outputs)


def test_a_partial_last_unit_is_never_cached_nor_a_state_in_it():
    """Traces in blocks (Mooncake's 512 tokens a unit) end on a part of one: vLLM caches
    whole blocks only, so the next turn resumes from the last whole one."""
    p = VllmAlignPool(Trace("t", G), SPEC, 100 * BLOCK)  # a unit = a block = G tokens
    first = SimRequest(units=[1, 2, 3], num_prompt_units=3, prompt_tokens=2 * G + 8)
    assert p.serve(first, False) == 0
    assert p.cached == {"full": 2, "states": 1}  # 2 whole blocks, the state at their end
    second = SimRequest(units=[1, 2, 4, 5], num_prompt_units=4, prompt_tokens=3 * G + 8)
    assert p.serve(second, False) == 2
