"""The session clock (an agent's return predicted from its stop reasons and gaps) and the
``session`` eviction order it gives the engine's tree: an agent that stopped on a tool
call is kept over a session whose person ended the turn, which LRU evicts the other way
round."""

from __future__ import annotations

import pytest

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


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 131 + i * 7) % 250 + 3 for i in range(n)]


@pytest.mark.parametrize("policy", ["session", "lru"])
def test_the_agent_coming_back_is_kept_over_the_person_who_left(policy):
    """A and B each cache ~1/3 of the pool; A's answer called a tool, B's ended the
    turn, B after A. A third session's prompt then needs room: LRU evicts A (the older),
    the session order evicts B (its person is predicted back in minutes, A in seconds)."""
    eng = Engine("random", page_size=4, kv_tokens=1200, max_context_len=1024,
                 eviction_policy=policy, prefix_cache=True)  # fmt: skip

    def run(key: str, prompt: list[int], tool: bool) -> None:
        tag = SessionTag(key, lambda _text, _ids: tool)
        eng.add_request(prompt, SamplingParams(2, ignore_eos=True), chat=False, session=tag)
        while eng.has_unfinished():
            eng.step()

    a, b, c = _prompt(1, 380), _prompt(2, 380), _prompt(3, 560)
    run("A", a, tool=True)
    run("B", b, tool=False)
    run("C", c, tool=False)
    kept = {k: eng.cache.match_len(p) for k, p in (("A", a), ("B", b))}
    victim, keeper = ("B", "A") if policy == "session" else ("A", "B")
    assert kept[keeper] == 380 and kept[victim] < 380, kept


def test_a_hybrid_model_refuses_the_session_order_rather_than_ignore_it(hybrid_models, capsys):
    from radixkv.cli import main

    with pytest.raises(ValueError, match="eviction_policy session"):
        Engine(hybrid_models["qwen3.5"], eviction_policy="session")
    code = main(["serve", "--port", "0", "--model", hybrid_models["gemma3"],
                 "--eviction-policy", "session"])  # fmt: skip
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

    def run(key: str, prompt: list[int], tool: bool) -> int:
        tag = SessionTag(key, lambda _text, _ids: tool)
        rid = eng.add_request(prompt, SamplingParams(2, ignore_eos=True), chat=False,
                              session=tag)  # fmt: skip
        while eng.has_unfinished():
            eng.step()
        return rid

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
