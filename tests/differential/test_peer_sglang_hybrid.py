"""The hybrid simulator's ``sglang`` row against SGLang's own `UnifiedRadixCache`, on a
small chat trace under pressure: `benchmarks/peer_sglang_hybrid.py` replays it through
both at each size and exits 1 when a cell differs by more than 0.01. Needs the SGLang
peer's venv (``benchmarks/peers/setup.sh sglang``); skipped without it."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PEER = Path.home() / ".cache" / "radixkv-peers" / "sglang" / "bin" / "python"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not PEER.exists(), reason="no SGLang peer venv (setup.sh sglang)"),
]


def chats(path: Path, sessions: int = 40, seed: int = 3) -> Path:
    """Chats in Marconi's format: 4 system prompts, 2-5 turns a session, a few sessions
    live at a time (their turns interleaved), each turn's input the whole history."""
    rng = random.Random(seed)
    fresh = iter(range(1000, 10**9))
    systems = [[next(fresh) for _ in range(rng.randint(100, 400))] for _ in range(4)]
    live, rows, ts = [], [], 0.0
    todo = [(s, rng.choice(systems), rng.randint(2, 5)) for s in range(sessions)]
    while todo or live:
        while todo and len(live) < 5:
            sid, system, turns = todo.pop()
            live.append([sid, list(system), turns, 0])
        chat = rng.choice(live)
        sid, history, turns, turn = chat
        inp = history + [next(fresh) for _ in range(rng.randint(20, 150))]
        out = [next(fresh) for _ in range(rng.randint(30, 200))]
        ts += 1.0
        rows.append({"session_id": sid, "turn_id": turn, "ts": ts, "input_tokens": inp,
                     "output_tokens": out, "num_input_tokens": len(inp),
                     "num_output_tokens": len(out)})  # fmt: skip
        chat[1], chat[3] = inp + out, turn + 1
        if chat[3] == turns:
            live.remove(chat)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_simulators_sglang_row_equals_sglangs_own_cache(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"name": "small-hybrid", "full_layers": 4, "kv_bytes": 16384,
                                "recurrent_layers": 24, "state_bytes": 1116160,
                                "params": 7e9, "attn_dim": 4096}))  # fmt: skip
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "peer_sglang_hybrid.py"),
         "--trace", str(chats(tmp_path / "chats.jsonl")), "--model-spec", str(spec),
         "--sizes", "0.3,0.6,1.5,4"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    rates = [float(x) for x in re.findall(r"^\s*[\d.]+\s+[\d,]+\s+[\d,]+\s+([\d.]+)", out.stdout,
                                          re.M)]  # fmt: skip
    assert len(rates) == 4 and rates[0] < rates[-1], out.stdout  # pressure, then room
