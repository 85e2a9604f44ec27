"""A waiting agent's pages loaded back before it returns (`radixkv.engine.ahead`,
``prefetch_within``): an idle engine brings the pages a session predicted back soon left
in the host tier back to the device, so its next request finds them there (no load on
arrival) and computes what a cold engine computes; room is made only from what returns
later; nothing is loaded for a session predicted back beyond the horizon; the paths kept
for it are bounded; bad settings are refused by name. The same on hybrid models in one
byte budget (window pages and checkpoints come back too, the budget's room under the
same floor)."""

from __future__ import annotations

import pytest

from radixkv.engine.engine import Engine
from radixkv.engine.request import SamplingParams, SessionTag


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 131 + i * 7) % 250 + 3 for i in range(n)]


class Agents:
    """An engine on a clock the test moves; ``serve`` runs one session's request to its
    end at a given time, its answer a tool call or the end of a turn."""

    def __init__(self, model: str = "random", **config) -> None:
        self.now = 0.0
        config = {"host_tokens": 4096} | ({"kv_tokens": 1200} if model == "random" else {}) | config
        self.eng = Engine(model, page_size=4, max_context_len=1100, eviction_policy="session",
                          check_memory=True, clock=lambda: self.now, **config)  # fmt: skip

    def serve(self, key: str, ids: list[int], tool: bool, at: float, new: int = 2) -> list[int]:
        self.now = at
        eos = self.eng.tokenizer.eos_token_id
        bias = () if new > 2 else ((eos, 100.0),)  # (a 2-token answer ends at once)
        sampling = SamplingParams(new, logit_bias=bias, ignore_eos=new > 2)
        tag = SessionTag(key, lambda _t, _i: tool)
        rid = self.eng.add_request(ids, sampling, chat=False, session=tag)
        out: list[int] = []
        while self.eng.has_unfinished():
            for o in self.eng.step():
                if o.rid == rid:
                    out += o.token_ids
        return out

    def idle(self, at: float) -> int:
        self.now = at
        return self.eng.idle()


@pytest.mark.parametrize("memory", ["pool", "one budget"])
@pytest.mark.parametrize("ahead", [None, 60.0])
def test_an_agent_back_from_a_tool_call_finds_its_pages_on_the_device(ahead, memory):
    """A (a tool call) is pushed to the host by D (a long prompt whose turn ended). While
    the engine idles, A's pages come back (D's, predicted back in minutes, make room);
    A's next request then loads nothing on arrival and computes what a cold engine
    computes. The same in one byte budget (``cache_bytes``, capped at 1,200 tokens)."""
    budget = {"cache_bytes": 1 << 22} if memory == "one budget" else {}
    agents = Agents(prefetch_within=ahead, **budget)
    eng = agents.eng
    assert (eng.arena is not None) == bool(budget) and eng.mgr.allocator.capacity == 1200
    a, d = prompt(1, 380), prompt(4, 1000)
    agents.serve("A", a, tool=True, at=0.0)
    assert agents.idle(at=0.5) == 0  # A is whole on the device: nothing to load (yet)
    agents.serve("D", d, tool=False, at=1.0)
    assert eng.cache.match_len(a) < 380  # pushed down to the host
    loaded = agents.idle(at=3.0)
    assert (loaded > 0) == (ahead is not None)
    assert eng.tier.stats.ahead_tokens == loaded and eng.tier.stats.host_hit_tokens == 0
    if ahead is not None:
        assert eng.cache.match_len(a) == 380 and eng.cache.match_len(d) < 1000
    assert agents.idle(at=3.5) == 0  # nothing evicted since: nothing looked at again
    # the pages loaded are A's again, stamped with its return: another prompt's room
    # comes from D (back in minutes), not from them
    agents.serve("F", prompt(7, 300), tool=False, at=4.0)
    if ahead is not None:
        assert eng.cache.match_len(a) == 380
    follow = [*a, *prompt(9, 20)]
    got = agents.serve("A", follow, tool=True, at=5.0, new=6)
    assert (eng.tier.stats.host_hit_tokens > 0) == (ahead is None)  # loaded on arrival
    cold = Engine("random", page_size=4, kv_tokens=1200, max_context_len=1100,
                  prefix_cache=False)  # fmt: skip
    want = cold.generate([follow], max_new_tokens=6, chat=False, ignore_eos=True)
    assert got == want.outputs[0].token_ids


@pytest.mark.parametrize("model", ["random", "qwen3.5"])
def test_an_idle_call_loads_at_most_its_chunks_and_a_request_arriving_goes_first(
    hybrid_models, model
):
    """An idle call loads at most `IDLE_CHUNKS` chunks (a request arriving meanwhile
    waits for that copy at most, not a whole path's): with 16-token chunks A's 380
    tokens come back over several calls (on Qwen3.5 its KV held toward the checkpoint
    until it lands). A request arriving midway is admitted at the next step, before the
    rest of the load, and what was held is released for it; the calls after it finish
    the load, and A's next request computes what a cold engine computes."""
    from radixkv.engine.ahead import IDLE_CHUNKS

    config = {"chunk_size": 16, "prefetch_within": 60.0}
    if model == "qwen3.5":
        config |= {"cache_bytes": HYBRID[model][0]}
    agents = Agents(hybrid_models.get(model, model), **config)
    eng = agents.eng
    a = prompt(1, 380)
    agents.serve("A", a, tool=True, at=0.0)
    agents.serve("D", prompt(4, HYBRID[model][1] if model in HYBRID else 1000), tool=False,
                 at=1.0)  # fmt: skip
    before = eng.cache.match_len(a, full=True)
    assert eng.cache.match_len(a) < 380
    first = agents.idle(at=3.0)
    assert 0 < eng.cache.match_len(a, full=True) - before <= IDLE_CHUNKS * 16 and first
    rid = eng.add_request(prompt(8, 12), SamplingParams(2, ignore_eos=True), chat=False)
    eng.step()  # (admitted before the rest of A's load; nothing of A's held for it)
    assert eng.requests[rid] in eng.scheduler.running and not eng.ahead.locks()
    while eng.has_unfinished():
        eng.step()
    calls = 0
    while agents.idle(at=3.5):
        calls += 1
    assert eng.cache.match_len(a) == 380 and calls >= 1 and eng.cache.protected_size() == 0
    follow = [*a, *prompt(9, 20)]
    got = agents.serve("A", follow, tool=True, at=5.0, new=6)
    assert eng.tier.stats.host_hit_tokens == 0
    kw = {"kv_tokens": 1200} if model == "random" else {}
    cold = Engine(hybrid_models.get(model, model), page_size=4, max_context_len=1100,
                  prefix_cache=False, **kw)  # fmt: skip
    want = cold.generate([follow], max_new_tokens=6, chat=False, ignore_eos=True)
    assert got == want.outputs[0].token_ids


@pytest.mark.parametrize("memory", ["pool", "one budget"])
def test_a_busy_engine_loads_ahead_a_chunk_a_step_into_room_its_requests_leave(memory):
    """While B's long answer keeps the engine busy, A (back from a tool call, pushed down
    by D's long prompt) comes back between steps, at most a chunk (64 tokens) a step, its
    room taken from D (back in minutes); D's own prompt, while it ran, left no room below
    A for it (in one budget its room is freed at admission: A loaded into it would be
    evicted again by D's next chunk). Every page of A is loaded once; B computes what a
    cold engine computes; A's return loads nothing on arrival."""
    budget = {"cache_bytes": 1 << 22} if memory == "one budget" else {}
    agents = Agents(prefetch_within=60.0, chunk_size=64, **budget)
    eng = agents.eng
    a, d, b = prompt(1, 380), prompt(4, 1000), prompt(7, 40)
    agents.serve("A", a, tool=True, at=0.0)
    agents.serve("D", d, tool=False, at=1.0)
    held = eng.cache.match_len(a)
    assert held < 380 and eng.tier.stats.ahead_tokens == 0  # (none while D ran)
    agents.now = 2.0
    rid = eng.add_request(b, SamplingParams(30, ignore_eos=True), chat=False,
                          session=SessionTag("B", lambda _t, _i: False))  # fmt: skip
    steps, out = [], []
    while eng.has_unfinished():
        before = eng.tier.stats.ahead_tokens
        out += [t for o in eng.step() if o.rid == rid for t in o.token_ids]
        steps.append(eng.tier.stats.ahead_tokens - before)
    assert max(steps) <= 64 and sum(1 for n in steps if n) >= 2, steps
    assert eng.cache.match_len(a) == 380 and eng.tier.stats.ahead_tokens == 380 - held
    cold = Engine("random", page_size=4, kv_tokens=1200, max_context_len=1100,
                  prefix_cache=False)  # fmt: skip
    assert out == cold.generate([b], max_new_tokens=30, chat=False,
                                ignore_eos=True).outputs[0].token_ids  # fmt: skip
    agents.serve("A", [*a, *prompt(9, 20)], tool=True, at=5.0)
    assert eng.tier.stats.host_hit_tokens == 0


def test_a_busy_engine_counts_the_room_below_a_session_once_while_nothing_changes(
    monkeypatch,
):
    """A ended its turn; X, a tool call (back sooner), pushed it down and holds the rest.
    While B decodes, too little ranks below A: a busy step counts that
    (`EvictionOrder.size_below`, O(leaves)) once for each state of the room (B's decode
    evicts a page every 4 steps); the steps between, with nothing evicted or unlocked,
    do not count it again. Nothing is loaded."""
    from radixkv.tree.eviction import EvictionOrder

    agents = Agents(prefetch_within=3600.0)
    eng = agents.eng
    counted = []
    size_below = EvictionOrder.size_below

    def counting(self, floor, enough):
        counted.append((eng.ahead._epoch(), floor))
        return size_below(self, floor, enough)

    monkeypatch.setattr(EvictionOrder, "size_below", counting)
    agents.serve("A", prompt(1, 380), tool=False, at=0.0)
    agents.serve("X", prompt(4, 1000), tool=True, at=1.0)
    counted.clear()
    agents.serve("B", prompt(7, 40), tool=False, at=2.0, new=20)
    assert counted and len(set(counted)) == len(counted), counted
    assert eng.tier.stats.ahead_tokens == 0


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("memory", ["pool", "one budget", "qwen3.5", "gemma3"])
def test_random_agents_with_loads_ahead_compute_what_a_cold_engine_computes(
    hybrid_models, seed, memory
):
    """Six agent sessions over a tight device, at random: each turn extends its own
    conversation (tool call or end of turn), two or three at once, with idle moments
    between; loads ahead run while busy and while idle. Every answer equals a cold
    engine's, and every step and idle load leaves the memory whole (``check_memory``:
    the pool, the tree, the tiers). Full attention in a pool and in one budget, and
    the hybrid models in one budget (checkpoints, window pages)."""
    import random

    rng = random.Random(seed)
    model, budget = "random", {"cache_bytes": 1 << 22} if memory == "one budget" else {}
    if memory in HYBRID:
        model, budget = hybrid_models[memory], {"cache_bytes": HYBRID[memory][0]}
    agents = Agents(model, prefetch_within=30.0, chunk_size=64, host_tokens=1024, **budget)
    eng = agents.eng
    cold = Engine(model, page_size=4, max_context_len=1100, prefix_cache=False)
    talks = {f"s{i}": prompt(i, rng.randrange(150, 400)) for i in range(6)}
    for _ in range(10):
        agents.now += rng.uniform(0.5, 8.0)
        batch = rng.sample(sorted(talks), rng.randrange(1, 4))
        rids = {}
        for key in batch:
            if len(talks[key]) > 900:
                talks[key] = talks[key][:100]  # (a new conversation on the same prefix)
            tool = rng.random() < 0.6
            tag = SessionTag(key, lambda _t, _i, tool=tool: tool)
            rids[eng.add_request(talks[key], SamplingParams(4, ignore_eos=True), chat=False,
                                 session=tag)] = key  # fmt: skip
        got: dict = {rid: [] for rid in rids}
        while eng.has_unfinished():
            for o in eng.step():
                got[o.rid] += o.token_ids
        want = cold.generate([talks[rids[r]] for r in rids], max_new_tokens=4, chat=False,
                             ignore_eos=True)  # fmt: skip
        assert [got[r] for r in rids] == [o.token_ids for o in want.outputs]
        for rid, key in rids.items():
            talks[key] = [*talks[key], *got[rid], *prompt(rng.randrange(99), 40)]
        agents.idle(at=agents.now + rng.uniform(0.1, 5.0))
        assert eng.cache.protected_size() == 0 or eng.ahead.locks()  # (KV held toward a
        # checkpoint at most; check_memory's ledger accounts for every lock)
    layers = {name: value for t in eng.layer_tiers for _, name, _, value in t.metrics()}
    assert eng.tier.stats.ahead_tokens > 0 or layers.get("window_pages_loaded_ahead", 0) > 0


def test_nothing_is_loaded_for_a_session_predicted_back_beyond_the_horizon():
    agents = Agents(prefetch_within=5.0)
    a, d = prompt(1, 380), prompt(4, 1000)
    agents.serve("A", a, tool=True, at=0.0)  # predicted back at 10 s
    agents.serve("D", d, tool=False, at=1.0)
    assert agents.idle(at=2.0) == 0  # 10 s is more than 5 s ahead
    assert agents.idle(at=6.0) > 0  # now it is within 5 s


def test_a_load_ahead_never_evicts_a_session_predicted_back_sooner():
    """A ended its turn (back in ~10 minutes); X, a long prompt, pushed most of it down,
    and its turn ended after A's (back later than A); E called a tool (back in seconds).
    Loading A ahead evicts X, never E: what does not fit of A waits in the host tier."""
    agents = Agents(prefetch_within=3600.0)
    eng = agents.eng
    a, x, e = prompt(1, 900), prompt(4, 1000), prompt(5, 400)
    agents.serve("A", a, tool=False, at=0.0)
    agents.serve("X", x, tool=False, at=1.0)
    agents.serve("E", e, tool=True, at=2.0)
    before = {k: eng.cache.match_len(p) for k, p in (("A", a), ("X", x), ("E", e))}
    assert before["E"] == 400 and before["A"] < 900 and before["X"] > 0, before
    for t in (3.0, 3.1, 3.2):  # E (whole: nothing to load), then A, then nothing
        agents.idle(at=t)
    after = {k: eng.cache.match_len(p) for k, p in (("A", a), ("X", x), ("E", e))}
    assert after["E"] == 400, after  # E untouched
    assert after["X"] == 0 and before["A"] < after["A"] < 900, after
    assert eng.tier.stats.ahead_tokens == after["A"] - before["A"]


def test_the_paths_kept_for_it_are_bounded(monkeypatch):
    from radixkv.engine import ahead

    monkeypatch.setattr(ahead, "MAX_PATHS", 3)
    agents = Agents(prefetch_within=60.0)
    keep = agents.eng.ahead
    for i in range(8):
        agents.serve(f"s{i}", prompt(i, 40 + i), tool=True, at=float(i))
    assert list(keep.paths) == ["s5", "s6", "s7"]  # the most recently finished
    assert keep.held == sum(len(p[0]) for p in keep.paths.values()) <= keep.max_held
    assert keep.max_tokens == 4096 + 1200 and keep.max_held == 4 * keep.max_tokens
    keep.max_tokens, keep.max_held = 100, 150
    keep.remember("longer than device and host", prompt(2, 200), None)
    assert "longer than device and host" not in keep.paths
    for i in range(3):
        keep.remember(f"t{i}", prompt(i, 60), None)
    assert list(keep.paths) == ["t1", "t2"] and keep.held == 120  # the oldest went


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"prefetch_within": 0}, "prefetch_within must be a number of seconds > 0"),
        ({"prefetch_within": True}, "prefetch_within must be"),
        ({"prefetch_within": float("nan")}, "prefetch_within must be"),
        ({"prefetch_within": 5.0, "eviction_policy": "lru"}, "prefetch_within needs the session"),
        ({"prefetch_within": 5.0, "host_tokens": 0}, "prefetch_within needs a tier"),
    ],
)
def test_bad_settings_are_refused_by_name(config, match):
    base = {"eviction_policy": "session", "host_tokens": 4096}
    with pytest.raises(ValueError, match=match):
        Engine("random", kv_tokens=1200, **(base | config))


# a budget where the agent's 380 tokens and the other prompt do not fit together
HYBRID = {"qwen3.5": (200_000, 540), "gemma3": (420_000, 900)}


@pytest.mark.parametrize("ahead", [None, 60.0])
@pytest.mark.parametrize("model", ["qwen3.5", "gemma3"])
def test_on_a_hybrid_model_the_agent_finds_its_pages_and_its_state_on_the_device(
    hybrid_models, model, ahead
):
    """Qwen3.5 (its checkpoint comes back with the KV up to it) and Gemma 3 (its window
    pages come back after the full pages) in one byte budget: A, back from a tool call,
    was pushed down to the host by D; while the engine idles its path comes back, room
    made through the budget, so its next request loads nothing on arrival and computes
    what a cold engine computes."""
    size, d_len = HYBRID[model]
    agents = Agents(hybrid_models[model], cache_bytes=size, prefetch_within=ahead)
    eng = agents.eng
    a, d = prompt(1, 380), prompt(4, d_len)
    agents.serve("A", a, tool=True, at=0.0)
    agents.serve("D", d, tool=False, at=1.0)
    assert eng.cache.match_len(a) == 0  # pushed down to the host
    loaded = agents.idle(at=3.0)
    assert loaded == (380 if ahead else 0) and eng.cache.match_len(a) == loaded
    assert eng.tier.stats.ahead_tokens == loaded and eng.tier.stats.host_hit_tokens == 0
    layers = {name: value for t in eng.layer_tiers for _, name, _, value in t.metrics()}
    kind = "state_checkpoints" if model == "qwen3.5" else "window_pages"
    assert (layers[f"{kind}_loaded_ahead"] > 0) == (ahead is not None)
    assert layers[f"{kind}_loaded_ahead"] == layers[f"{kind}_loaded"]
    follow = [*a, *prompt(9, 20)]
    got = agents.serve("A", follow, tool=True, at=5.0, new=6)
    assert (eng.tier.stats.host_hit_tokens > 0) == (ahead is None)  # loaded on arrival
    cold = Engine(hybrid_models[model], page_size=4, max_context_len=1100, prefix_cache=False)
    want = cold.generate([follow], max_new_tokens=6, chat=False, ignore_eos=True)
    assert got == want.outputs[0].token_ids


@pytest.mark.parametrize("model", ["qwen3.5", "gemma3"])
def test_on_a_hybrid_model_a_load_ahead_never_evicts_a_sooner_return(hybrid_models, model):
    """A ended its turn; X, a tool call (back in seconds, sooner than A), pushed it down.
    The only room for A beyond what is free is X's: the budget, asked for it under A's
    floor, frees nothing, and A gets at most the free room (Gemma 3: the part of its path
    that fits there; Qwen3.5: nothing, its checkpoint lies beyond). Without the floor, A
    and X would push each other out in turn."""
    size, d_len = HYBRID[model]
    agents = Agents(hybrid_models[model], cache_bytes=size, prefetch_within=3600.0)
    eng = agents.eng
    a, x = prompt(1, 380), prompt(4, d_len)
    agents.serve("A", a, tool=False, at=0.0)
    agents.serve("X", x, tool=True, at=1.0)
    assert eng.cache.match_len(a) == 0 and eng.cache.match_len(x) == d_len
    evicted, free = eng.mgr.evicted_tokens, eng.mgr.allocator.available_size()
    loaded = agents.idle(at=3.0)
    assert agents.idle(at=3.1) == 0 and loaded <= free and eng.cache.match_len(a) == loaded
    assert (loaded > 0) == (model == "gemma3")
    assert eng.cache.match_len(x) == d_len and eng.mgr.evicted_tokens == evicted


@pytest.mark.parametrize("chunk", [64, 512])
def test_a_busy_engine_loads_a_checkpoint_beyond_a_chunk_over_steps_holding_its_kv(
    hybrid_models, chunk
):
    """Qwen3.5: A's checkpoint (380 tokens in) comes back during B's answer, in one
    step with 512-token chunks, and with 64-token ones over several: the KV toward it
    is loaded a chunk a step and held (locked: before the checkpoint it serves no
    match, and the budget frees such KV first) until the checkpoint lands. A's next
    request then loads nothing on arrival and computes what a cold engine computes."""
    size, d_len = HYBRID["qwen3.5"]
    agents = Agents(hybrid_models["qwen3.5"], cache_bytes=size, prefetch_within=60.0,
                    chunk_size=chunk)  # fmt: skip
    eng = agents.eng
    a = prompt(1, 380)
    agents.serve("A", a, tool=True, at=0.0)
    agents.serve("D", prompt(4, d_len), tool=False, at=1.0)
    assert eng.cache.match_len(a) == 0
    agents.now = 2.0
    eng.add_request(prompt(7, 40), SamplingParams(30, ignore_eos=True), chat=False,
                    session=SessionTag("B", lambda _t, _i: False))  # fmt: skip
    fulls, landed = [], None  # (step 1 admits B, whose room may take dead KV of A's)
    for step in range(1, 31):
        eng.step()
        full, served = eng.cache.match_len(a, full=True), eng.cache.match_len(a)
        if landed is None and step > 1:  # (the KV toward the checkpoint, none of it
            fulls.append(full)  # servable, held beside B's 40 tokens)
            assert served in (0, 380) and (served or eng.cache.protected_size() >= 40 + full)
        if served == 380 and landed is None:
            landed = step
    assert landed is not None and fulls == sorted(set(fulls)) and fulls[-1] == 380
    assert (landed > 2) == (chunk == 64)
    while eng.has_unfinished():
        eng.step()
    assert agents.idle(at=3.0) == 0 and eng.cache.protected_size() == 0
    follow = [*a, *prompt(9, 20)]
    got = agents.serve("A", follow, tool=True, at=5.0, new=6)
    assert eng.tier.stats.host_hit_tokens == 0  # (nothing loaded on arrival)
    cold = Engine(hybrid_models["qwen3.5"], page_size=4, max_context_len=1100,
                  prefix_cache=False)  # fmt: skip
    want = cold.generate([follow], max_new_tokens=6, chat=False, ignore_eos=True)
    assert got == want.outputs[0].token_ids


def test_a_waiting_request_releases_the_kv_held_toward_a_checkpoint(hybrid_models):
    """A's KV, held toward its checkpoint by a busy step, is unlocked as soon as a
    request waits to be admitted (the room is the request's), and first of all when a
    decode short of room would preempt (the scheduler's ``relieve``); the pages stay
    cached. Nothing is held once the engine idles with no session due."""
    size, d_len = HYBRID["qwen3.5"]
    agents = Agents(hybrid_models["qwen3.5"], cache_bytes=size, prefetch_within=60.0,
                    chunk_size=64)  # fmt: skip
    eng = agents.eng
    a = prompt(1, 380)
    agents.serve("A", a, tool=True, at=0.0)
    agents.serve("D", prompt(4, d_len), tool=False, at=1.0)
    agents.now = 2.0
    busy = SamplingParams(30, ignore_eos=True)
    eng.add_request(prompt(7, 40), busy, chat=False)
    eng.step()  # (B admitted)
    eng.step()  # (a chunk of A's KV loaded toward its checkpoint, held)
    full = eng.cache.match_len(a, full=True)
    assert 0 < full < 380 and eng.cache.match_len(a) == 0
    assert eng.cache.protected_size() >= 40 + full
    eng.add_request(prompt(8, 12), SamplingParams(2, ignore_eos=True), chat=False)
    eng.step()  # (released before the admission; the new request locks its own path)
    assert eng.cache.protected_size() <= sum(r.kv_len for r in eng.scheduler.running) < full
    eng.step()  # (held again)
    held = eng.cache.protected_size() - sum(r.cache_protected_len for r in eng.scheduler.running)
    assert held > 0  # (a decode short of room, before it preempts, releases it first)
    assert eng.scheduler.relieve(1) >= 1 and eng.scheduler.relieve(1) == 0
    while eng.has_unfinished():
        eng.step()
    agents.idle(at=3.0)
    agents.idle(at=500.0)  # (no session due: nothing held)
    assert eng.cache.protected_size() == 0


def test_radixkv_serve_names_the_flag(hybrid_models, capsys):
    from radixkv.cli import main

    qwen = hybrid_models["qwen3.5"]
    for extra, err in (
        ([], "--prefetch-within: prefetch_within needs the session eviction policy"),
        (["--eviction-policy", "session"], "--prefetch-within: prefetch_within needs a tier"),
    ):  # fmt: skip
        code = main(["serve", "--port", "0", "--model", qwen, "--prefetch-within", "5", *extra])
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and lines[-1].startswith(f"error: {err}"), lines


def test_the_kv_events_tell_the_pages_loaded_ahead():
    """A router's index of the engine's KV events (through the wire) holds exactly the
    device's pages after every request and every idle load: D's pages that made room go,
    A's pages loaded ahead come, so the index credits A's return with its whole path."""
    from support.events import apply_to_index

    from radixkv.router.index import KvIndex

    agents = Agents(prefetch_within=60.0)
    eng = agents.eng
    batches: list = []
    eng.publish_kv_events(batches.append)
    index = KvIndex(4)
    index.sparse.add("w")

    def told() -> None:
        apply_to_index(batches, index)
        assert index.num_blocks("w") == eng.cache.total_size() // 4

    a, d = prompt(1, 380), prompt(4, 1000)
    agents.serve("A", a, tool=True, at=0.0)
    told()
    agents.serve("D", d, tool=False, at=1.0)
    told()
    assert 4 * index.overlap([*a, 1]).get("w", 0) < 380
    assert agents.idle(at=3.0) > 0
    told()
    assert 4 * index.overlap([*a, 1]).get("w", 0) == 380


def test_no_room_is_made_for_pages_the_host_pool_no_longer_holds():
    """A host pool of 4 pages keeps only the last of A's pages pushed down: the run
    that would continue A's device prefix is gone, so nothing is loaded and nothing of
    D is evicted for it."""
    agents = Agents(prefetch_within=60.0, host_tokens=16)
    eng = agents.eng
    a, d = prompt(1, 380), prompt(4, 1000)
    agents.serve("A", a, tool=True, at=0.0)
    agents.serve("D", d, tool=False, at=1.0)
    held_a, held_d = eng.cache.match_len(a), eng.cache.match_len(d)
    evicted = eng.mgr.evicted_tokens
    assert held_a < 380
    assert agents.idle(at=3.0) == 0
    assert (eng.cache.match_len(a), eng.cache.match_len(d)) == (held_a, held_d)
    assert eng.mgr.evicted_tokens == evicted


def test_a_flushed_cache_is_not_loaded_back_ahead():
    agents = Agents(prefetch_within=60.0)
    eng = agents.eng
    agents.serve("A", prompt(1, 380), tool=True, at=0.0)
    assert eng.flush_cache() > 0 and eng.cache.total_size() == 0
    assert agents.idle(at=1.0) == 0 and eng.cache.total_size() == 0


def test_an_idle_engine_stamps_overdue_sessions_again_before_choosing():
    """A session away longer than predicted is predicted away as long again; its stamp
    must say so before a load ahead compares priorities (as a step ticks the clock before
    evicting), or a return long past would look like the soonest there is."""
    from radixkv.kvcache.sessions import priority_of

    agents = Agents(prefetch_within=60.0)
    v = prompt(1, 300)
    agents.serve("V", v, tool=True, at=0.0)  # back at 10 s, as predicted then
    node = agents.eng.cache.match_prefix(v).last_node
    assert node.priority == priority_of(10.0)
    agents.idle(at=100.0)  # overdue: away as long again, back at 200 s
    assert agents.eng.cache.match_prefix(v).last_node.priority == priority_of(200.0)
