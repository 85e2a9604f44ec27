"""One arena for every kind of cache memory (`radixkv.kvcache.arena`): full-attention KV
pages, sliding-window KV pages and recurrent-state checkpoints draw units from one byte
budget (`EngineConfig.cache_bytes`).

Checked here: the arena's units against a brute-force model under random allocations
and frees of all three kinds; its KV views against the separate `KVPool`; the request
lifecycle with both slot spaces in one arena under pressure and calls failing midway
(the window lifecycle's fuzzer, with the arena's invariant after every step); the engine
on a Qwen3.5-like and a Gemma-3-like tiny model, whose outputs equal those of the
separate pools (and transformers') under pressure that evicts every kind; the budget's
refusals; SGLang's fixed split of the same bytes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant
from support.models import folder, greedy, prompts
from support.window_machine import WindowLifecycleMachine

from radixkv import RadixCache
from radixkv.engine.engine import Engine, EngineConfig, SamplingParams
from radixkv.kvcache.arena import Arena, ArenaCheckpoints, ArenaKV, ArenaPages, ArenaRoom
from radixkv.kvcache.budget import HybridBudget
from radixkv.kvcache.lifecycle import CacheManager
from radixkv.kvcache.memory import KVPool, TokenToKVPoolAllocator
from radixkv.kvcache.req_table import ReqToTokenPool
from radixkv.kvcache.window.component import WindowKV
from radixkv.kvcache.window.slots import WindowSlots

GEMMA = ("Gemma3ForCausalLM", {"head_dim": 16, "query_pre_attn_scalar": 12, "sliding_window": 10,
                               "layer_types": ["sliding_attention", "full_attention"]})  # fmt: skip


# --- units and pages -----------------------------------------------------------------------
def test_units_are_taken_and_given_back_once():
    a = Arena(8, 16)
    x = a.take(3, "full")
    assert x.tolist() == [0, 1, 2] and a.free_units() == 5 and a.held["full"] == 3
    assert a.take(6, "states") is None and a.free_units() == 5  # never a partial result
    with pytest.raises(ValueError, match="not held by it"):
        a.push(x, "window")  # another kind's units
    with pytest.raises(ValueError, match="twice"):
        a.push(np.array([0, 0]), "full")
    assert a.free_units() == 5 and a.held["full"] == 3  # a refused call changed nothing
    a.push(x, "full")
    a.check({"full": [], "window": [], "states": []})
    with pytest.raises(AssertionError, match="lost"):
        a.take(1, "full")
        a.check({"full": [], "window": [], "states": []})


ops = st.lists(
    st.tuples(st.sampled_from(["full", "window", "state", "free", "free_state"]),
              st.integers(1, 9), st.integers(0, 1000)),
    max_size=60,
)  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(ops, st.sampled_from([1, 4]), st.integers(1, 3), st.integers(1, 3), st.integers(12, 40))
def test_three_kinds_share_the_units_as_a_brute_force_model_says(ops, page, fc, wc, units):
    """Two allocators (pages of ``fc`` and ``wc`` units) and a checkpoint store draw
    from one arena: an allocation succeeds exactly when the model says the units are
    there; after every call each unit is free or held once, by the kind that says so."""
    arena = Arena(units, 64)
    full = TokenToKVPoolAllocator(units * page, page, pages=ArenaPages(arena, "full", fc))
    win = TokenToKVPoolAllocator(units * page, page, pages=ArenaPages(arena, "window", wc))
    store = ArenaCheckpoints(arena, 100)  # 2 units each
    held: dict[str, list] = {"full": [], "window": []}
    for op, n, pick in ops:
        free = arena.free_units()
        if op in held:
            alloc, cols = (full, fc) if op == "full" else (win, wc)
            got = alloc.alloc(n)
            assert (got is not None) == (-(-n // page) * cols <= free)
            if got is not None:
                held[op].append(got)
        elif op == "state":
            cid = store.store(torch.arange(100, dtype=torch.uint8))
            assert (cid is not None) == (free >= 2)
        elif op == "free_state" and store.held_ids:
            cid = store.held_ids[pick % len(store.held_ids)]
            assert store.load(cid).tolist() == list(range(100))  # what was stored
            store.give([cid])
        elif op == "free" and (held["full"] or held["window"]):
            kind = "full" if held["full"] and (pick % 2 or not held["window"]) else "window"
            (full if kind == "full" else win).free(held[kind].pop(pick % len(held[kind])))
        full.check()
        win.check()
        arena.check({"full": [full.source.units()], "window": [win.source.units()],
                     "states": store.units()})  # fmt: skip
        pages = {k: sum(-(-len(x) // page) for x in v) for k, v in held.items()}
        assert arena.held == {"full": pages["full"] * fc, "window": pages["window"] * wc,
                              "states": 2 * len(store.held_ids)}  # fmt: skip
        assert full.available_size() == arena.free_units() // fc * page


@pytest.mark.parametrize("page", [1, 4])
def test_arena_kv_reads_what_the_separate_pool_reads(page):
    """Layers of two kinds, three units a full page (group 1): every layer's K and V,
    written at random slots, read back as a `KVPool` of the same slots reads them."""
    layers, wl, heads, dim = 5, (1, 3), 2, 4
    unit = page * 2 * heads * dim * 4
    arena = Arena(64, unit)
    fp, wp = ArenaPages(arena, "full", 3), ArenaPages(arena, "window", 2)
    full = TokenToKVPoolAllocator(64 * page, page, pages=fp)
    win = TokenToKVPoolAllocator(64 * page, page, pages=wp)
    kv = ArenaKV(arena, layers, heads, dim, torch.float32, page, 1, fp, wp, wl)
    ref = KVPool(layers, heads, dim, 64 * page, torch.float32, "cpu", wl, 64 * page)
    assert kv.bytes_per_token() == ref.bytes_per_token() == 3 * 2 * heads * dim * 4
    g = torch.Generator().manual_seed(0)
    fs, ws = full.alloc(7 * page - 1), win.alloc(5 * page)
    for layer in range(layers):
        slots = ws if layer in wl else fs
        k, v = torch.randn(2, len(slots), heads, dim, generator=g)
        kv.write(layer, slots, k, v)
        ref.write(layer, slots, k, v)
    for layer in range(layers):
        slots = ws if layer in wl else fs
        pick = slots[torch.randperm(len(slots), generator=g)]
        for a, b in zip(kv.read(layer, pick), ref.read(layer, pick), strict=True):
            assert torch.equal(a, b)


# --- the lifecycle with one arena, under pressure and faults ----------------------------------
class ArenaLifecycleMachine(WindowLifecycleMachine):
    """The window lifecycle's fuzzer (fingerprinted reads, calls failing midway) with
    both slot spaces in one arena: a short kind frees the other's units through the
    budget. After every step the arena's units are each held once."""

    def manager(self, page, window, pages, wpages, mode, retain) -> CacheManager:
        """Both slot spaces in one small arena: one request alone fits (44 tokens, its
        window and chunk), and a little more."""
        peak = 2 * (window + page) + 2 * page + 9
        units = 44 // page + 1 + 2 * (peak // page + 1) + pages + wpages
        self.arena = Arena(units, 8)
        full = TokenToKVPoolAllocator(units * page, page, pages=ArenaPages(self.arena, "full", 1))
        walloc = TokenToKVPoolAllocator(units * page, page,
                                        pages=ArenaPages(self.arena, "window", 2))  # fmt: skip
        comp = WindowKV(window, walloc, retain)
        cache = RadixCache(page, "lru", full, eviction_mode=mode, components=(comp,))
        slots = WindowSlots(comp, walloc, 4, 64, window)
        budget = HybridBudget(cache, None, comp, token_bytes=8 // page or 1,
                              window_bytes=16 // page or 1)  # fmt: skip
        slots.room = room = ArenaRoom(self.arena, budget, 1, comp, 2, page)
        return CacheManager(cache, full, ReqToTokenPool(4, 64), slots, room=room)

    @invariant()
    def units_held_once(self):
        if hasattr(self, "m"):
            full, win = self.m.allocator.source, self.m.manager("window").allocator.source
            self.arena.check({"full": [full.units()], "window": [win.units()], "states": []})


ArenaLifecycleMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)  # fmt: skip
TestArenaLifecycleMachine = pytest.mark.slow(ArenaLifecycleMachine.TestCase)


# --- the engine ------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3.5", "gemma3"])
@pytest.mark.parametrize("page", [1, 4])
def test_one_budget_serves_the_same_tokens_under_pressure(hybrid_models, name, page):
    """A budget a few requests wide: every kind is evicted and requests are preempted,
    and every token equals what separate, roomy pools compute (greedy and seeded), and
    transformers'. `check_memory` (the arena's units each held once, the tree, the
    windows, the checkpoints) runs after every step."""
    path = hybrid_models[name]
    small = dict(page_size=page, chunk_size=16, max_running=4, check_memory=True)
    budget = 75_000 if name == "qwen3.5" else 60_000
    one = Engine(path, cache_bytes=budget, **small)
    roomy = Engine(path, kv_tokens=4096, **small)
    assert one.arena is not None and roomy.arena is None
    ps = prompts(10)
    for temperature in (0.0, 0.8):
        a = one.generate(ps, max_new_tokens=20, temperature=temperature, chat=False,
                         ignore_eos=True)  # fmt: skip
        b = roomy.generate(ps, max_new_tokens=20, temperature=temperature, chat=False,
                           ignore_eos=True)  # fmt: skip
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        assert a.stats.cached_tokens > 0
    gone = one.cache_bytes_evicted()
    assert gone["full"] > 0 and (gone["states"] if name == "qwen3.5" else gone["window"]) > 0
    held = one.cache_bytes_held()
    assert sum(held.values()) <= budget
    assert one.scheduler.preemptions > 0
    import transformers

    arch = "Qwen3_5ForCausalLM" if name == "qwen3.5" else GEMMA[0]
    reference = getattr(transformers, arch).from_pretrained(path).eval()
    last = one.generate(ps[:2], max_new_tokens=12, chat=False, ignore_eos=True)
    for p, out in zip(ps[:2], last.outputs, strict=True):
        assert out.token_ids == greedy(reference, p, 12)


def test_a_hit_restores_a_checkpoint_from_arena_units(hybrid_models):
    """The same prompt twice on Qwen3.5-like: the second hits a checkpoint stored in
    arena units (copied back into its running row) and computes the same tokens."""
    eng = Engine(hybrid_models["qwen3.5"], cache_bytes=2**20, page_size=4, check_memory=True)
    p = prompts(1)[0]
    first = eng.generate([p], max_new_tokens=8, chat=False, ignore_eos=True).outputs[0]
    assert eng.arena.held["states"] > 0 and eng.recurrent.store.held_ids
    again = eng.generate([p], max_new_tokens=8, chat=False, ignore_eos=True).outputs[0]
    assert again.cached_tokens > 0 and again.token_ids == first.token_ids


def test_admission_frees_room_for_the_whole_prompt_at_once(hybrid_models):
    """With one arena, the step that admits a prompt of several chunks evicts for all of
    its full-attention KV in one pass of the budget's order
    (`CacheManager.make_prompt_room`), not chunk by chunk: right after that step the
    rest of the prompt fits in free slots (Qwen3.5-like: no window pages drawing from
    the same units meanwhile). The tokens are those of roomy pools."""
    path = hybrid_models["qwen3.5"]
    kw = dict(page_size=4, chunk_size=16, max_running=1, check_memory=True)
    eng = Engine(path, cache_bytes=60_000, **kw)
    roomy = Engine(path, kv_tokens=4096, **kw)
    g = torch.Generator().manual_seed(3)
    fill = [torch.randint(3, 384, (60,), generator=g).tolist() for _ in range(8)]
    eng.generate(fill, max_new_tokens=2, chat=False, ignore_eos=True)
    mgr = eng.mgr
    assert mgr.allocator.available_size() < 64  # the cache is full of the others' prefixes
    long = torch.randint(3, 384, (64,), generator=g).tolist()
    rid = eng.add_request(long, SamplingParams(4, ignore_eos=True), chat=False)
    eng.step()  # admits it and computes its first chunk of 16
    r = eng.requests[rid]
    assert r.kv_len == 16
    assert mgr.allocator.available_size() >= len(long) - r.kv_len
    while eng.has_unfinished():
        eng.step()
    again = roomy.generate([long], max_new_tokens=4, chat=False, ignore_eos=True).outputs[0]
    assert r.output_ids == again.token_ids


def test_a_turn_going_on_past_its_prompt_gives_up_its_own_checkpoint_not_another_chats(
    hybrid_models,
):
    """Chats A then B, one turn each, fill one arena; A's second turn, a long answer,
    needs room while it decodes. Once it has computed a page past its prompt's end, the
    checkpoint there is superseded (`StateCheckpoints.pass_through`: the turn will cache
    a longer sequence through it), so that one goes, not B's: B's second turn then hits
    its whole first turn. (While A's was not a candidate until A's turn was in the tree,
    B's went: B's second turn hit nothing at this budget.) The tokens are those of roomy
    pools; `check_memory` runs after every step."""
    path = hybrid_models["qwen3.5"]
    kw = dict(page_size=4, chunk_size=64, max_running=1, check_memory=True)
    g = torch.Generator().manual_seed(1)
    first = {c: torch.randint(3, 384, (48,), generator=g).tolist() for c in "AB"}
    more = {c: torch.randint(3, 384, (24,), generator=g).tolist() for c in "AB"}

    def chats(eng):
        out = {}
        for c in "BA":
            out[c + "1"] = eng.generate([first[c]], max_new_tokens=8, chat=False,
                                        ignore_eos=True).outputs[0]  # fmt: skip
        held = sum(eng.cache_bytes_held().values())
        for c, new in (("A", 24), ("B", 8)):
            ids = first[c] + out[c + "1"].token_ids + more[c]
            out[c + "2"] = eng.generate([ids], max_new_tokens=new, chat=False,
                                        ignore_eos=True).outputs[0]  # fmt: skip
        return out, held

    _, held = chats(Engine(path, cache_bytes=1 << 22, **kw))  # what both first turns hold
    roomy, _ = chats(Engine(path, kv_tokens=4096, **kw))
    tight, _ = chats(Engine(path, cache_bytes=held - 9_000, **kw))
    assert tight["A2"].cached_tokens == tight["B2"].cached_tokens == 52  # 48 + 8 - 1, paged
    assert [o.token_ids for o in tight.values()] == [o.token_ids for o in roomy.values()]


def test_aborts_at_every_stage_return_every_unit(hybrid_models):
    eng = Engine(hybrid_models["gemma3"], cache_bytes=60_000, page_size=4, chunk_size=16,
                 max_running=4, check_memory=True)  # fmt: skip
    rids = [eng.add_request(p, chat=False) for p in prompts(6)]
    for i, rid in enumerate(rids):
        eng.step()
        if i % 2:
            eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    eng.flush_cache()
    ar = eng.arena
    assert ar.free_units() == ar.num_units


# --- sizes, refusals -------------------------------------------------------------------------
def test_sglang_split_divides_the_same_bytes_by_its_ratios(hybrid_models):
    """``cache_split="sglang"``: states 0.9x the full KV's bytes, window 0.8x its tokens,
    in the separate pools; every pool's bytes together within the budget."""
    q = Engine(hybrid_models["qwen3.5"], cache_bytes=2**20, cache_split="sglang", page_size=4)
    assert q.arena is None
    full = q.mgr.allocator.size * q.kv.bytes_per_token()
    states = q.recurrent.component.max_states * q.recurrent.row_size
    assert full + states <= 2**20 and abs(states / full - 0.9) < 0.05
    g = Engine(hybrid_models["gemma3"], cache_bytes=2**20, cache_split="sglang", page_size=4)
    tokens, wtokens = g.mgr.allocator.size, g.window.allocator.size
    assert abs(wtokens / tokens - 0.8) < 0.01
    assert tokens * g.kv.bytes_per_token() + wtokens * g.kv.window_bytes_per_token() <= 2**20


def test_a_budget_too_small_for_one_request_is_refused_naming_the_minimum(hybrid_models):
    with pytest.raises(ValueError, match=r"cache_bytes: 4,096 bytes is too small .*one "
                       r"checkpoint .* at least [\d,]+ bytes"):  # fmt: skip
        Engine(hybrid_models["qwen3.5"], cache_bytes=4096)
    with pytest.raises(ValueError, match=r"window and chunk .* at least"):
        Engine(hybrid_models["gemma3"], cache_bytes=4096)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            dict(cache_bytes=2**20, cache_split="sglang", kv_tokens=100),
            "kv_tokens, window_tokens: with cache_split='sglang'",
        ),
        (dict(cache_bytes="auto", window_tokens=64), "window_tokens: with cache_bytes='auto'"),
        (dict(cache_split="sglang"), "cache_split: splits a cache_bytes budget"),
        (dict(cache_bytes=2**20, cache_split="even"), "cache_split must be one of"),
        (dict(cache_bytes=0), "cache_bytes must be a positive int"),
        (dict(cache_bytes="1GiB"), "cache_bytes must be a positive int"),
    ],
)
def test_bad_budget_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def arena_units(engine: Engine) -> int:
    return engine.arena.num_units


@pytest.mark.parametrize("name", ["qwen3.5", "gemma3"])
def test_kv_and_window_tokens_cap_their_kind_inside_the_budget(hybrid_models, name):
    """``kv_tokens`` (and ``window_tokens``) inside a budget are caps: the arena has room
    for more, but a kind at its cap frees its own pages; the tokens stay those of
    roomy separate pools, and every request finishes (no admission waits forever on a
    kind whose own cached pages it could free)."""
    caps = dict(kv_tokens=96) if name == "qwen3.5" else dict(kv_tokens=96, window_tokens=48)
    small = dict(page_size=4, chunk_size=16, max_running=4, check_memory=True)
    capped = Engine(hybrid_models[name], cache_bytes=200_000, **caps, **small)
    roomy = Engine(hybrid_models[name], kv_tokens=4096, **small)
    ps = [p[:60] for p in prompts(8)]
    arena, peak = capped.arena, {"full": 0, "window": 0, "free": arena_units(capped)}

    def watch(_done: int, _all: int) -> None:
        for kind in ("full", "window"):
            peak[kind] = max(peak[kind], arena.held[kind])
        peak["free"] = min(peak["free"], arena.free_units())

    a = capped.generate(ps, max_new_tokens=16, chat=False, ignore_eos=True, on_step=watch)
    b = roomy.generate(ps, max_new_tokens=16, chat=False, ignore_eos=True)
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert a.stats.cached_tokens > 0 and capped.mgr.allocator.capacity == 96
    assert "capped at 96 tokens" in "\n".join(capped.memory_summary())  # said at start
    assert peak["full"] == 96 // 4 * capped.memory.plan.arena.full_columns  # at its cap
    assert peak["free"] > 0 and capped.cache_bytes_evicted()["full"] > 0  # the cap evicted
    if name == "gemma3":
        assert peak["window"] == 48 // 4 * capped.memory.plan.arena.window_columns
    with pytest.raises(ValueError, match=r"window_tokens: 8 tokens cap the window KV below"):
        Engine(hybrid_models["gemma3"], cache_bytes=200_000, window_tokens=8, **small)


@pytest.mark.parametrize("page", [1, 16])
def test_a_model_whose_every_layer_slides_serves_from_one_arena(tmp_path, page):
    """Mistral (every layer sliding) under one byte budget: the arena holds its window
    pages, the tree's full slots are an index that costs no KV. Under a budget that
    evicts windows, with KV events on, the tokens equal an engine that keeps every
    window and transformers'; the blocks told are the servable pages; `auto` (serve's
    default) sizes it, where it was refused before."""
    import transformers
    from support.events import servable_blocks

    from radixkv.events import BlockRemoved, BlockStored

    path = folder(tmp_path / "m", "MistralForCausalLM", sliding_window=12)
    auto = Engine(str(path), cache_bytes="auto")
    assert auto.arena is not None and "none (every layer slides)" in auto.memory_summary()[1]
    g = torch.Generator().manual_seed(1)
    stems = [torch.randint(3, 384, (k,), generator=g).tolist() for k in (40, 70)]
    ps = [stems[i % 2] + torch.randint(3, 384, (5 + 7 * i,), generator=g).tolist()
          for i in range(8)]  # fmt: skip
    one = Engine(str(path), cache_bytes=40_000 if page == 16 else 24_000, page_size=page,
                 chunk_size=16, max_running=4, check_memory=True)  # fmt: skip
    whole = Engine(str(path), window_tokens=0, kv_tokens=4096, page_size=page)
    batches: list = []
    one.publish_kv_events(batches.append)
    told: set[int] = set()
    for i, p in enumerate(ps):
        one.add_request(p, SamplingParams(10, ignore_eos=True), i, chat=False)
    outs: dict = {}
    while one.has_unfinished():
        for o in one.step():
            outs.setdefault(o.rid, []).extend(o.token_ids)
        for e in (e for b in batches for e in b.events):
            if isinstance(e, BlockStored):
                told.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                told.difference_update(e.block_hashes)
        batches.clear()
        assert told == servable_blocks(one.cache, False)
    ref = whole.generate(ps, max_new_tokens=10, chat=False, ignore_eos=True)
    assert [outs[i] for i in range(len(ps))] == [o.token_ids for o in ref.outputs]
    assert one.cache_bytes_evicted()["window"] > 0 and one.scheduler.hit_tokens > 0
    reference = transformers.MistralForCausalLM.from_pretrained(path).eval()
    assert outs[0] == greedy(reference, ps[0], 10)


# --- radixkv serve ---------------------------------------------------------------------------
@pytest.mark.slow
def test_served_from_one_budget_with_the_openai_client(hybrid_models):
    """`radixkv serve` on the Qwen3.5-like folder with a 2 MiB budget and the official
    client: two chats sharing a system message, the second served it from a checkpoint
    kept in arena units; /metrics shows the budget and the bytes each kind holds."""
    import re

    import httpx
    import openai
    from helpers import cached_chats

    from radixkv.web.process import ServerProcess

    args = ["--model", hybrid_models["qwen3.5"], "--page-size", "16", "--cache-bytes", "2MiB",
            "--check-memory"]  # fmt: skip
    with ServerProcess(*args, timeout=90) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        chats = cached_chats(client, model, "Answer in one short sentence. " * 6,
                             ("A colour?", "A fruit?"))  # fmt: skip
        text = httpx.get(f"{srv.url}/metrics").text
    assert chats[0] == 0 and chats[1] >= 160

    def metric(name: str, kind: str = "") -> float:
        label = f'kind="{kind}",' if kind else ""
        m = re.search(rf"radixkv:{name}\{{{label}[^}}]*\}} ([0-9.e+]+)", text)
        assert m, name
        return float(m.group(1))

    assert 2**20 < metric("cache_budget_bytes") <= 2**21
    assert metric("cache_kind_bytes", "states") > 0 and metric("cache_kind_bytes", "full") > 0
    assert metric("cache_kind_evicted_bytes_total", "full") == 0


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--cache-bytes", "4x"], "argument --cache-bytes: must be a byte size"),
        (["--cache-bytes", "1KiB", "--model", "random"], "--cache-bytes: 1,024 bytes is too small"),
        (
            ["--cache-bytes", "1MiB", "--kv-tokens", "16"],
            "--kv-tokens: kv_tokens must hold at least two pages",
        ),
        (["--cache-split", "even"], "argument --cache-split: invalid choice"),
    ],
)
def test_serve_refuses_a_bad_budget_in_one_line(flags, named):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "radixkv.cli", "serve", "--port", "0", *flags],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {named}"), done.stderr
