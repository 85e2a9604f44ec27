"""The hybrid simulator's ``vllm`` row (`radixkv.sim.vllm_pool`) against vLLM's own
`KVCacheManager` (hybrid coordinator, align mode), on a small chat trace under pressure,
outputs cached and not: `benchmarks/peer_vllm_hybrid.py` replays it through both at each
size and exits 1 when a cell differs by more than 0.01 or only one of them refuses a
size. Needs the vLLM peer's venv (``benchmarks/peers/setup.sh vllm``); skipped without
it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.traces import peer_replay

PEER = Path.home() / ".cache" / "radixkv-peers" / "vllm" / "bin" / "python"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not PEER.exists(), reason="no vLLM peer venv (setup.sh vllm)"),
]


@pytest.mark.parametrize("outputs", [[], ["--no-outputs"]])
def test_the_simulators_vllm_row_equals_vllms_own_manager(tmp_path, outputs):
    out = peer_replay("peer_vllm_hybrid.py", tmp_path, *outputs)
    assert out.returncode == 0, out.stdout + out.stderr
    rates = [float(x) for x in re.findall(r"^\s*[\d.]+\s+[\d,]+\s+([\d.]+)\s", out.stdout, re.M)]
    assert len(rates) >= 3 and rates[0] < rates[-1], out.stdout  # pressure, then room
