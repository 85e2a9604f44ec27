"""Record random operation sequences on SGLang's own `RadixCache`, with its results, for
`tests/differential/test_sglang_diff.py` to replay on radixkv's default cache (so CI needs
no SGLang).

Run it with the SGLang peer's interpreter (``benchmarks/peers/setup.sh sglang``):

    ~/.cache/radixkv-peers/sglang/bin/python tests/differential/data/record_sglang_ops.py

Each sequence mixes inserts (fresh slots, as an allocator hands them out), matches, locks
and unlocks of nodes from *earlier* matches and inserts (while other requests were
cached in between: the scheduler's pattern), evictions and resets, with LRU (SGLang's
default) over pages 1/2/4/16, EAGLE on and off, with and without namespaces. Keys are
built to share prefixes, extend cached leaves and branch inside nodes.

Recorded per operation: insert's prefix length; match's prefix length and slot indices;
a lock's or unlock's size delta; evict's count and the slots handed to the allocator;
after every operation, the evictable and protected sizes. A lock names a node that is
still in SGLang's tree (locking an evicted node is a caller's error there).

Output: ``tests/differential/data/sglang_ops.json.gz``. Slot lists are stored as runs
``[start, n]``.
"""

from __future__ import annotations

import gzip
import json
import random
import sys
from array import array
from pathlib import Path

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

OUT = Path(__file__).with_name("sglang_ops.json.gz")
SEQUENCES = 12  # per configuration
OPS = 90  # per sequence


class RecordingAllocator:
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.freed: list[int] = []

    def free(self, t: torch.Tensor) -> None:
        self.freed += t.tolist()

    def free_segment(self, t: torch.Tensor, start_pos: int = 0) -> None:
        self.freed += t.tolist()


def runs(slots: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for s in slots:
        if out and out[-1][0] + out[-1][1] == s:
            out[-1][1] += 1
        else:
            out.append([s, 1])
    return out


def alive(cache: RadixCache, node) -> bool:
    while node is not cache.root_node:
        parent = node.parent
        if parent is None or all(c is not node for c in parent.children.values()):
            return False
        node = parent
    return True


def record(page: int, eagle: bool, namespaces: bool, seed: int) -> dict:
    rng = random.Random(seed)
    alloc = RecordingAllocator()
    cache = RadixCache(
        CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
            page_size=page, eviction_policy="lru", is_eagle=eagle,
        )
    )  # fmt: skip
    vocab = 3 if page == 1 else 4
    unit = page  # key lengths in pages, so page 16 keys span several pages
    inserted: list[tuple[list[int], str | None]] = []
    handles: list = []  # nodes from matches and inserts, by handle number
    locked: list[int] = []  # handle numbers, one entry per lock held
    next_slot = 1000
    ops = []

    def key(toks: list[int], ns: str | None) -> RadixKey:  # fresh: SGLang flips it in place
        return RadixKey(array("q", toks), ns)

    def draw_tokens() -> tuple[list[int], str | None]:
        ns = rng.choice([None, "a", "b"]) if namespaces else None
        if inserted and rng.random() < 0.7:
            base, ns = rng.choice(inserted)
            cut = rng.randint(0, len(base))
            toks = base[:cut]
        else:
            toks = []
        tail = rng.randint(0, 3 * unit + 2)
        toks = toks + [rng.randrange(vocab) for _ in range(tail)]
        return toks, ns

    for _ in range(OPS):
        r = rng.random()
        op: dict
        if r < 0.34:
            toks, ns = draw_tokens()
            value = torch.arange(next_slot, next_slot + len(toks), dtype=torch.int64)
            next_slot += len(toks)
            res = cache.insert(InsertParams(key=key(toks, ns), value=value))
            handles.append(res.last_device_node)
            inserted.append((toks, ns))
            op = {"op": "insert", "toks": toks, "ns": ns, "slot": next_slot - len(toks),
                  "prefix_len": res.prefix_len}  # fmt: skip
        elif r < 0.62:
            toks, ns = draw_tokens()
            res = cache.match_prefix(MatchPrefixParams(key=key(toks, ns)))
            node = res.last_device_node
            handles.append(node)
            idx = cache.path_device_indices(node).tolist()
            assert len(idx) == res.device_prefix_len
            op = {"op": "match", "toks": toks, "ns": ns, "prefix_len": res.device_prefix_len,
                  "indices": runs(idx)}  # fmt: skip
        elif r < 0.76:
            live = [h for h, n in enumerate(handles) if alive(cache, n)]
            if not live:
                continue
            h = rng.choice(live[-6:] if rng.random() < 0.7 else live)
            delta = cache.inc_lock_ref(handles[h]).delta
            locked.append(h)
            op = {"op": "lock", "handle": h, "delta": delta}
        elif r < 0.88:
            if not locked:
                continue
            h = locked.pop(rng.randrange(len(locked)))
            delta = cache.dec_lock_ref(handles[h]).delta
            op = {"op": "unlock", "handle": h, "delta": delta}
        elif r < 0.985:
            n = rng.randint(0, cache.evictable_size() + page)
            before = len(alloc.freed)
            res = cache.evict(EvictParams(num_tokens=n))
            freed = sorted(alloc.freed[before:])
            op = {"op": "evict", "n": n, "evicted": res.num_tokens_evicted, "freed": runs(freed)}
        else:
            cache.reset()
            handles.clear()
            locked.clear()
            inserted.clear()
            op = {"op": "reset"}
        op["sizes"] = [cache.evictable_size(), cache.protected_size()]
        ops.append(op)
    return {"page": page, "eagle": eagle, "namespaces": namespaces, "seed": seed, "ops": ops}


def main() -> None:
    sequences = []
    seed = 0
    for page in (1, 2, 4, 16):
        for eagle in (False, True):
            for namespaces in (False, True):
                for _ in range(SEQUENCES):
                    sequences.append(record(page, eagle, namespaces, seed))
                    seed += 1
    import sglang

    doc = {"sglang": sglang.__version__, "policy": "lru", "sequences": sequences}
    OUT.write_bytes(gzip.compress(json.dumps(doc, separators=(",", ":")).encode(), mtime=0))
    n = sum(len(s["ops"]) for s in sequences)
    print(f"{len(sequences)} sequences, {n} operations -> {OUT} ({OUT.stat().st_size} bytes)",
          file=sys.stderr)  # fmt: skip


if __name__ == "__main__":
    main()
