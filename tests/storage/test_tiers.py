"""Tiers, simulated: device + host + shared hits add up to what single caches give."""

from __future__ import annotations

import json

import pytest
from support.traces import random_trace

from radixkv.cli import main
from radixkv.sim.replay import reuse_ceiling, simulate
from radixkv.sim.tiers import simulate_tiers


@pytest.mark.parametrize("seed", range(3))
def test_tiers_agree_with_single_caches(seed):
    trace = random_trace(seed, requests=300)
    for device in (3, 8, 20):
        alone = simulate_tiers(trace, device, 0, shared=False)
        assert alone.hit_tokens == simulate(trace, device, "lru").hit_tokens
        assert alone.host_hit_tokens == alone.shared_hit_tokens == 0
        everything = simulate_tiers(trace, device, 5, shared=True)
        assert everything.rate(everything.hit_tokens) == pytest.approx(reuse_ceiling(trace))
        for host in (5, 20, 60):
            tiered = simulate_tiers(trace, device, host, shared=False)
            assert tiered.device_hit_tokens == alone.device_hit_tokens  # the device is as before
            more = simulate_tiers(trace, device, host + 20, shared=False)
            assert more.hit_tokens >= tiered.hit_tokens - 0  # a bigger host tier never hurts
            # never more than an unbounded cache: every hit was computed before
            assert tiered.rate(tiered.hit_tokens) <= reuse_ceiling(trace) + 1e-12


def test_tiers_command(tmp_path, capsys):
    out = tmp_path / "t.json"
    argv = ["simulate", "--workload", "multi-turn", "--requests", "200", "--tiers", "--capacity",
            "4k", "--host-capacity", "0,8k,32k", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["host_units"] for r in rows] == [0, 500, 2000]
    assert rows[0]["host_hit_rate"] == 0 and rows[2]["host_hit_rate"] > 0
    assert main([*argv[:8], "--host-capacity", "inf"]) == 2
    assert "error: --host-capacity" in capsys.readouterr().err


def test_a_context_longer_than_the_device_is_written_to_the_host_not_dropped():
    """An agent's context outgrows the device: its head stays there, the rest is written
    to the host tier as it is computed, so the next turn hits all of it (it used to hit
    the head only); the load time is its host tokens over the link."""
    from radixkv.sim.traces import SimRequest, Trace

    first = list(range(100))
    turns = [SimRequest(first, 100, 100), SimRequest([*first, 100, 101], 102, 102)]
    trace = Trace("agent", 1, turns)
    alone = simulate_tiers(trace, 40, 0, shared=False)
    assert alone.hit_tokens == 40  # the device's head only
    tiered = simulate_tiers(trace, 40, 200, shared=False)
    assert (tiered.device_hit_tokens, tiered.host_hit_tokens) == (40, 60)
    assert tiered.spilled_tokens == 60 + 62 and tiered.host_hit_requests == 1
    assert tiered.load_seconds(1000, 1e6) == pytest.approx(60 * 1000 / 1e6)


def test_the_tiers_command_reports_the_load_time(capsys):
    argv = ["simulate", "--workload", "multi-turn", "--requests", "200", "--tiers", "--capacity",
            "2k", "--host-capacity", "32k", "--no-shared", "--bytes-per-token", "1000",
            "--host-bandwidth", "1"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "requests loaded from the host" in out and "(1 GB/s, 1,000 bytes a token)" in out
    with pytest.raises(SystemExit) as e:  # (argparse's exit for a bad value: 2)
        main([*argv[:-1], "0"])
    assert e.value.code == 2 and "--host-bandwidth: must be GB/s > 0" in capsys.readouterr().err
