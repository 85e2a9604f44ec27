"""Fidelity: the engine's token hit rate beside the simulator's on the trace the engine
served, request for request.

Tiny random hybrid models (bench_one_memory's Qwen3.5-like and Gemma-3-like, written by
transformers' ``save_pretrained``) serve multi-turn chats behind 4 shared system prompts
from one byte budget (``cache_bytes``); every request is recorded (prompt, the model's
real output, its round). The recorded trace is then replayed two ways:

* **serve** (``radixkv simulate --policy serve``, `radixkv.sim.serve_replay`): the
  engine's own scheduler, lifecycle and arena, the recorded outputs in place of the
  model. It must equal the engine request for request (the "equal" column);
* **model** (``radixkv simulate --policy radixkv``): the budget simulator, one request at
  a time in the trace's order, fitting the budget before each request as the engine's
  arena does while it runs.

Concurrency 1 is shown with the engine's two schedule policies: ``lpm`` (the default:
the waiting request with the longest cached prefix first, which reorders a round) and
``fcfs`` (arrival order, the order the model replays in); 8 with ``lpm``.

    python benchmarks/bench_fidelity.py [--budgets ...] [--chats 16] [--turns 4]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench_one_memory import BUDGETS, write_models
from workloads import chat_args, engine_chats

from radixkv.units import parse_bytes

RUNS = (("lpm", 1), ("fcfs", 1), ("lpm", 8))


def one(folder: Path, budget: int, policy: str, running: int, args, tmp: Path) -> str:  # type: ignore[no-untyped-def]
    from radixkv.engine.config import EngineConfig
    from radixkv.engine.engine import Engine
    from radixkv.sim import traces
    from radixkv.sim.hybrid import ModelSpec, simulate_hybrid
    from radixkv.sim.serve_replay import replay_serve

    cfg = EngineConfig(page_size=args.page, chunk_size=args.chunk, max_running=running,
                       max_context_len=4096, cache_bytes=budget,
                       schedule_policy=policy)  # fmt: skip
    records: list[dict] = []
    t0 = time.perf_counter()
    prompt, cached, _ = engine_chats(Engine(str(folder), cfg), args.chats, args.turns,
                                     args.system, args.user, args.new, records)  # fmt: skip
    t_engine = time.perf_counter() - t0
    path = tmp / f"{folder.name}-{budget}-{policy}-{running}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    trace = traces.load_trace(path, "tokens", args.page)
    t0 = time.perf_counter()
    serve = replay_serve(trace, folder, budget, cfg, concurrency=running)
    t_serve = time.perf_counter() - t0
    equal = sum(a == r["cached"] for a, r in zip(serve.cached, records, strict=True))
    model = simulate_hybrid(trace, ModelSpec.from_folder(folder), budget, "radixkv",
                            schedule=policy)  # fmt: skip
    hit, sim = cached / prompt, model.token_hit_rate
    return (f"{policy:>5} {running:>3}  {hit:7.3f} {serve.token_hit_rate:7.3f} "
            f"{equal:>3}/{len(records):<3} {sim:7.3f} {sim - hit:+7.3f}  "
            f"{t_engine:6.1f} {t_serve:6.1f}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", default=None,
                   help="per model, comma-separated [bench_one_memory's]")  # fmt: skip
    chat_args(p)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        models = write_models(tmp, args.window)
        for name, folder in models.items():
            print(f"{name}: {args.chats} chats x {args.turns} turns, page {args.page}, chunk "
                  f"{args.chunk}")  # fmt: skip
            print(" budget  sched run  engine   serve  equal    model  model-engine  "
                  "engine-s serve-s")  # fmt: skip
            for text in (args.budgets or BUDGETS[name]).split(","):
                for policy, running in RUNS:
                    row = one(folder, parse_bytes(text), policy, running, args, tmp)
                    print(f"{text:>7} {row}", flush=True)


if __name__ == "__main__":
    main()
