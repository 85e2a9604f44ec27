"""The recurrent-state and sliding-window components against SGLang's own, operation
by operation.

`tests/differential/data/sglang_hybrid_ops.json.gz` holds random sequences recorded on SGLang
0.5.23's production `UnifiedRadixCache` (Rust tree core) with its FULL and MAMBA
components (`tests/differential/data/record_sglang_hybrid_ops.py`, run in the SGLang peer's venv):
inserts of a prompt's KV with a state at its end, matches, inserts of the branch point's
state that the next prefill saves, and evictions of states. Each is replayed on a
`RadixCache` with a `StateCheckpoints` component and every observable result must be
equal: the full-attention prefix an insert found, whether a state was there already,
the state hit of a match (where the recurrent layers can start), the branch point
(`plan`'s ``branch`` against SGLang's ``mamba_branching_seqlen``), and how many states
an eviction freed.

Where the two differ by design (written in docs/hybrid.md): SGLang deletes
a leaf's full-attention KV with its state when the state is evicted, radixkv keeps the
KV (other components, or a later state, can still use it). The recorder evicts states
only in a sequence's second half; after its first eviction the full-attention prefixes
(an insert's prefix, the branch point) may differ, so the replay checks from there the
state hits, whether a state existed, and which states LRU evicts (by their effect on
later hits), which both define the same way.

`tests/differential/data/sglang_swa_ops.json.gz` holds sequences recorded on the same cache with its
FULL and SWA components (`tests/differential/data/record_sglang_swa_ops.py`; window 4 on page 1,
window 6 on page 2): inserts, matches, and evictions of window KV or of full KV. Each
is replayed on a `RadixCache` with a `WindowKV` component keeping what SGLang keeps
(``retain="all"``). Equal must be: an insert's cached prefix, a match's servable prefix
(where the last ``window`` tokens' window KV is there) and its full-attention hit, and,
after every operation, what each prompt has in the cache: its full-attention prefix and
the window tombstones along it (SGLang's own ``match_full_device_prefix`` and
``swa_tombstone_ranges``), so an insert over tombstones recovers exactly what SGLang's
does. Which window KV an eviction frees is a policy (SGLang refreshes only a window
behind a match's end and deletes an LRU leaf whole; radixkv's `WindowKV.evict`
tombstones least recently used tails and keeps the full KV): the replay applies SGLang's
choice (``WindowKV.drop``, ``RadixCache.evict_leaf``) and checks that it frees as many
window and full units as SGLang reported.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from radixkv import RadixCache, RadixKey
from radixkv.kvcache.recurrent.component import StateCheckpoints
from radixkv.kvcache.window.component import WindowKV

FIXTURE = Path(__file__).parent / "data" / "sglang_hybrid_ops.json.gz"
DOC = json.loads(gzip.decompress(FIXTURE.read_bytes()))
SWA_FIXTURE = Path(__file__).parent / "data" / "sglang_swa_ops.json.gz"
SWA_DOC = json.loads(gzip.decompress(SWA_FIXTURE.read_bytes()))


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


# --- the sliding-window component ---------------------------------------------------


def along(cache: RadixCache, toks: list[int]) -> list[tuple]:
    """The nodes on ``toks``' full-attention path: (node, start, end) in tokens; the last
    may hold more than ``toks`` reaches."""
    node, pos, out = cache.root, 0, []
    while pos < len(toks):
        for child in node.children.values():
            k = list(child.key)
            n = min(len(k), len(toks) - pos)
            if n and k[:n] == toks[pos : pos + n]:
                out.append((child, pos, pos + len(k)))
                node, pos = child, pos + len(k)
                break
        else:
            break
    return out


def held(cache: RadixCache, win: WindowKV, toks: list[int]) -> list:
    """What SGLang's recorder observes for a prompt: [full prefix, window tombstones]."""
    full = cache.match_len(key(toks), full=True)
    tombs: list[list[int]] = []
    for node, start, end in along(cache, toks):
        lo, hi = start, min(end - win.covered(node), full)  # the uncovered head
        if lo >= hi:
            continue
        if tombs and tombs[-1][1] == lo:
            tombs[-1][1] = hi
        else:
            tombs.append([lo, hi])
    return [full, tombs]


def mirror(cache: RadixCache, win: WindowKV, prompts: list[list[int]], obs: list) -> None:
    """Make the cache hold what SGLang held after an eviction: remove the full KV it
    removed (whole leaves, or their tails), then tombstone the window KV it freed."""
    changed = True
    while changed:  # a leaf goes once the prompts below it are gone
        changed = False
        for toks, (full, _) in zip(prompts, obs, strict=True):
            path = along(cache, toks)
            ours = cache.match_len(key(toks), full=True)
            if ours > full and path and path[-1][2] == ours and not path[-1][0].children:
                node, start, _ = path[-1]
                cache.evict_leaf(node, ours - max(start, full))
                changed = True
    for toks, (full, tombs) in zip(prompts, obs, strict=True):
        assert cache.match_len(key(toks), full=True) == full, toks
        for lo, hi in tombs:
            for cut in (lo, hi):  # node boundaries where SGLang's tombstone starts and ends
                if cut:
                    cache.insert_node(key(toks[:cut]))
            for node, start, end in along(cache, toks):
                if start >= lo and end <= hi:
                    win.drop(node)


def replay_window(seq: dict) -> None:
    slots = Slots()
    win = WindowKV(seq["window"], slots, retain="all")
    cache = RadixCache(seq["page"], components=(win,))
    prompts: list[list[int]] = []
    obs: list = []
    fresh = 0
    for i, op in enumerate(seq["ops"]):
        where = f"seed {seq['seed']} op {i} {op['op']}"
        if op["op"] == "insert":
            toks = op["toks"]
            window = np.arange(fresh, fresh + len(toks), dtype=np.int64)
            fresh += len(toks)
            res = cache.insert_node(key(toks), extras={"window": window})
            assert res.prefix_len == op["prefix_len"], where
            if toks not in prompts:
                prompts.append(toks)
        elif op["op"] == "match":
            k = key(op["toks"])
            assert cache.match_len(k, full=True) == op["full"], where
            assert cache.match_prefix(k).prefix_len == op["prefix_len"], where
        else:
            window_before, full_before = win.held_units(), cache.total_size()
            mirror(cache, win, prompts, op.get("obs", obs))
            assert window_before - win.held_units() == op["window_evicted"], where
            assert full_before - cache.total_size() == op["full_evicted"], where
        obs = op.get("obs", obs)
        assert [held(cache, win, t) for t in prompts] == obs, where
        cache.check_integrity()
    assert slots.freed + win.held_units() <= fresh  # no window slot freed twice


@pytest.mark.parametrize(
    "seq", SWA_DOC["seqs"], ids=lambda s: f"page{s['page']}-w{s['window']}-seed{s['seed']}"
)
def test_replay_equals_sglang_unified_swa(seq):
    replay_window(seq)
