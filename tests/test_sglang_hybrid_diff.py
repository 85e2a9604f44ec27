"""The recurrent-state component against SGLang's own, operation by operation.

`tests/data/sglang_hybrid_ops.json.gz` holds random sequences recorded on SGLang
0.5.23's production `UnifiedRadixCache` (Rust tree core) with its FULL and MAMBA
components (`tests/data/record_sglang_hybrid_ops.py`, run in the SGLang peer's venv):
inserts of a prompt's KV with a state at its end, matches, inserts of the branch point's
state that the next prefill saves, and evictions of states. Each is replayed on a
`RadixCache` with a `StateCheckpoints` component and every observable result must be
equal: the full-attention prefix an insert found, whether a state was there already,
the state hit of a match (where the recurrent layers can start), the branch point
(`plan`'s ``branch`` against SGLang's ``mamba_branching_seqlen``), and how many states
an eviction freed.

Where the two differ by design (written in the README's hybrid section): SGLang deletes
a leaf's full-attention KV with its state when the state is evicted, radixkv keeps the
KV (other components, or a later state, can still use it). The recorder evicts states
only in a sequence's second half; after its first eviction the full-attention prefixes
(an insert's prefix, the branch point) may differ, so the replay checks from there the
state hits, whether a state existed, and which states LRU evicts (by their effect on
later hits), which both define the same way.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from radixkv import RadixCache, RadixKey
from radixkv.tree.state import StateCheckpoints

FIXTURE = Path(__file__).parent / "data" / "sglang_hybrid_ops.json.gz"
DOC = json.loads(gzip.decompress(FIXTURE.read_bytes()))


class Slots:
    def __init__(self) -> None:
        self.next, self.freed = 0, 0

    def take(self) -> int:
        self.next += 1
        return self.next - 1

    def free(self, slots) -> None:
        self.freed += len(slots)


def key(toks: list[int]) -> RadixKey:
    return RadixKey(np.asarray(toks, dtype=np.int64))


def replay(seq: dict) -> None:
    slots = Slots()
    state = StateCheckpoints(1 << 20, slots)
    cache = RadixCache(seq["page"], components=(state,))
    diverged = False  # SGLang dropped a leaf's full KV with its state
    for i, op in enumerate(seq["ops"]):
        where = f"seed {seq['seed']} op {i} {op['op']}"
        if op["op"] == "insert":
            res = cache.insert_node(key(op["toks"]))
            if not diverged:
                assert res.prefix_len == op["prefix_len"], where
            added = state.add(res.last_node, slots.take())
            assert added != op["exists"], where
        elif op["op"] == "match":
            k = key(op["toks"])
            full = cache.match_len(k, full=True)
            m = cache.match_prefix(k)
            assert m.prefix_len == op["prefix_len"], where
            if m.prefix_len:
                assert state.used(m.last_node) is not None, where
            if not diverged:
                branch = [
                    p
                    for p, kind in state.plan(len(k), full, m.prefix_len, prompt_end=False)
                    if kind == "branch"
                ]
                assert branch == ([op["branch"]] if op["branch"] is not None else []), where
        else:
            assert op["op"] == "evict_states", where
            before = len(state.held)
            assert state.evict(op["n"]) == op["evicted"], where
            assert len(state.held) == before - op["evicted"], where
            diverged = True
        cache.check_integrity()
    # every evicted state's slot went back to the pool, and no other
    assert slots.freed == sum(op["evicted"] for op in seq["ops"] if op["op"] == "evict_states")


@pytest.mark.parametrize("seq", DOC["seqs"], ids=lambda s: f"page{s['page']}-seed{s['seed']}")
def test_replay_equals_sglang_unified_mamba(seq):
    replay(seq)
