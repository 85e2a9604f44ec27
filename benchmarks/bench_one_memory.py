"""One memory against SGLang's fixed split, in the engine, at equal bytes: tiny random
hybrid models (written by transformers' own ``save_pretrained``) serving multi-turn
chats behind 4 shared system prompts, two ways in the same run:

* **one**: ``cache_bytes=B`` (`radixkv.kvcache.arena`): full-attention KV, window KV and
  checkpoints draw from one arena, evicted in the simulator's ``radixkv`` order;
* **sglang**: ``cache_bytes=B, cache_split="sglang"``: the same bytes split by SGLang's
  default ratios into separate pools (recurrent states 0.9x the full KV's bytes; window
  KV 0.8x the full KV's tokens), each evicting its own, least recently used first.

Models: Qwen3.5-like (Gated DeltaNet : gated attention, 3 : 1) and Gemma-3-like (5
sliding layers, window 64 : 1 global). Each round sends every conversation's next turn at
once (its history, the engine's own previous answer, a new user message). Reported per
budget: the token hit rate of each way and their ratio, the bytes each kind holds at the
end, preemptions, wall time, and whether both ways gave the same tokens (they must:
caching never changes a token). The rows go from the tightest budget up.

    python benchmarks/bench_one_memory.py [--budgets 1MiB,2MiB,4MiB] [--chats 16]
        [--sweep 0.1,0.2,0.35,0.5,0.65,0.8] [--speed 5] [--host-tokens 4096]

``--sweep``: fixed splits of each budget (that share of it for checkpoints or window KV,
the rest for full KV), the best of them against one budget. ``--speed``: the workload
with room to spare (the same hits either way), separate pools against one arena of
their bytes, interleaved runs, median wall time. ``--host-tokens``: both ways (and
the sweep's splits) with a host tier of that many tokens below the device (its hits
count as cached: the engine serves them from the device after loading them).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from workloads import chat_args, engine_chats

from radixkv.units import parse_bytes

DIMS = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=8192)  # fmt: skip


# the tightest is a little over what one request needs alone (Gemma: its window and
# chunk of window-layer KV)
BUDGETS = {"qwen3.5-like": "512KiB,1MiB,2MiB", "gemma-3-like": "1MiB,2MiB,4MiB"}


def write_models(root: Path, window: int) -> dict[str, Path]:
    import transformers

    torch.manual_seed(0)
    q = transformers.Qwen3_5TextConfig(**DIMS, num_hidden_layers=8, linear_key_head_dim=16,
                                       linear_value_head_dim=16, linear_num_key_heads=2,
                                       linear_num_value_heads=4)  # fmt: skip
    transformers.Qwen3_5ForCausalLM(q).save_pretrained(root / "qwen3_5")
    types = ["sliding_attention"] * 5 + ["full_attention"]
    g = transformers.Gemma3TextConfig(**DIMS, num_hidden_layers=6, query_pre_attn_scalar=16,
                                      sliding_window=window, layer_types=types)  # fmt: skip
    transformers.Gemma3ForCausalLM(g).save_pretrained(root / "gemma3")
    return {"qwen3.5-like": root / "qwen3_5", "gemma-3-like": root / "gemma3"}


def fixed_split(folder: Path, budget: int, share: float, page: int) -> dict:
    """Separate pools of ``budget`` bytes together: ``share`` of them for the other kind
    (recurrent checkpoints, or window KV), the rest for full-attention KV."""
    from radixkv.engine.engine import Engine

    probe = Engine(str(folder), page_size=page, kv_tokens=1024, window_tokens=0)
    kv, rec = probe.kv, probe.recurrent
    other = int(budget * share)
    if rec is not None:
        full = (budget - other) // kv.bytes_per_token() // page * page
        return {"kv_tokens": full, "max_checkpoints": max(1, other // rec.row_size)}
    windowed = Engine(str(folder), page_size=page, kv_tokens=1024)
    per_full, per_win = windowed.kv.bytes_per_token(), windowed.kv.window_bytes_per_token()
    return {"kv_tokens": (budget - other) // per_full // page * page,
            "window_tokens": other // per_win // page * page}  # fmt: skip


def run(folder: Path, budget: int, split: str, args: argparse.Namespace,
        pools: dict | None = None) -> dict:  # fmt: skip
    from radixkv.engine.engine import Engine

    size = pools or {"cache_bytes": budget, "cache_split": split}
    engine = Engine(str(folder), page_size=args.page, chunk_size=args.chunk,
                    max_running=args.running, max_context_len=4096, check_memory=args.check,
                    host_tokens=args.host_tokens, **size)  # fmt: skip
    t0 = time.perf_counter()
    prompt, cached, outputs = engine_chats(engine, args.chats, args.turns, args.system,
                                           args.user, args.new)  # fmt: skip
    return {
        "hit": cached / prompt,
        "held": engine.cache_bytes_held(),
        "wall": time.perf_counter() - t0,
        "outputs": outputs,
        "preemptions": engine.scheduler.preemptions,
    }


def sweep(folder: Path, budget: int, one: dict, args: argparse.Namespace) -> None:
    """Fixed splits of ``budget``: each share's hit rate, the best against one."""
    hits = {}
    for share in (float(x) for x in args.sweep.split(",")):
        try:
            pools = fixed_split(folder, budget, share, args.page)
            hits[share] = run(folder, budget, "", args, pools)["hit"]
        except ValueError as e:  # a pool too small for one request
            print(f"    share {share}: refused ({str(e)[:80]})")
    if hits:
        best = max(hits, key=hits.__getitem__)
        each = ", ".join(f"{k}: {v:.3f}" for k, v in hits.items())
        print(f"    fixed splits (share: hit) {each}; "
              f"best {hits[best]:.3f} at {best}, one {one['hit']:.3f} "
              f"({one['hit'] - hits[best]:+.3f})", flush=True)  # fmt: skip


def speed(folder: Path, name: str, args: argparse.Namespace) -> None:
    """Wall time of the workload with room to spare (no eviction: the same hits, the
    same work), separate pools against one arena of their bytes, interleaved."""
    import statistics

    roomy = {"kv_tokens": 32768}
    times: dict[str, list[float]] = {"pools": [], "one": []}
    for _ in range(args.speed):
        for way, size in (("pools", {"cache_bytes": None, **roomy}),
                          ("one", {"cache_bytes": "auto", **roomy})):  # fmt: skip
            times[way].append(run(folder, 0, "one", args, size)["wall"])
    med = {k: statistics.median(v) for k, v in times.items()}
    rng = {k: f"{min(v):.2f}-{max(v):.2f}" for k, v in times.items()}
    print(f"    {name} with room to spare, wall s (median of {args.speed}, range): pools "
          f"{med['pools']:.2f} ({rng['pools']}), one {med['one']:.2f} ({rng['one']}): one / "
          f"pools {med['one'] / med['pools']:.2f}", flush=True)  # fmt: skip


def kib(n: float) -> str:
    return f"{n / 1024:,.0f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", default=None,
                   help="cache_bytes, one run per value and way, tightest first [per model: "
                   + "; ".join(f"{k} {v}" for k, v in BUDGETS.items()) + "]")  # fmt: skip
    chat_args(p)
    p.add_argument("--running", type=int, default=4, help="requests running at once")
    p.add_argument("--models", default="qwen3.5-like,gemma-3-like")
    p.add_argument("--check", action="store_true", help="check_memory after every step")
    p.add_argument("--speed", type=int, default=0,
                   help="also time the same workload with room to spare, the separate pools "
                   "against one arena, this many interleaved runs each")  # fmt: skip
    p.add_argument("--host-tokens", type=int, default=0,
                   help="a host tier of this many tokens below each way's device memory")
    p.add_argument("--sweep", default="",
                   help="also fixed splits: shares of the budget for checkpoints / window KV "
                   "(e.g. 0.1,0.3,0.5,0.7); the best of them against one")  # fmt: skip
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folders = write_models(Path(tmp), args.window)
        print(f"{args.chats} chats x {args.turns} turns behind 4 system prompts of "
              f"{args.system} tokens, +{args.user} user and {args.new} output tokens a "
              f"turn; page {args.page}, {args.running} running at once; host tier "
              f"{args.host_tokens} tokens")  # fmt: skip
        print("| model | budget | hit one | hit sglang | one / sglang | one holds KiB "
              "(full / window / states) | sglang holds KiB | preemptions one / sglang | "
              "wall s one / sglang | same tokens |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|")
        for name in args.models.split(","):
            for budget in map(parse_bytes, (args.budgets or BUDGETS[name]).split(",")):
                try:
                    one = run(folders[name], budget, "one", args)
                except ValueError as e:  # too small for one request, even as one budget
                    print(f"| {name} | {kib(budget)} KiB | refused | - | - | - | - | - | - | - |")
                    print(f"    one: refused ({str(e)[:100]})", flush=True)
                    continue
                try:
                    sgl = run(folders[name], budget, "sglang", args)
                except ValueError as e:  # its pools too small for one request
                    print(f"| {name} | {kib(budget)} KiB | {one['hit']:.3f} | refused | - | "
                          f"- | - | {one['preemptions']} / - | {one['wall']:.1f} / - | - |")
                    print(f"    sglang: refused ({str(e)[:100]})", flush=True)
                    if args.sweep:
                        sweep(folders[name], budget, one, args)
                    continue
                same = one["outputs"] == sgl["outputs"]
                ratio = one["hit"] / sgl["hit"] if sgl["hit"] else float("inf")
                held = [" / ".join(kib(r["held"][k]) for k in ("full", "window", "states"))
                        for r in (one, sgl)]  # fmt: skip
                print(f"| {name} | {kib(budget)} KiB | {one['hit']:.3f} | {sgl['hit']:.3f} | "
                      f"{ratio:.2f}x | {held[0]} | {held[1]} | {one['preemptions']} / "
                      f"{sgl['preemptions']} | {one['wall']:.1f} / {sgl['wall']:.1f} | "
                      f"{'yes' if same else 'NO'} |", flush=True)  # fmt: skip
                if args.sweep:
                    sweep(folders[name], budget, one, args)
            if args.speed:
                speed(folders[name], name, args)


if __name__ == "__main__":
    main()
