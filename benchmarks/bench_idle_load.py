"""How long a request arriving at an idle server waits behind a load ahead
(`radixkv.engine.ahead`): the longest single `Engine.idle` call while a waiting agent's
path comes back from the host tier, with the calls capped at `IDLE_CHUNKS` chunks (now)
and uncapped (a whole path per call, as before), interleaved.

The model is a random Llama whose KV is an 8B model's size per token (8 layers x 32 KV
heads x 64 dims x K and V x fp32 = 128 KiB), tiny otherwise, so its prompts compute on
a CPU; agent A's 4,096-token path (512 MiB of KV) is pushed to the host by D, then the
engine idles until A is back on the device.

    python benchmarks/bench_idle_load.py [--runs 3] [--chunk 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import radixkv.engine.ahead as ahead
from radixkv.engine.engine import Engine
from radixkv.engine.models.llama import ModelConfig
from radixkv.engine.request import SamplingParams, SessionTag

CFG = ModelConfig(hidden_size=64, num_attention_heads=32, num_key_value_heads=32, head_dim=64,
                  num_hidden_layers=8, intermediate_size=128)  # fmt: skip
PATH = 4096


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 131 + i * 7) % 250 + 3 for i in range(n)]


def one(chunks: int | None, chunk: int) -> tuple[float, float, int, int]:
    """(longest idle call s, all idle calls s, calls, tokens loaded) with ``chunks`` chunks
    a call (None: uncapped)."""
    now = [0.0]
    eng = Engine(CFG, page_size=16, kv_tokens=PATH + 1024, host_tokens=2 * PATH,
                 max_context_len=PATH + 64, eviction_policy="session", prefetch_within=60.0,
                 chunk_size=chunk, clock=lambda: now[0])  # fmt: skip
    for key, ids, tool in (("A", prompt(1, PATH), True), ("D", prompt(2, PATH), False)):
        eng.add_request(ids, SamplingParams(2, ignore_eos=True), chat=False,
                        session=SessionTag(key, lambda _t, _i, tool=tool: tool))  # fmt: skip
        while eng.has_unfinished():
            eng.step()
        now[0] += 1.0
    if chunks is None:  # (as before the cap: `run` with no cap loads all that fits)
        run = eng.ahead.run
        eng.ahead.run = lambda now, cap=None, keep=0: run(now)  # type: ignore[method-assign]
    longest = total = 0.0
    calls = loaded = 0
    while True:
        t0 = time.perf_counter()
        n = eng.idle()
        dt = time.perf_counter() - t0
        if not n:
            break
        longest, total, calls, loaded = max(longest, dt), total + dt, calls + 1, loaded + n
    return longest, total, calls, loaded


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=64, help="the engine's chunk size")
    ap.add_argument("--one", choices=["capped", "uncapped"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    default = ahead.IDLE_CHUNKS
    if args.one:  # one run, in a process of its own (a process that freed an earlier
        # run's pools pays for their memory again: 0.7 s against 2.3 s, the same load)
        print(json.dumps(one(default if args.one == "capped" else None, args.chunk)))
        return
    rows: dict[str, list] = {"capped": [], "uncapped": []}
    for _ in range(args.runs):  # interleaved, each in a fresh process
        for name in rows:
            cmd = [sys.executable, __file__, "--one", name, "--chunk", str(args.chunk)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True)
            rows[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    kib = CFG.num_hidden_layers * CFG.num_key_value_heads * CFG.head_dim * 2 * 4 / 1024
    print(f"KV {kib:.0f} KiB a token; chunk {args.chunk}; {args.runs} interleaved runs")
    print("| idle calls | tokens loaded | calls | longest call, ms: median (range) "
          "| all calls, ms: median (range) |")
    print("|---|---|---|---|---|")
    for name, rs in rows.items():
        longest = [r[0] * 1e3 for r in rs]
        total = [r[1] * 1e3 for r in rs]
        cap = f"{default} chunks ({default * args.chunk} tokens)" if rs is rows["capped"] else name
        print(f"| {cap} | {rs[0][3]:,} | {rs[0][2]} | {statistics.median(longest):.1f} "
              f"({min(longest):.1f}-{max(longest):.1f}) | {statistics.median(total):.1f} "
              f"({min(total):.1f}-{max(total):.1f}) |")


if __name__ == "__main__":
    main()
