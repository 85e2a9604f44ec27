"""The hybrid simulator's ``sglang`` row against SGLang's own `UnifiedRadixCache`, on a
small chat trace under pressure: `benchmarks/peer_sglang_hybrid.py` replays it through
both at each size and exits 1 when a cell differs by more than 0.01. Needs the SGLang
peer's venv (``benchmarks/peers/setup.sh sglang``); skipped without it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.traces import marconi_chats

ROOT = Path(__file__).resolve().parents[2]
PEER = Path.home() / ".cache" / "radixkv-peers" / "sglang" / "bin" / "python"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not PEER.exists(), reason="no SGLang peer venv (setup.sh sglang)"),
]


def test_the_simulators_sglang_row_equals_sglangs_own_cache(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"name": "small-hybrid", "full_layers": 4, "kv_bytes": 16384,
                                "recurrent_layers": 24, "state_bytes": 1116160,
                                "params": 7e9, "attn_dim": 4096}))  # fmt: skip
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "peer_sglang_hybrid.py"),
         "--trace", str(marconi_chats(tmp_path / "chats.jsonl")), "--model-spec", str(spec),
         "--sizes", "0.3,0.6,1.5,4"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    rates = [float(x) for x in re.findall(r"^\s*[\d.]+\s+[\d,]+\s+[\d,]+\s+([\d.]+)", out.stdout,
                                          re.M)]  # fmt: skip
    assert len(rates) == 4 and rates[0] < rates[-1], out.stdout  # pressure, then room
