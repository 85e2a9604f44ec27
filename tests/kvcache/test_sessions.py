"""The session clock (an agent's return predicted from its stop reasons and gaps) and the
``session`` eviction order it gives the engine's tree: an agent that stopped on a tool
call is kept over a session whose person ended the turn, which LRU evicts the other way
round."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.engine.engine import Engine
from radixkv.engine.request import SamplingParams, SessionTag
from radixkv.kvcache.sessions import DEFAULT_GAP_S, FORGET_S, SessionClock, priority_of


def test_predictions_follow_stop_reasons_and_learned_gaps():
    c = SessionClock()
    c.started("a", 0.0)
    assert c.predicted("a", 1.0) == 1.0 + DEFAULT_GAP_S["tool_use"]  # running
    c.stopped("a", 2.0, "tool_use")
    assert c.predicted("a", 3.0) == 2.0 + DEFAULT_GAP_S["tool_use"]
    c.started("a", 5.0)  # came back 3 s after a tool call: learned
    c.stopped("a", 6.0, "end_turn")
    assert c.predicted("a", 7.0) == 6.0 + DEFAULT_GAP_S["end_turn"]
    c.started("a", 106.0)  # 100 s after its turn ended: learned
    c.stopped("a", 107.0, "tool_use")
    assert c.predicted("a", 108.0) == 107.0 + 3.0
    c.started("a", 110.0)
    c.stopped("a", 111.0, "end_turn")
    assert c.predicted("a", 112.0) == 111.0 + 100.0
    # an end still to come counts as running (nothing reads the future)
    c.started("b", 0.0)
    c.stopped("b", 50.0, "end_turn")
    assert c.predicted("b", 10.0) == 10.0 + DEFAULT_GAP_S["tool_use"]


def test_a_session_away_longer_than_predicted_is_predicted_away_as_long_again():
    c = SessionClock()
    c.started("a", 0.0)
    c.stopped("a", 0.0, "tool_use", node="leaf")
    assert c.due(5.0) == []
    (due,) = c.due(11.0)  # 10 s predicted: overdue at 11 s
    assert (due.session, due.node, due.predicted) == ("a", "leaf", 22.0)
    assert c.due(20.0) == [] and c.due(23.0)[0].predicted == 46.0  # doubling: O(log) stamps
    assert c.predicted("a", 30.0) == 60.0
    c.started("a", 31.0)  # it came back: nothing due while it runs
    assert c.running == 1 and c.due(1e6) == []
    c.stopped("a", 32.0, "end_turn")
    assert c.running == 0
    assert c.due(32.0 + FORGET_S + 1) == [] and "a" not in c.sessions  # forgotten


def test_stamps_order_later_returns_first():
    assert priority_of(10.0) > priority_of(600.0) > 0


def _serve(eng: Engine, key: str, prompt: list[int], tool: bool) -> None:
    """One request of session ``key`` run to its end, a stop the server reads (its model
    ends at once: ``finish_reason`` ``stop``): its answer called a tool or ended the turn."""
    tag = SessionTag(key, lambda _text, _ids: tool)
    eos = eng.tokenizer.eos_token_id
    eng.add_request(prompt, SamplingParams(2, logit_bias=((eos, 100.0),)), chat=False,
                    session=tag)  # fmt: skip
    while eng.has_unfinished():
        eng.step()
    assert eng.sessions is None or eng.sessions.clock.sessions[key].stop == (
        "tool_use" if tool else "end_turn")  # fmt: skip


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 131 + i * 7) % 250 + 3 for i in range(n)]


@pytest.mark.parametrize("policy", ["session", "lru"])
def test_the_agent_coming_back_is_kept_over_the_person_who_left(policy):
    """A and B each cache ~1/3 of the pool; A's answer called a tool, B's ended the
    turn, B after A. A third session's prompt then needs room: LRU evicts A (the older),
    the session order evicts B (its person is predicted back in minutes, A in seconds)."""
    eng = Engine("random", page_size=4, kv_tokens=1200, max_context_len=1024,
                 eviction_policy=policy, prefix_cache=True)  # fmt: skip

    run = functools.partial(_serve, eng)

    a, b, c = _prompt(1, 380), _prompt(2, 380), _prompt(3, 560)
    run("A", a, tool=True)
    run("B", b, tool=False)
    run("C", c, tool=False)
    kept = {k: eng.cache.match_len(p) for k, p in (("A", a), ("B", b))}
    victim, keeper = ("B", "A") if policy == "session" else ("A", "B")
    assert kept[keeper] == 380 and kept[victim] < 380, kept
    if policy == "session":  # what it gave up: B, whose person is back in minutes
        gone = eng.sessions.reasons.tokens
        assert gone["back_later"] >= 380 - kept["B"] and gone["back_within_1m"] == 0, gone


def test_a_hybrid_model_with_separate_pools_refuses_the_session_order(hybrid_models, capsys):
    """Separate pools (no one budget, or SGLang's fixed split) each evict in their own
    order, which reads no stamp: refused, not ignored."""
    from radixkv.cli import main

    with pytest.raises(ValueError, match="eviction_policy session"):
        Engine(hybrid_models["qwen3.5"], eviction_policy="session")
    code = main(["serve", "--port", "0", "--model", hybrid_models["gemma3"],
                 "--eviction-policy", "session", "--cache-bytes", "1MiB",
                 "--cache-split", "sglang"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: --eviction-policy: "), err


def test_a_client_naming_a_new_session_each_time_cannot_grow_the_map(monkeypatch):
    from radixkv.kvcache import sessions

    monkeypatch.setattr(sessions, "MAX_SESSIONS", 50)
    c = SessionClock()
    c.started("busy", 0.0)  # running: never forgotten
    for i in range(1000):
        c.started(f"s{i}", float(i))
        c.stopped(f"s{i}", float(i), "end_turn")
    assert len(c.sessions) <= 50 and "busy" in c.sessions and "s999" in c.sessions
    assert c.running == 1


def test_a_recogniser_that_raises_does_not_stop_the_engine():
    eng = Engine("random", page_size=4, kv_tokens=1200, max_context_len=1024,
                 eviction_policy="session")  # fmt: skip

    def broken(_text, _ids):
        raise RecursionError("deep")

    eng.add_request([5, 6, 7, 8], SamplingParams(2, ignore_eos=True), chat=False,
                    session=SessionTag("x", broken))  # fmt: skip
    while eng.has_unfinished():
        eng.step()
    assert eng.sessions.clock.sessions["x"].stop == ""


def test_a_waiting_session_is_demoted_to_the_host_tier_and_loaded_back_when_it_returns():
    """Issue 61's tiers in the engine: with a host tier, the session whose turn ended
    is what the device gives up, to the host pool rather than to nothing, and its next
    request loads it back; the agent coming back from a tool call stays on the device."""
    eng = Engine("random", page_size=4, kv_tokens=1200, max_context_len=1024,
                 eviction_policy="session", prefix_cache=True, host_tokens=4096)  # fmt: skip

    run = functools.partial(_serve, eng)

    a, b, c = _prompt(1, 380), _prompt(2, 380), _prompt(3, 560)
    run("A", a, tool=True)
    run("B", b, tool=False)
    assert eng.tier.stats.demoted_pages == 0
    run("C", c, tool=False)
    kept = eng.cache.match_len(b)
    assert eng.cache.match_len(a) == 380 and kept < 380  # B's tail left the device
    assert eng.tier.stats.demoted_pages > 0  # ... for the host pool
    before = eng.tier.stats.host_hit_tokens
    run("B", b + _prompt(4, 20), tool=False)  # B's person is back
    loaded = eng.tier.stats.host_hit_tokens - before
    assert loaded > 0 and kept + loaded >= 380 - eng.cache.page_size, (kept, loaded)
    assert eng.cache.match_len(b) == 380


def _tree_order():
    from radixkv import RadixCache, RadixKey
    from radixkv.kvcache.sessions import SessionOrder

    cache = RadixCache(page_size=1, eviction_policy="session")

    def add(tokens: list[int]):
        cache.insert(RadixKey(tokens))
        return cache.match_prefix(RadixKey(tokens)).last_node

    return cache, SessionOrder(cache), add


def test_a_path_its_session_left_goes_back_to_priority_zero():
    """A session that went on from elsewhere (a compacted context, a new prompt) never
    comes back to its old path: that path keeps no stamp (a stamp kept would be a
    return long past, the highest priority), so it goes before a stamped session."""
    cache, order, add = _tree_order()
    old = add(list(range(100, 140)))
    order.started("A", 0.0)
    order.stopped("A", 1.0, "tool_use", old)
    assert old.priority == priority_of(1.0 + DEFAULT_GAP_S["tool_use"])
    order.started("B", 2.0)
    order.stopped("B", 3.0, "end_turn", add(list(range(500, 540))))
    new = add(list(range(900, 940)))  # A starts over elsewhere
    order.started("A", 5.0)
    order.stopped("A", 6.0, "tool_use", new)
    assert old.priority == 0 and new.priority > 0
    cache.evict(40)
    assert cache.match_len(list(range(100, 140))) == 0  # the left path went first
    assert cache.match_len(list(range(500, 540))) == 40  # B (back in minutes) stays


def test_a_left_branch_is_released_after_its_last_node_went():
    """A session's next request branched off its last path (the answer re-rendered
    differently: Claude Code drops thinking from its history) after that path's last
    node was evicted. What is left of the old branch below the fork goes back to 0, and
    the fork, on the new path, keeps its stamp. Before, the walk stopped at the fork
    (two children), zeroed the new path's prefix and left the old branch at its stamp,
    a return long past once due: never evicted (a quarter of the cache in an agentic
    replay, where the engine's session order then lost to LRU)."""
    cache, order, add = _tree_order()
    prefix = list(range(100, 140))
    add(prefix)  # (a request's path is inserted as it is computed: a chain of nodes)
    add(prefix + [1] * 8)
    last = add(prefix + [1] * 8 + [5] * 8)
    order.started("A", 0.0)
    order.stopped("A", 1.0, "tool_use", last)
    order.started("A", 4.0)
    new = add(prefix + [2] * 8)  # its next turn forks below the prefix
    fork, old = new.parent, last.parent
    assert len(fork) == 40 and old.parent is fork and len(fork.children) == 2
    cache.evict_leaf(last)  # the old path's last node went under pressure
    order.stopped("A", 5.0, "tool_use", new)
    assert old.priority == 0  # what is left of the branch it left
    assert fork.priority == new.priority == priority_of(5.0 + 3.0)  # its path: stamped
    order.started("B", 6.0)
    order.stopped("B", 7.0, "end_turn", add(list(range(500, 508))))
    cache.evict(8)  # the left branch goes first, not the person who left (B)
    assert cache.match_len(prefix + [1] * 8) == 40 and cache.match_len(list(range(500, 508))) == 8


def test_a_left_branch_is_told_from_another_sessions_at_the_same_fork():
    """Another session (B) forked at the same node: of the two children off A's new
    path, A's left branch is the one holding A's stamp; B's keeps its own."""
    cache, order, add = _tree_order()
    prefix = list(range(100, 140))
    add(prefix)
    add(prefix + [1] * 8)
    last = add(prefix + [1] * 8 + [5] * 8)
    order.started("A", 0.0)
    order.stopped("A", 1.0, "tool_use", last)
    b = add(prefix + [3] * 8)
    order.started("B", 1.5)
    order.stopped("B", 2.0, "end_turn", b)
    order.started("A", 4.0)
    new = add(prefix + [2] * 8)
    old = last.parent
    assert len(new.parent.children) == 3
    cache.evict_leaf(last)
    order.stopped("A", 5.0, "tool_use", new)
    assert old.priority == 0 and b.priority == priority_of(2.0 + DEFAULT_GAP_S["end_turn"])


def test_a_prefix_left_by_evicted_branches_takes_its_sessions_next_stamp():
    """A and B share a prefix; both their own branches were evicted, the prefix a leaf
    still holding the soonest return stamped below it (A's, 11 s). Once A is overdue
    it is predicted away as long again, and that stamp lands on the prefix, the part
    of its path left; before, nothing stamped it again and its passed return (the
    highest priority there is) kept it for good."""
    cache, order, add = _tree_order()
    prefix = list(range(100, 140))
    a, b = add(prefix + [1] * 8), add(prefix + [2] * 8)
    order.started("A", 0.0)
    order.stopped("A", 1.0, "tool_use", a)
    order.started("B", 0.5)
    order.stopped("B", 2.0, "end_turn", b)
    shared = a.parent
    assert shared.priority == priority_of(1.0 + DEFAULT_GAP_S["tool_use"])
    cache.evict_leaf(a)
    cache.evict_leaf(b)
    assert not shared.children and shared.priority == priority_of(11.0)
    order.tick(20.0)  # A overdue: away as long again, 20 + 19 s
    assert shared.priority == priority_of(39.0)


def test_an_overdue_session_whose_leaf_was_evicted_is_stamped_where_its_path_survives():
    """An order eats a path from its leaf: once a session's last node is gone, its
    next stamp (overdue: away as long again) lands on what is left of its branch;
    before, that stayed at the stamp of a return long past and was never evicted."""
    cache, order, add = _tree_order()
    first = add(list(range(100, 140)))
    order.started("A", 0.0)
    order.stopped("A", 1.0, "tool_use", first)
    order.started("A", 4.0)
    leaf = add(list(range(100, 180)))  # its next turn: a child of the first turn's node
    order.stopped("A", 5.0, "tool_use", leaf)
    assert leaf.parent is first and first.priority == leaf.priority
    cache.evict_leaf(leaf)  # its latest turn left the device
    stale = first.priority
    order.tick(5.0 + 3 * DEFAULT_GAP_S["tool_use"])  # overdue: predicted away as long again
    assert first.priority < stale  # stamped again, later than the stale return


def test_a_forgotten_session_releases_its_path(monkeypatch):
    from radixkv.kvcache import sessions

    monkeypatch.setattr(sessions, "MAX_SESSIONS", 2)
    _, order, add = _tree_order()
    nodes = []
    for i, name in enumerate("ABC"):  # C's arrival forgets A, the least recently started
        nodes.append(add(list(range(100 * (i + 1), 100 * (i + 1) + 20))))
        order.started(name, float(i))
        order.stopped(name, float(i) + 0.5, "end_turn", nodes[-1])
    assert "A" not in order.clock.sessions
    assert nodes[0].priority == 0 and nodes[1].priority > 0 and nodes[2].priority > 0
    # where its path ended and its branch hung are forgotten with it (the maps hold two
    # entries a session at most)
    places = order.places
    held = [k for group in (*places.ends.values(), *places.bases.values()) for k in group]
    assert sorted(held) == ["B", "B", "C", "C"]


@pytest.mark.parametrize("policy", ["session", "lru"])
@pytest.mark.parametrize("model", ["qwen3.5", "gemma3"])
def test_on_a_hybrid_model_the_one_budget_keeps_the_agent_coming_back(
    hybrid_models, model, policy
):
    """Qwen3.5 (recurrent layers) and Gemma 3 (sliding window) with one byte budget:
    its last step drops the leaf with the lowest stamped priority, so the session that
    ended its turn goes and the agent back from a tool stays; the budget's own order
    drops the older."""
    size = {"qwen3.5": 300 << 10, "gemma3": 420 << 10}[model]
    eng = Engine(hybrid_models[model], page_size=4, cache_bytes=size,
                 max_context_len=1024, eviction_policy=policy)  # fmt: skip
    assert ("session order" in eng.memory_summary()[0]) == (policy == "session")

    run = functools.partial(_serve, eng)

    a, b, c = _prompt(1, 380), _prompt(2, 380), _prompt(3, 560)
    run("A", a, tool=True)
    run("B", b, tool=False)
    assert min(eng.cache.match_len(a), eng.cache.match_len(b)) >= 372  # both held
    run("C", c, tool=False)
    kept = {k: eng.cache.match_len(p) for k, p in (("A", a), ("B", b))}
    victim, keeper = ("B", "A") if policy == "session" else ("A", "B")
    assert kept[keeper] >= 372 and kept[victim] < 372, kept


def test_a_request_naming_no_session_joins_the_one_whose_answer_it_continues():
    """No header, no key: a follow-up whose prompt continues an earlier answer (its
    prompt, then what the model said, then more) is that answer's session, found from
    the tree at admission; an unrelated prompt starts a session of its own."""
    eng = Engine("random", page_size=4, kv_tokens=2048, max_context_len=1024,
                 eviction_policy="session")  # fmt: skip
    finished = {}

    def run(prompt: list[int]) -> tuple[object, list[int]]:
        rid = eng.add_request(prompt, SamplingParams(6, ignore_eos=True), chat=False,
                              session=SessionTag(None))  # fmt: skip
        req = eng.requests[rid]
        while eng.has_unfinished():
            for out in eng.step():
                finished[out.rid] = out
        return req.session.key, list(req.output_ids)

    first, said = run(_prompt(1, 101))
    again, _ = run(_prompt(1, 101) + said + _prompt(9, 30))  # the next turn
    other, _ = run(_prompt(2, 101))
    assert first is not None and again == first and other not in (None, first)
    assert set(eng.sessions.clock.sessions) == {first, other}


def test_a_prefix_its_sessions_shared_and_left_is_unstamped_once_it_is_a_leaf():
    """A shared ancestor keeps the soonest return stamped below it; once its sessions
    went on elsewhere, their old paths were evicted and that return has passed, it is a
    leaf no session owns (before, it kept that stamp, the highest priority there is,
    and was never evicted)."""
    cache, order, add = _tree_order()
    a = add(list(range(100, 140)) + [1] * 8)
    b = add(list(range(100, 140)) + [2] * 8)
    shared = a.parent
    assert shared is b.parent and len(shared) == 40
    for name, node in (("A", a), ("B", b)):
        order.started(name, 0.0)
        order.stopped(name, 1.0, "tool_use", node)
    stale = priority_of(1.0 + DEFAULT_GAP_S["tool_use"])
    assert shared.priority == stale
    for i, name in enumerate("AB"):  # each goes on from elsewhere
        order.started(name, 2.0)
        order.stopped(name, 3.0, "tool_use", add(list(range(500 + 100 * i, 540 + 100 * i))))
    assert a.priority == b.priority == 0 and shared.priority == stale
    order.tick(100.0)
    cache.evict_leaf(a)
    cache.evict_leaf(b)
    assert shared.priority == 0 and not shared.children


def _dump(cache) -> dict[tuple[int, ...], int]:
    """Every cached token's path from the root, with its node's priority."""
    import numpy as np

    out, stack = {}, [(cache.root, ())]
    while stack:
        node, path = stack.pop()
        if node is not cache.root:
            for t in np.frombuffer(node.key_bytes, dtype=np.int64).tolist():
                path = (*path, t)
                out[path] = node.priority
        stack.extend((c, path) for c in node.children.values())
    return out


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_the_session_order_decides_the_same_however_a_path_is_split_into_nodes(data):
    """Two trees get the same sessions' turns, ticks and evictions; one caches each path
    in one insert, the other chunk by chunk (a chain of single-child nodes: how the
    engine computes a prompt). After every step they hold the same tokens at the same
    priorities: where an order's stamps land, what it finds of a session's path once
    part of it was evicted, and when a stale stamp counts as none do not depend on node
    boundaries (else a replay that computes a prompt in one step would not cache what
    the server does: `Scheduler.prefill_run`)."""
    from radixkv import RadixCache, RadixKey
    from radixkv.kvcache.sessions import SessionOrder

    trees = []
    for _ in range(2):
        cache = RadixCache(page_size=1, eviction_policy="session", precise=True)
        trees.append((cache, SessionOrder(cache)))
    history = {s: list(range(1, 9)) for s in range(4)}  # a shared system prompt first
    now, fresh = 0.0, iter(range(100, 10**6))
    for _ in range(data.draw(st.integers(4, 24))):
        op = data.draw(st.sampled_from(["turn", "turn", "tick", "evict"]))
        if op == "turn":
            s = data.draw(st.integers(0, 3))
            h = history[s]
            if data.draw(st.booleans()) and len(h) > 9:  # its next prompt forks below
                h = history[s] = h[: data.draw(st.integers(8, len(h) - 1))]
            if data.draw(st.integers(0, 4)) == 0:  # a sub-agent: another's history
                h = history[s] = list(history[data.draw(st.integers(0, 3))])
            h += [next(fresh) for _ in range(data.draw(st.integers(1, 30)))]
            stop = data.draw(st.sampled_from(["tool_use", "end_turn"]))
            for i, (cache, order) in enumerate(trees):
                order.tick(now)
                order.started(s, now)
                hit = cache.match_len(RadixKey(h))
                for end in range(hit + 4, len(h), 4) if i else ():  # chunk by chunk
                    cache.insert(RadixKey(h[:end]))
                cache.insert(RadixKey(h))
                node = cache.match_prefix(RadixKey(h)).last_node
                order.stopped(s, now + 0.5, stop, node)
            now += 1.0
        elif op == "tick":
            now += data.draw(st.sampled_from([1.0, 5.0, 20.0, 700.0]))
            for _, order in trees:
                order.tick(now)
        else:
            n = data.draw(st.integers(1, 40))
            for cache, order in trees:
                order.tick(now)
                cache.evict(n)
        assert _dump(trees[0][0]) == _dump(trees[1][0])
