"""Random traces for the simulator's tests."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from radixkv.sim.traces import (
    Interner,
    SimRequest,
    Trace,
)


def random_trace(seed: int, requests: int = 120) -> Trace:
    """Prefix-closed unit sequences drawn from a small random tree of prompts."""
    rng = random.Random(seed)
    interner = Interner()
    stems = [[rng.randrange(4) for _ in range(rng.randrange(1, 6))] for _ in range(5)]
    trace = Trace(f"random{seed}", 1)
    for _ in range(requests):
        toks = rng.choice(stems) + [rng.randrange(3) for _ in range(rng.randrange(0, 5))]
        units = interner.units(toks, 1)
        trace.requests.append(SimRequest(units, len(units), len(toks)))
    return trace


def marconi_chats(path: Path, sessions: int = 40, seed: int = 3) -> Path:
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


# a small hybrid (4 attention : 24 recurrent layers, Marconi's 7B's shapes)
SMALL_HYBRID = {"name": "small-hybrid", "full_layers": 4, "kv_bytes": 16384,
                "recurrent_layers": 24, "state_bytes": 1116160, "params": 7e9,
                "attn_dim": 4096}  # fmt: skip


def peer_replay(script: str, tmp_path: Path, *extra: str) -> Any:
    """``benchmarks/<script>`` on `marconi_chats` and `SMALL_HYBRID` at 0.3 / 0.6 / 1.5 /
    4 GB (pressure, then room): the finished process."""
    import subprocess
    import sys

    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SMALL_HYBRID))
    script_path = Path(__file__).resolve().parents[2] / "benchmarks" / script
    return subprocess.run(
        [sys.executable, str(script_path), "--trace", str(marconi_chats(tmp_path / "c.jsonl")),
         "--model-spec", str(spec), "--sizes", "0.3,0.6,1.5,4", *extra],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
