"""The hybrid byte budget's eviction rounds: incremental candidates against a scan of
the whole tree every round (how `HybridBudget` chose before), on the same trace in the
same run. Both must give the same hits, checkpoints and bytes (tests/kvcache/test_hybrid_cache.py
checks it on a small chat); this reports the time of each and that they agree.

    python benchmarks/bench_budget.py [--trace conversation_trace.jsonl] \\
        [--model-spec qwen3.5-4b] [--fractions 0.01,0.05,0.25] [--no-reference]

Capacity: a fraction of the bytes of every token of the trace (prompt and, with
``--cache-outputs``, output), at the spec's full + window KV a token. Without
``--trace``, the built-in chat workload. ``--no-reference`` runs only the incremental
budget (the scan takes minutes on Mooncake's conversation trace at 25%).
"""

from __future__ import annotations

import argparse
import time

from radixkv.kvcache.budget import HybridBudget
from radixkv.kvcache.recurrent.component import utility
from radixkv.tree.node import units_before


class ScanningBudget(HybridBudget):
    """The brute-force model of `HybridBudget`'s order: every round scans the whole tree
    for its candidates."""

    def _round(self, over: int) -> bool:
        cache, state = self.cache, self.state
        per_unit = self.token_bytes + self.window_bytes
        leaves = [n for n in cache.iter_nodes() if not n.children and not n.lock_ref]
        leaves.sort(key=lambda n: (n.last_access, n.id))
        freed = 0
        for node in leaves:  # 1. dead KV
            dead = len(node) - self._usable(node)
            dead -= dead % cache.page_size
            if dead > 0:
                cache.evict_leaf(node, dead)
                freed += dead * per_unit
                if freed >= over:
                    return True
        if freed:
            return True
        if state is None:  # a window's leaf goes whole
            for node in leaves:
                cache.evict_leaf(node)
                freed += len(node) * per_unit
                if freed >= over:
                    break
            return bool(leaves)
        old = sorted((c for c in state.held.values() if state.superseded(c)),
                     key=lambda c: c.tick)  # fmt: skip
        if old:  # 2. superseded checkpoints
            state.drop_superseded(old[: max(1, -(-over // max(state.state_bytes, 1)))])
            return True
        segs = [(n, state.checkpoints(n)[-1]) for n in leaves if state.checkpoints(n)]
        if not segs:  # 3. leaf segments
            return False
        value = [self.flops(units_before(n) + len(n)) * (1 + c.uses * self.frequency)
                 for n, c in segs]  # fmt: skip
        cost = [state.state_bytes + self._segment(n) * self.token_bytes for n, _ in segs]
        if self.order == "greedy-dual":
            pairs = zip(segs, value, cost, strict=True)
            score = [c.age + v / max(b, 1.0) for (_, c), v, b in pairs]
        else:
            score = utility([float(c.tick) for _, c in segs], value, cost, self.alpha)
        drop, gone = [], 0.0
        for i in sorted(range(len(segs)), key=score.__getitem__):
            drop.append(segs[i][1])
            gone += cost[i]
            if gone >= over:
                break
        if self.order == "greedy-dual":
            state.age = max(state.age, score[i])
        state.drop(drop)
        return True


def run(trace, spec, capacity: int, outputs: bool, budget: type) -> tuple[object, float]:
    import radixkv.sim.hybrid as sim

    before, sim.HybridBudget = sim.HybridBudget, budget
    try:
        start = time.perf_counter()
        result = sim.simulate_hybrid(trace, spec, capacity, "radixkv", outputs)
        return result, time.perf_counter() - start
    finally:
        sim.HybridBudget = before


def main() -> None:
    from radixkv.sim.hybrid import model_spec
    from radixkv.sim.traces import gen_chat, load_trace

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace")
    ap.add_argument("--model-spec", default="qwen3.5-4b")
    ap.add_argument("--fractions", default="0.01,0.05,0.25")
    ap.add_argument("--cache-outputs", action="store_true")
    ap.add_argument("--no-reference", action="store_true")
    args = ap.parse_args()
    trace = load_trace(args.trace) if args.trace else gen_chat()
    outputs = args.cache_outputs or not args.trace
    spec = model_spec(args.model_spec)
    units = sum(len(r.units) if outputs else r.num_prompt_units for r in trace.requests)
    every = units * trace.block_size * (spec.full_kv + spec.window_kv)
    print(f"{trace.name}: {len(trace.requests):,} requests on {spec.name}")
    print(f"{'capacity':>9} {'hit rate':>9} {'incremental':>12} {'full scan':>10} {'same':>5}")
    for frac in (float(f) for f in args.fractions.split(",")):
        cap = int(every * frac)
        new, t_new = run(trace, spec, cap, outputs, HybridBudget)
        if args.no_reference:
            print(f"{frac:>9.0%} {new.token_hit_rate:>9.4f} {t_new:>11.1f}s {'-':>10} {'-':>5}")
            continue
        old, t_old = run(trace, spec, cap, outputs, ScanningBudget)
        same = (new.hit_tokens, new.checkpoints, new.mean_bytes) == (
            old.hit_tokens, old.checkpoints, old.mean_bytes)  # fmt: skip
        print(f"{frac:>9.0%} {new.token_hit_rate:>9.4f} {t_new:>11.1f}s {t_old:>9.1f}s {same!s:>5}",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
