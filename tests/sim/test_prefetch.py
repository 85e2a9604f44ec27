"""Loading a waiting session's pages ahead of its predicted return (`radixkv.sim.prefetch`,
``simulate --tiers --prefetch-within``): what comes back early is a device hit instead
of a load on arrival, the link never does more than its idle time allows, nothing is
loaded for an answer that has not ended, and under the session order a load ahead
never evicts what is predicted back sooner."""

from __future__ import annotations

import json
import math
import random

import pytest

from radixkv.cli import main
from radixkv.sim.prefetch import Prefetch
from radixkv.sim.sessions import SessionOrder
from radixkv.sim.tiers import Ahead, simulate_tiers
from radixkv.sim.traces import SimRequest, Trace


def agents(seed: int, sessions: int = 6, turns: int = 8) -> Trace:
    """Sessions whose every turn extends the last one's prompt (an agent's loop),
    closed-loop in time: a think gap after each answer, short after ``tool_use``."""
    rng = random.Random(seed)
    reqs, next_unit = [], 0
    for s in range(sessions):
        t, prompt = rng.uniform(0, 5000), []
        for _ in range(turns):
            grow = rng.randint(2, 12)
            prompt = prompt + list(range(next_unit, next_unit + grow))
            next_unit += grow
            stop = rng.choice(["tool_use", "tool_use", "end_turn"])
            dur = rng.uniform(200, 2000)
            reqs.append(SimRequest(list(prompt), len(prompt), len(prompt), timestamp=t,
                                   session=s, stop=stop, duration_ms=dur))  # fmt: skip
            t += dur + (rng.uniform(500, 3000) if stop == "tool_use" else rng.uniform(5e3, 6e4))
    reqs.sort(key=lambda r: r.timestamp)
    return Trace(f"agents-{seed}", 1, reqs)


def test_a_session_back_from_a_tool_call_finds_its_pages_on_the_device():
    """A's context (60 tokens) is pushed to the host by B; A stopped on tool_use, so
    while B's answer runs the link brings A's pages back, and A's return hits them on
    the device: no load when it arrives. The total hit is the same."""
    a1 = SimRequest(list(range(60)), 60, 60, timestamp=0.0, session="A", stop="tool_use",
                    duration_ms=1000.0)  # fmt: skip
    b1 = SimRequest(list(range(100, 160)), 60, 60, timestamp=1500.0, session="B",
                    stop="end_turn", duration_ms=1000.0)  # fmt: skip
    a2 = SimRequest([*range(60), 60, 61], 62, 62, timestamp=9000.0, session="A")
    trace = Trace("two", 1, [a1, b1, a2])
    plain = simulate_tiers(trace, 60, 1000, shared=False)
    assert (plain.device_hit_tokens, plain.host_hit_tokens) == (0, 60)
    ahead = simulate_tiers(trace, 60, 1000, shared=False, ahead=Ahead(1.0, 60_000.0))
    assert (ahead.device_hit_tokens, ahead.host_hit_tokens) == (60, 0)
    assert ahead.prefetched_tokens == 60 and ahead.hit_tokens == plain.hit_tokens
    # a link too slow to move a page in the idle time loads nothing ahead
    slow = simulate_tiers(trace, 60, 1000, shared=False, ahead=Ahead(1e-4, 60_000.0))
    assert slow.prefetched_tokens == 0 and slow.host_hit_tokens == 60
    # a session predicted back beyond the horizon waits for its request (A's first gap:
    # the engine's default after tool_use, 10 s)
    far = simulate_tiers(trace, 60, 1000, shared=False, ahead=Ahead(1.0, 1.0))
    assert far.prefetched_tokens == 0


@pytest.mark.parametrize("seed", range(6))
def test_loads_ahead_use_only_the_links_idle_time_and_only_ended_answers(seed):
    trace = agents(seed)
    ends = {}  # session -> end of its latest request that arrived
    rate = 0.01
    pf = Prefetch(rate, 20_000.0, 1, None, False)
    calls: list[tuple[float, object, int]] = []
    now = [0.0]

    def load(session, units, most):
        # its answer ended (its stop reason is known), and the link's time for it
        # starts then
        assert 0 <= most <= (now[0] - ends[session]) * rate
        got = min(most, len(units))
        calls.append((now[0], session, got))
        return got

    for r in trace.requests:
        now[0] = r.timestamp
        pf.arrive(r, load)
        ends[r.session] = r.timestamp + r.duration_ms
        pf.loaded(r.timestamp, 3)  # every request loads 3 tokens when it arrives
    moved = sum(g for _, _, g in calls)
    assert moved == pf.tokens_ahead
    last = trace.requests[-1].timestamp
    arrivals_busy = 3 / rate * len(trace.requests)
    assert moved <= rate * last  # the link's whole time bounds it
    assert moved / rate + arrivals_busy <= pf.link_free + 1e-6  # one load at a time
    assert pf.link_free <= last + arrivals_busy + 1e-6


@pytest.mark.parametrize("seed", range(6))
def test_loading_ahead_moves_host_hits_to_the_device_and_keeps_the_total(seed):
    trace = agents(seed)
    for policy in ("lru", "session"):
        plain = simulate_tiers(trace, 40, 2000, shared=False, policy=policy)
        ahead = simulate_tiers(trace, 40, 2000, shared=False, policy=policy,
                               ahead=Ahead(0.05, 30_000.0))  # fmt: skip
        # a host large enough that nothing is lost: the total is the same either way
        assert ahead.hit_tokens == plain.hit_tokens
        assert ahead.prefetched_tokens > 0
        assert ahead.host_hit_tokens < plain.host_hit_tokens
        assert ahead.device_hit_tokens > plain.device_hit_tokens


def test_a_load_ahead_under_the_session_order_evicts_only_later_returns():
    """``evict(after=...)`` stops at the first leaf predicted back sooner."""
    from array import array

    from radixkv.key import RadixKey
    from radixkv.tree import RadixCache

    order = SessionOrder()
    soon = SimRequest([1, 2, 3], 3, 3, timestamp=0.0, session="soon", stop="tool_use",
                      duration_ms=10.0)  # fmt: skip
    late = SimRequest([7, 8, 9], 3, 3, timestamp=1.0, session="late", stop="end_turn",
                      duration_ms=10.0)  # fmt: skip
    cache = RadixCache(page_size=1)
    for r in (soon, late):
        order.arrive(r)
        cache.insert(RadixKey(array("q", r.units)))
    order.now = 100.0  # both answers ended: soon back in ~10 s, late in ~10 min
    assert order.predicted("soon") < order.predicted("late")
    between = (order.predicted("soon") + order.predicted("late")) / 2
    assert order.evict(cache, 6, after=between) == 3  # late only
    assert cache.match_len(RadixKey(array("q", [1, 2, 3]))) == 3
    assert order.evict(cache, 3, after=between) == 0  # soon returns before ``between``


def test_the_prefetch_flag(tmp_path, capsys):
    doc = {"id": "x", "block_size": 64, "hash_id_scope": "local", "tool_tokens": 64,
           "system_tokens": 64, "requests": [
               {"t": 0.0, "type": "s", "in": 64 * k, "out": 10, "hash_ids": list(range(k)),
                "stop": "tool_use", "api_time": 1.0, "think_time": 2.0}
               for k in range(2, 12)]}  # fmt: skip
    (tmp_path / "traces").mkdir()
    for i in range(4):
        (tmp_path / "traces" / f"c{i}.json").write_text(json.dumps(doc))
    out = tmp_path / "r.json"
    argv = ["simulate", "--trace", str(tmp_path / "traces"), "--format", "agentic",
            "--capacity", "1k", "--tiers", "--host-capacity", "64k", "--no-shared",
            "--bytes-per-token", "1000", "--policy", "lru,session", "--json", str(out)]  # fmt: skip
    assert main([*argv, "--prefetch-within", "30"]) == 0
    text = capsys.readouterr().out
    assert "tokens loaded ahead of their session's return" in text
    rows = json.loads(out.read_text())["results"]
    assert [r["policy"] for r in rows] == ["lru", "session"]
    assert all(r["prefetched_tokens"] > 0 for r in rows)
    assert main(argv) == 0
    assert all(r["prefetched_tokens"] == 0 for r in json.loads(out.read_text())["results"])
    capsys.readouterr()
    for bad, err in (
        ([*argv[:7], "--prefetch-within", "30"], "--prefetch-within: only with --tiers"),
        ([*argv[:7], "--host-capacity", "4k"], "--host-capacity: only with --tiers"),
        ([*argv[:11], "--prefetch-within", "30"], "--prefetch-within: give --model or"),
        ([*argv, "--policy", "lfu"], "--policy: with --tiers the device's order is lru or"),
        (["simulate", "--workload", "multi-turn", "--requests", "50", "--tiers",
          "--capacity", "2k", "--host-capacity", "8k", "--bytes-per-token", "1000",
          "--prefetch-within", "5"], "--prefetch-within: the trace has no sessions"),
    ):  # fmt: skip
        assert main(bad) == 2, bad
        assert f"error: {err}" in capsys.readouterr().err
    for bad, err in (  # (argparse's own exit for a value out of range: 2)
        ([*argv, "--prefetch-within", "inf"], "argument --prefetch-within: must be seconds"),
        ([*argv, "--prefetch-within", "5", "--host-bandwidth", "inf"],
         "argument --host-bandwidth: must be GB/s > 0 up to"),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            main(bad)
        assert e.value.code == 2 and err in capsys.readouterr().err


@pytest.mark.parametrize(("rate", "horizon"), [(0.0, 1.0), (math.inf, 1.0), (1.0, math.nan),
                                               (1.0, math.inf)])  # fmt: skip
def test_a_link_or_horizon_out_of_range_is_refused(rate, horizon):
    with pytest.raises(ValueError, match="rate and horizon must be finite and > 0"):
        Prefetch(rate, horizon, 1, None, False)
