"""SGLang 0.5.23's production prefix cache, ``UnifiedRadixCache`` with its Rust tree core
(``tree_core_backend="rust"``), on the shared workloads (a)-(d) and (f). Runs in SGLang's
own virtual environment (``benchmarks/peers/setup.sh sglang``); imports nothing from
radixkv.

    SGLANG_PEER_UNIFIED=1 ~/.cache/radixkv-peers/sglang/bin/python \
        benchmarks/adapters/sglang_rust_adapter.py

(``SGLANG_PEER_UNIFIED=1`` must be in the environment: the peer's shim loads at
interpreter start and would otherwise stub the module this cache imports.)

Its ``match_prefix`` returns lengths and node ids but no indices tensor; (d) adds
``path_device_indices`` so it does what radixkv's match does. Its ``insert`` frees the
duplicated prefix of the value itself (into a null allocator here). (e) is not run: the
production scheduler's request path around this cache is not reproduced.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

if os.environ.get("SGLANG_PEER_UNIFIED") != "1":
    sys.exit("run with SGLANG_PEER_UNIFIED=1 in the environment (see the docstring)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import time
from array import array

import torch
import workloads
from harness import adapter_main, run_suite
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang_adapter import (
    _keys,
    _values,
    chain_match,
    evict_calls,
    init_params,
    match_insert,
    memory_per_token,
)


def new_cache(page: int, allocator=None, events: bool = False) -> UnifiedRadixCache:  # type: ignore[no-untyped-def]
    cache = UnifiedRadixCache(
        init_params(
            page, allocator, tree_components=(ComponentType.FULL,), tree_core_backend="rust",
            enable_kv_cache_events=events,
        )
    )  # fmt: skip
    assert type(cache.tree_core).__name__ == "RustUnifiedTreeCore", "not the Rust core"
    return cache


class _Req:
    """What SGLang's ``Req`` carries for these calls: its row, lengths, tree lock."""

    def __init__(self, rid: int, tokens: list[int]) -> None:
        self.rid, self.prompt_len = rid, len(tokens)
        self.tokens = array("q", tokens)  # + outputs, appended as they are sampled
        self.row = self.kv_len = self.protected = 0
        self.node = self.receipt = None


def _checkpoint(cache, pool, alloc, r: _Req, page: int, finished: bool) -> None:  # type: ignore[no-untyped-def]
    """``UnifiedRadixCache.checkpoint_into_tree`` for one request, as 0.5.23 does it:
    insert the computed whole pages (the Rust core frees the duplicates past
    ``prev_prefix_len``), split at the prompt boundary once outputs exist; then, for an
    unfinished request, point the row at the tree's slots and move the lock; for a
    finished one, free the unaligned tail and release the lock and the row."""
    aligned = r.kv_len // page * page
    kv = pool.req_to_token[r.row, : r.kv_len].to(torch.int64, copy=True)
    key = RadixKey(r.tokens[:aligned])
    res = cache.insert(InsertParams(key=key, value=kv[:aligned], prev_prefix_len=r.protected))
    prompt = r.prompt_len // page * page
    if 0 < prompt < aligned:
        cache.insert(
            InsertParams(key=key[:prompt], value=kv[:prompt], prev_prefix_len=prompt,
                         inserted_len=prompt)
        )  # fmt: skip
    if finished:
        if r.kv_len > aligned:
            alloc.free(kv[aligned:])
        cache.dec_lock_ref(r.node, r.receipt.to_dec_params())
        pool.free_rows([r.row])
        return
    node = res.last_device_node
    idx = cache.path_device_indices(node)
    pool.write((r.row, slice(r.protected, len(idx))), idx[r.protected :])
    cache.dec_lock_ref(r.node, r.receipt.to_dec_params())
    r.node, r.receipt, r.protected = node, cache.inc_lock_ref(node), len(idx)


def events_cache(page: int, allocator=None) -> UnifiedRadixCache:  # type: ignore[no-untyped-def]
    return new_cache(page, allocator, events=True)


def match_insert_events(seqs, page):  # type: ignore[no-untyped-def]
    """(a)/(b) with ``enable_kv_cache_events=True``: per request match, insert, then
    ``take_events()`` (what SGLang's scheduler hands its publisher each step)."""
    keys, values = _keys(seqs), _values(seqs)
    cache = events_cache(page)
    hit = events = 0
    t0 = time.perf_counter()
    for key, value in zip(keys, values, strict=True):
        hit += cache.match_prefix(MatchPrefixParams(key=key)).device_prefix_len
        cache.insert(InsertParams(key=key, value=value))
        events += len(cache.take_events())
    dt = time.perf_counter() - t0
    assert events, "no KV events: the cache did not publish"
    return dt / len(seqs) * 1e6, {"hit_rate": hit / sum(len(s) for s in seqs)}


def scheduler_step(page: int, events: bool = False) -> tuple[float, dict]:
    """(g): the same steps as radixkv's adapter, through the calls SGLang's scheduler
    makes around this cache: per arrival ``match_prefix`` + ``path_device_indices`` +
    ``inc_lock_ref``; rows from ``ReqToTokenPool.alloc_rows``; one
    ``PagedTokenToKVPoolAllocator.alloc_extend`` for the chunks (its CPU path) and the
    CPU row writes of ``write_cache_indices``; one ``alloc_decode`` and one row write
    for the decodes; after the forward, ``checkpoint_into_tree`` per chunk and per
    finish, the finishes' frees in one free group."""
    prompts, outputs = workloads.scheduler_steps()
    alloc = PagedTokenToKVPoolAllocator(1 << 21, page, torch.int64, "cpu", None, False)
    cache = new_cache(page, alloc, events)
    rows = workloads.STEP_PHASES * workloads.STEP_ADMITS
    pool = ReqToTokenPool(rows, max(map(len, prompts)) + len(outputs[0]) + page, "cpu", False)
    reqs = [_Req(i, s) for i, s in enumerate(prompts)]
    hit, total, timed = 0, 0.0, 0
    gc.collect()  # the setup's garbage is not the steps' (else a full collection, ~0.1 s
    # in a process that imported torch, lands in the timed steps or not by chance)
    for steady, new, second, decode, finish in workloads.step_batches(reqs):
        t0 = time.perf_counter()
        prefixes = []
        for r in new:  # admission
            m = cache.match_prefix(MatchPrefixParams(key=RadixKey(r.tokens[: r.prompt_len - 1])))
            node = m.last_device_node
            prefix = (
                cache.path_device_indices(node)[: m.device_prefix_len]
                if m.device_prefix_len
                else torch.empty(0, dtype=torch.int64)
            )
            r.node, r.receipt = node, cache.inc_lock_ref(node)
            r.kv_len = r.protected = len(prefix)
            hit += len(prefix)
            prefixes.append(prefix)
        for r, row in zip(new, pool.alloc_rows(len(new)), strict=True):
            r.row = row
        ext = new + second  # one extend batch: first and second chunks
        pre = [r.kv_len for r in ext]
        seq = [r.kv_len + -(-(r.prompt_len - r.kv_len) // 2) for r in new]
        seq += [r.prompt_len for r in second]
        last = [p[-1:] if len(p) else torch.full((1,), -1) for p in prefixes]
        last += [pool.req_to_token[r.row, r.kv_len - 1 : r.kv_len].long() for r in second]
        pre_t, seq_t = torch.tensor(pre), torch.tensor(seq)
        n_ext = sum(seq) - sum(pre)
        out = alloc.alloc_extend(pre_t, pre_t, seq_t, seq_t, torch.cat(last), n_ext)
        if out is None:
            raise RuntimeError("pool too small")
        pt = 0
        for i, r in enumerate(ext):  # write_cache_indices, CPU branch
            if i < len(new):
                pool.write((r.row, slice(0, pre[i])), prefixes[i])
            pool.write((r.row, slice(pre[i], seq[i])), out[pt : pt + seq[i] - pre[i]])
            pt += seq[i] - pre[i]
            r.kv_len = seq[i]
        if decode:  # alloc_for_decode
            rows_t = torch.tensor([r.row for r in decode])
            seq_d = torch.tensor([r.kv_len + 1 for r in decode])
            last_d = pool.req_to_token[rows_t, seq_d - 2].long()
            loc = alloc.alloc_decode(seq_d, seq_d, last_d)
            pool.write((rows_t, seq_d - 1), loc.to(torch.int32))
            for r in decode:
                r.kv_len += 1
        # (the forward pass runs here) then the sampled tokens come back
        for r in second + decode:
            r.tokens.append(outputs[r.rid][len(r.tokens) - r.prompt_len])
        for r in ext:
            _checkpoint(cache, pool, alloc, r, page, finished=False)
        alloc.free_group_begin()
        for r in finish:
            _checkpoint(cache, pool, alloc, r, page, finished=True)
        alloc.free_group_end()
        if events:
            cache.take_events()  # the step's events, as the scheduler publishes them
        if steady:
            total += time.perf_counter() - t0
            timed += 1
    return total / timed * 1e6, {"hit_rate": hit / sum(map(len, prompts))}


def run(wl: list[str], pages: list[int], repeats: int) -> list[dict]:
    a, b = workloads.shared_system_prompt(), workloads.multi_turn_chat()
    per_page = {
        "a": lambda p: match_insert(a, p, new_cache),
        "b": lambda p: match_insert(b, p, new_cache),
        "c": lambda p: evict_calls(p, new_cache),
        # its match builds no indices tensor: add it, to do what radixkv's match does
        "d": lambda p: chain_match(p, make=new_cache, indices=True),
        "g": scheduler_step,
    }
    with_events = {
        "a": lambda p: match_insert_events(a, p),
        "b": lambda p: match_insert_events(b, p),
        "g": lambda p: scheduler_step(p, events=True),
    }
    wl = [w for w in wl if w != "e"]
    return run_suite(
        wl, pages, repeats, per_page, None, lambda: memory_per_token(new_cache), with_events
    )


if __name__ == "__main__":
    adapter_main("sglang_rust", run)
