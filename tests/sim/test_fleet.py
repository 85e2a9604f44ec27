"""The fleet simulator in time (`radixkv.sim.fleet`): real engines on a clock, the
shipped routing core, and SGLang's ``cache_aware`` as its source decides."""

from __future__ import annotations

import itertools
from array import array

import pytest

from radixkv.sim.fleet import (
    CacheAware,
    Conversation,
    StepCost,
    chat_turns,
    routing_text,
    simulate_fleet,
    trace_turns,
)

PAGE = 16


def _conversations(n: int, turns: int, words: int = 40) -> list[Conversation]:
    return [
        Conversation(
            [
                f"user {c} turn {t}: " + " ".join(f"w{c}{t}{i}" for i in range(words))
                for t in range(turns)
            ]
        )
        for c in range(n)
    ]


@pytest.fixture(scope="module")
def turns():
    return chat_turns(_conversations(6, 3), max_tokens=8)


def test_turns_carry_the_answers(turns):
    """Each turn's prompt starts with the previous turn's prompt and then its answer
    (the byte tokenizer re-encodes the answer's text as the model's tokens here)."""
    for conv in turns:
        for prev, turn in itertools.pairwise(conv):
            assert turn.prompt[: len(prev.prompt)] == prev.prompt
            assert len(prev.output) == 8
            assert prev.text in turn.text and len(turn.text) > len(prev.text)


def _expected_cached(conv) -> int:
    """A brute-force count of one conversation's cached prompt tokens on one replica
    with room for everything: each turn finds the previous turn's prompt and answer but
    its last token (never computed), in whole pages, at most its own prompt but one."""
    total = 0
    for prev, turn in itertools.pairwise(conv):
        seen = prev.prompt + prev.output[:-1]
        common = 0
        while common < min(len(seen), len(turn.prompt)) and seen[common] == turn.prompt[common]:
            common += 1
        total += min(common, len(turn.prompt) - 1) // PAGE * PAGE
    return total


@pytest.mark.parametrize("router", ["kv", "cache_aware", "least_load", "approx"])
def test_one_replica_with_room_caches_every_history(turns, router):
    r = simulate_fleet(turns, replicas=1, kv_tokens=1 << 16, router=router, concurrency=4)
    assert r.requests == 18 and r.per_replica == [18]
    assert r.prompt_tokens == sum(len(t.prompt) for c in turns for t in c)
    assert r.cached_tokens == sum(_expected_cached(c) for c in turns)
    assert r.routing_captured_rate == r.fleet_available_rate == r.token_hit_rate


def test_sticky_routers_keep_each_conversation_on_one_replica(turns):
    """With room everywhere, kv and cache_aware get every history's hit; round robin
    scatters four conversations over three replicas and loses some."""
    four = turns[:4]
    best = sum(_expected_cached(c) for c in four)
    for router in ("kv", "cache_aware"):
        r = simulate_fleet(four, replicas=3, kv_tokens=1 << 16, router=router, concurrency=4)
        assert r.cached_tokens == best, router
    rr = simulate_fleet(four, replicas=3, kv_tokens=1 << 16, router="round_robin",
                        concurrency=4)  # fmt: skip
    assert rr.cached_tokens < best


def test_memory_pressure_evicts_and_lowers_hits(turns):
    """One turn at a time, a pool that holds the longest request but not the other
    conversations' histories: each conversation's history is gone by its next turn."""
    need = max(len(t.prompt) + len(t.output) for c in turns for t in c)
    pool = -(-need // PAGE) * PAGE + PAGE
    roomy = simulate_fleet(turns, replicas=1, kv_tokens=1 << 16, router="kv", concurrency=1)
    tight = simulate_fleet(turns, replicas=1, kv_tokens=pool, router="kv", concurrency=1)
    assert roomy.cached_tokens == sum(_expected_cached(c) for c in turns)
    assert tight.cached_tokens < roomy.cached_tokens / 2
    assert tight.requests == roomy.requests  # every request still served


def test_time_follows_the_step_cost(turns):
    slow = simulate_fleet(turns, 2, 1 << 16, "kv", 4, StepCost(0.01, 1e-4, 1e-3))
    fast = simulate_fleet(turns, 2, 1 << 16, "kv", 4, StepCost(0.001, 1e-5, 1e-4))
    assert slow.duration_s > 5 * fast.duration_s
    assert slow.ttft_p50_s > fast.ttft_p50_s > 0


def test_the_wire_delays_every_answer_and_jitter_follows_its_seed(turns):
    wired = simulate_fleet(turns, 2, 1 << 16, "kv", 4, wire_s=0.05)
    assert min(wired.ttft_p50_s, wired.ttft_p90_s) >= 0.1  # there and back
    cost = StepCost(0.004, 2e-5, 3e-4, jitter=0.5)
    a, b = (simulate_fleet(turns, 2, 1 << 16, "kv", 4, cost, seed=s) for s in (1, 2))
    assert simulate_fleet(turns, 2, 1 << 16, "kv", 4, cost, seed=1) == a  # deterministic
    assert a.duration_s != b.duration_s


def test_bad_arguments_are_refused(turns):
    with pytest.raises(ValueError, match="router"):
        simulate_fleet(turns, router="nope")
    with pytest.raises(ValueError, match="replicas"):
        simulate_fleet(turns, replicas=0)
    with pytest.raises(ValueError, match="event_lag_s"):
        simulate_fleet(turns, event_lag_s=-1)
    with pytest.raises(ValueError, match="wire_s"):
        simulate_fleet(turns, wire_s=float("nan"))
    for bad in (-0.1, 1.5, float("nan"), True, "0.5"):
        with pytest.raises(ValueError, match="release_race"):
            simulate_fleet(turns, release_race=bad)


def test_a_release_heard_late_counts_as_load_when_the_next_turn_is_routed(turns):
    """One conversation, one request at a time, two replicas, least_load: heard first,
    the answer's end leaves both replicas idle and the next turn goes back to the first
    (the tie's winner), where its history is; heard only after the next request, the
    first replica still counts the answer and the next turn goes to the other."""
    one = [turns[0][:2]]
    first = simulate_fleet(one, 2, 1 << 16, "least_load", 1, release_race=0.0)
    late = simulate_fleet(one, 2, 1 << 16, "least_load", 1, release_race=1.0)
    assert first.per_replica == [2, 0] and first.cached_tokens == _expected_cached(one[0]) > 0
    assert late.per_replica == [1, 1] and late.cached_tokens == 0


# --- SGLang's cache_aware ----------------------------------------------------------------
def test_cache_aware_sends_new_text_to_the_least_loaded_worker_and_keeps_continuations():
    """SGLang router 0.3.2: a text nothing matches goes to the least loaded worker,
    ties to the first in the router's order (the workers' registration order), so new
    prompts sent one at a time all land on one worker (as measured live); a
    continuation matching more than 0.3 of its text sticks, whatever the loads."""
    ca = CacheAware(3, lambda: 0.0, order=[2, 0, 1])
    first = [ca.choose(t) for t in ("a" * 100, "b" * 50, "c" * 10)]
    assert [c.worker_name for c in first] == [2, 0, 1]  # each time the least loaded
    first[0].release()
    assert ca.choose("d" * 10).worker_name == 2
    for c in first[1:]:
        c.release()
    assert ca.loads == [0, 0, 1]
    for t in ("e" * 30, "f" * 30, "g" * 30):  # one at a time: every one to worker 0
        c = ca.choose(t)
        assert c.worker_name == 0
        c.release()
    assert ca.choose("a" * 100 + "x" * 40).worker_name == 2  # 100 of 140 matched
    assert ca.choose("b" * 15 + "y" * 35).worker_name == 0  # 15 of 50: the least loaded
    with pytest.raises(ValueError, match="order"):
        CacheAware(3, lambda: 0.0, order=[0, 0, 1])


def test_cache_aware_balances_only_past_both_thresholds():
    ca = CacheAware(2, lambda: 0.0, balance_abs=3, balance_rel=1.5)
    charges = [ca.choose("q" * 20) for _ in range(4)]  # all on worker 0: it matches
    assert {c.worker_name for c in charges} == {0}
    assert ca.loads == [4, 0]
    assert ca.choose("q" * 20).worker_name == 1  # 4 - 0 > 3 and 4 > 0 x 1.5
    for c in charges:
        c.release()
        c.release()  # once only
    assert ca.loads == [0, 1]


def test_cache_aware_trees_are_cut_on_its_interval():
    now = [0.0]
    ca = CacheAware(1, lambda: now[0], eviction_interval_s=60, max_tree_size=30)
    ca.choose("a" * 40)
    assert ca.trees[0].total_size() == 40
    now[0] = 59.0
    ca.choose("b" * 5)
    assert ca.trees[0].total_size() == 45  # not yet
    now[0] = 61.0
    ca.choose("c" * 5)
    assert ca.trees[0].total_size() <= 30 + 5


def test_routing_text_is_the_contents_joined():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": " ok "}, {"role": "assistant", "content": ""},
            {"role": "user", "content": "more"}]  # fmt: skip
    assert routing_text(msgs) == "be brief hi ok more"


def test_open_loop_arrivals_far_apart_equal_one_at_a_time(turns):
    """Each turn sent at its own time, long after the one before has been answered and
    in the order a client one request at a time sends them: the same hits."""
    n = len(turns)
    arrivals = [[(t * n + c) * 10.0 for t in range(len(conv))] for c, conv in enumerate(turns)]
    closed = simulate_fleet(turns, replicas=1, kv_tokens=2048, router="kv", concurrency=1)
    opened = simulate_fleet(turns, replicas=1, kv_tokens=2048, router="kv", arrivals=arrivals)
    assert opened.cached_tokens == closed.cached_tokens
    assert opened.duration_s > (3 * n - 1) * 10.0
    with pytest.raises(ValueError, match="arrivals"):
        simulate_fleet(turns, arrivals=arrivals[:-1])
    with pytest.raises(ValueError, match="arrivals"):
        simulate_fleet(turns, arrivals=[[-1.0] * len(c) for c in turns])


def test_a_token_trace_runs_at_its_timestamps():
    from radixkv.sim.traces import SimRequest, Trace

    shared = list(range(1, 200))
    reqs = [
        SimRequest(
            [],
            0,
            260,
            timestamp=i * 50.0,
            output_tokens=4,
            prompt_ids=array("q", shared + [300 + i] * 61),
        )
        for i in range(6)
    ]
    tt = trace_turns(Trace("t", 16, reqs))
    assert [a[0] for a in tt.arrivals] == [i * 50.0 / 1000.0 for i in range(6)]
    assert tt.turns[0][0].text.startswith("1 2 3")
    for router in ("kv", "cache_aware"):
        r = simulate_fleet(tt.turns, replicas=2, kv_tokens=4096, router=router,
                           arrivals=tt.arrivals)  # fmt: skip
        assert r.requests == 6 and r.cached_tokens > 0  # the shared 192 tokens, found again


def test_a_turn_the_engine_refuses_is_named():
    from radixkv.sim.traces import SimRequest, Trace

    bad = SimRequest([], 0, 3, output_tokens=1, prompt_ids=array("q", [1, 2, 10_000]))
    tt = trace_turns(Trace("t", 16, [bad]))
    with pytest.raises(ValueError, match=r"conversation 0, turn 0: token ids must lie"):
        simulate_fleet(tt.turns, replicas=1, kv_tokens=4096, arrivals=tt.arrivals)
