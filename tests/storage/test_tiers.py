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
