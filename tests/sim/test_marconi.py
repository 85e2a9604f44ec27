"""Marconi's own policies (`radixkv.sim.marconi`): the tree stays a tree whose counted
bytes are its nodes' and tokens', under random requests; and each policy's rules, on
requests small enough to follow by hand. (That the rows equal Marconi's published
results on its trace is `benchmarks/bench_marconi.py`'s check: the trace is not here.)"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.sim.marconi import ALPHAS, POLICIES, Flops, MarconiCache

FLOPS = Flops(d=64.0, n=8.0, ssm=3, attn=1, mlp=4)
STATE, TOKEN = 1000, 10  # bytes: a state, a token's KV


def cache(policy: str, capacity: float, **kw) -> MarconiCache:
    return MarconiCache(policy, capacity, STATE, TOKEN, FLOPS, **kw)


def seq(*parts: list[int]) -> np.ndarray:
    return np.asarray([t for p in parts for t in p], dtype=np.int64)


def serve(c: MarconiCache, inp: np.ndarray, out: np.ndarray | None = None) -> int:
    hit = c.lookup(inp)
    c.insert(inp if out is None else np.concatenate((inp, out)), len(inp))
    return hit


def check(c: MarconiCache) -> None:
    """The counters equal a recount, and every node is where its key says."""
    nodes = c._preorder()
    assert c.nodes == len(nodes) - 1
    assert c.tokens == sum(len(n.key) for n in nodes)
    for n in nodes[1:]:
        assert n.parent is not None and n in n.parent.children.values()
        if c.policy == "vllm+":
            assert len(n.key) <= c.block and (not n.children or len(n.key) == c.block)
        else:
            assert n.parent.children[int(n.key[0])] is n
            assert n.end == n.parent.end + len(n.key)


@settings(max_examples=60, deadline=None)
@given(
    policy=st.sampled_from(POLICIES),
    capacity=st.integers(1_000, 40_000),
    reqs=st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=30),
                            st.lists(st.integers(0, 2), max_size=8)),
                  min_size=1, max_size=25),
)  # fmt: skip
def test_the_tree_and_its_counted_bytes_stay_true(policy, capacity, reqs):
    c = cache(policy, capacity, block=4)
    for inp, out in reqs:
        hit = serve(c, np.asarray(inp, dtype=np.int64), np.asarray(out, dtype=np.int64))
        assert 0 <= hit <= len(inp)
        check(c)
    assert len(c.hits) == len(reqs)


def test_sglang_plus_evicts_the_least_recently_used_leaf():
    a, b, d = seq([1] * 20), seq([2] * 20), seq([3] * 20)
    c = cache("sglang+", capacity=2 * (STATE + 20 * TOKEN))  # two sequences fit
    assert serve(c, a) == 0 and serve(c, b) == 0
    assert serve(c, a) == 20  # a touched: b is the least recently used
    serve(c, d)  # no room: b goes
    assert c.lookup(b) == 0 and c.lookup(a) == 20


def test_vllm_plus_reuses_whole_blocks_and_a_partial_block_held_exactly():
    c = cache("vllm+", capacity=1e9, block=4)
    serve(c, seq(range(10)))  # blocks [0:4], [4:8] and the partial [8:10]
    assert c.nodes == 3  # a state in each block
    assert c.lookup(seq(range(10))) == 10
    assert c.lookup(seq(range(9))) == 8  # no node holds [8:9] alone
    assert c.lookup(seq(range(12))) == 10  # [8:10] is held whole, then nothing
    serve(c, seq(range(10), [50, 51]))  # fills the partial block: [8:12] re-keyed
    assert c.nodes == 3 and c.lookup(seq(range(10), [50, 51])) == 12


def test_marconi_touches_only_the_deepest_reused_node_and_drops_inner_states():
    c = cache("marconi", capacity=1e9)
    serve(c, seq([7] * 10, [1] * 5))
    serve(c, seq([7] * 10, [2] * 5))  # a branch point after the ten 7s: a node
    assert c.nodes == 3 and c.lookup(seq([7] * 10, [3])) == 10
    branch = c.root.children[7]
    leaves = list(branch.children.values())
    assert branch.ts == c.clock and max(n.ts for n in leaves) < c.clock
    c.capacity = c.held() - 1  # one state must go: the cheapest is a leaf's or the branch's
    c._evict(1)
    check(c)
    assert c.nodes == 2


def test_marconi_tunes_alpha_once_from_the_grid():
    rng = np.random.default_rng(0)
    systems = [rng.integers(0, 1000, 60) for _ in range(3)]
    c = cache("marconi", capacity=8 * STATE + 600 * TOKEN)
    for i in range(120):
        inp = np.concatenate((systems[i % 3], rng.integers(0, 1000, int(rng.integers(5, 40)))))
        serve(c, inp, rng.integers(0, 1000, 10))
    assert c.window_size is not None and c.window_size < 120
    assert c.alpha_tuned in ALPHAS and c.alpha == c.alpha_tuned
    assert not c.window  # tuned once: the window is not kept after


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown 'lru'"):
        cache("lru", 1e9)
