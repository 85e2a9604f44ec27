"""Prompt-cache retention under many pins: what retention work costs the engine's step.

The setup of the hardening issue, in process (the engine's own thread, no HTTP between):
the tiny random model, page 1, the serve defaults' pool (65,536 tokens), ``--pins``
small prompts each retained for 24 h (``prompt_cache_retention: "24h"``: a `CacheSpec`
pin of the whole prompt), then one retained prompt of ``--big`` tokens (whose pin must
release thousands of the small ones) with a 3-token request from another client beside
it. Two ways of naming the tenants:

* ``one salt``: every request in one ``cache_salt``, whose quota (``--max-retained-tokens``
  = the small pins' total) the big pin overflows: it releases the oldest ~3,000 pins;
* ``a salt each``: every small request in a salt of its own (a client rotating salts)
  and the big one in another: the fair share of the shared cap is ~2 tokens, so the big
  pin is refused (counted), taking no tenant's pins.

The small request arrives as the big one's prefill reaches its last chunk, so it shares
the step that makes the big pin. Reported per way: the small request's wait (its arrival
to its end), the time of that step spent pinning (`Engine._retain`), the median step
while the small pins were made, and the pins released. The issue measured 12.9 s for the
small request, when each release cost O(pins).

    python benchmarks/bench_retention.py [--pins 8192] [--big 6000] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import time


def run(pins: int, big: int, salts: bool) -> dict:
    from radixkv.engine.engine import Engine
    from radixkv.engine.request import CacheSpec, SamplingParams

    engine = Engine("random", page_size=1, kv_tokens=65536, max_context_len=8192,
                    max_running=32, max_retained_tokens=None if salts else 2 * pins)  # fmt: skip
    one = SamplingParams(1)
    steps: list[float] = []
    pinning: list[float] = []
    retain = engine._retain  # timed: the retention work of a step

    def timed_retain(*args: object) -> None:
        t = time.perf_counter()
        retain(*args)  # type: ignore[arg-type]
        pinning.append(time.perf_counter() - t)

    engine._retain = timed_retain  # type: ignore[method-assign]

    def drain() -> None:
        while engine.has_unfinished():
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)

    for i in range(pins):  # two tokens each, all different
        spec = CacheSpec(retain=((2, 86400.0),))
        engine.add_request([i % 250 + 3, i // 250 + 3], one, chat=False, cache=spec,
                           extra_key=f"s{i}" if salts else "tenant")  # fmt: skip
        if i % 32 == 31:
            drain()
    drain()
    made = statistics.median(steps)
    released, refused = sum(engine.retention.released.values()), engine.retention.refused
    prompt = [(7 * i) % 250 + 3 for i in range(big)]
    spec = CacheSpec(retain=((big, 86400.0),))
    engine.add_request(prompt, one, "big", chat=False, cache=spec,
                       extra_key="other" if salts else "tenant")  # fmt: skip
    req, chunk = engine.requests["big"], engine.engine_config.chunk_size
    while len(req.input_ids) - req.kv_len > chunk:  # the prefill, up to its last chunk
        engine.step()
    pinning.clear()
    t0 = time.perf_counter()  # the small request arrives as the big one's pin is made
    engine.add_request([5, 6, 7], one, "small", chat=False)
    ends: dict[str, float] = {}
    while engine.has_unfinished():
        outs = engine.step()
        ends.update({o.rid: time.perf_counter() - t0 for o in outs if o.finished})
    return {
        "pins": len(engine.retention.pins),
        "released": sum(engine.retention.released.values()) - released,
        "refused": engine.retention.refused - refused,
        "small_s": ends["small"],
        "retain_ms": sum(pinning) * 1e3,
        "step_ms": made * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pins", type=int, default=8192)
    ap.add_argument("--big", type=int, default=6000)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    rows: dict[str, list[dict]] = {"one salt": [], "a salt each": []}
    for _ in range(args.runs):  # the two ways interleaved
        for name in rows:
            rows[name].append(run(args.pins, args.big, name == "a salt each"))
    print(f"{args.pins:,} retained 2-token prompts, then a {args.big:,}-token retained "
          f"prompt and a 3-token request beside it ({args.runs} runs: median [range])")  # fmt: skip
    print(
        "| tenants | 3-token wait ms | of it, the big pin ms | a pin-making step ms "
        "| pins released | big pin refused |"
    )
    print("|---|---|---|---|---|---|")

    def cell(vals: list[float], fmt: str) -> str:
        return f"{statistics.median(vals):{fmt}} [{min(vals):{fmt}}–{max(vals):{fmt}}]"

    for name, rs in rows.items():
        print(f"| {name} | {cell([r['small_s'] * 1e3 for r in rs], '.0f')} | "
              f"{cell([r['retain_ms'] for r in rs], '.1f')} | "
              f"{cell([r['step_ms'] for r in rs], '.1f')} | {rs[0]['released']:,} | "
              f"{'yes' if rs[0]['refused'] else 'no'} |")  # fmt: skip


if __name__ == "__main__":
    main()
