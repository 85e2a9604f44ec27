"""A burst at the tightest budget: every request at once against the same requests one at
a time, on a live `radixkv serve` (issue 59: 80 chats sent at once at the tightest budget
finished 24 in 300 s, while one at a time took 5 s).

For each family (make-model's tiny Qwen3.5, Gemma 3 and Llama) the tightest byte budget
that serves the trace's longest request alone is found with the serve replay (the
engine's own memory, `radixkv.sim.serve_replay`); a server at that budget then answers
the trace's requests (token ids: 16 chats x 5 turns, each turn's whole history, 32
tokens out) one at a time and all at once, in interleaved rounds; the table shows the
median wall time of each and their ratio (target: the burst within 1.5x).

    python benchmarks/bench_burst.py [--rounds 3] [--families qwen3.5,gemma3,llama]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from radixkv.sim import traces
from radixkv.sim.serve_replay import tightest_budget
from radixkv.web.process import ServerProcess

PAGE = 16


def trace() -> traces.Trace:
    """16 chats x 5 turns (the longest 352 tokens), ids within every family's vocabulary."""
    t = traces.gen_multi_turn(conversations=16, turns=5, first_len=64, message_len=32,
                              output_len=32, block_size=PAGE, seed=1)  # fmt: skip
    for r in t.requests:
        r.prompt_ids = [x % 256 for x in r.prompt_ids]
        r.output_ids = [x % 256 for x in r.output_ids or ()]
    return t


async def send(url: str, prompts: list[list[int]], at_once: int) -> float:
    sem = asyncio.Semaphore(at_once)
    async with httpx.AsyncClient(timeout=600) as c:

        async def one(p: list[int]) -> None:
            async with sem:
                body = {"prompt": p, "max_tokens": 32, "ignore_eos": True}
                r = await c.post(f"{url}/v1/completions", json=body)
                r.raise_for_status()

        start = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--families", default="qwen3.5,gemma3,llama")
    args = ap.parse_args()
    from radixkv.cli import main as cli

    t = trace()
    prompts = [r.prompt_ids for r in t.requests]
    print("| family | budget | one at a time, s (median, range) | all at once, s | ratio |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            folder = str(Path(tmp) / family)
            assert cli(["make-model", family, folder]) == 0
            budget = tightest_budget(t, folder)
            times: dict[int, list[float]] = {1: [], len(prompts): []}
            with ServerProcess("--model", folder, "--cache-bytes", str(budget),
                               "--page-size", str(PAGE), timeout=120) as srv:  # fmt: skip
                for _ in range(args.rounds):  # interleaved: each round both ways
                    for at_once in times:
                        times[at_once].append(asyncio.run(send(srv.url, prompts, at_once)))
            one, burst = (statistics.median(times[k]) for k in times)
            spread = {k: f"{min(v):.1f}-{max(v):.1f}" for k, v in times.items()}
            print(f"| {family} | {budget:,} B | {one:.1f} ({spread[1]}) | {burst:.1f} "
                  f"({spread[len(prompts)]}) | {burst / one:.2f}x |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
