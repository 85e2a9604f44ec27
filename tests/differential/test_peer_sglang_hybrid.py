"""The hybrid simulator's ``sglang`` row against SGLang's own `UnifiedRadixCache`, on a
small chat trace under pressure: `benchmarks/peer_sglang_hybrid.py` replays it through
both at each size and exits 1 when a cell differs by more than 0.01. Needs the SGLang
peer's venv (``benchmarks/peers/setup.sh sglang``); skipped without it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.traces import peer_replay

PEER = Path.home() / ".cache" / "radixkv-peers" / "sglang" / "bin" / "python"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not PEER.exists(), reason="no SGLang peer venv (setup.sh sglang)"),
]


def test_the_simulators_sglang_row_equals_sglangs_own_cache(tmp_path):
    out = peer_replay("peer_sglang_hybrid.py", tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    rates = [float(x) for x in re.findall(r"^\s*[\d.]+\s+[\d,]+\s+[\d,]+\s+([\d.]+)", out.stdout,
                                          re.M)]  # fmt: skip
    assert len(rates) == 4 and rates[0] < rates[-1], out.stdout  # pressure, then room
