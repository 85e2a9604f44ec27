"""The hybrid simulator's results for people: its table (with a caption saying what each
column means, and which rows held past their capacity) and its plot.

Owns: how `radixkv.sim.hybrid`'s results are shown. Must not touch: the replay.
"""

from __future__ import annotations

from typing import Any

from radixkv.sim.hybrid import UNBOUNDED, HybridResult, ModelSpec, fmt_bytes
from radixkv.sim.traces import Trace


def print_hybrid_table(
    results: list[HybridResult], trace: Trace, spec: ModelSpec, console: Any
) -> None:
    """The results as a table, with each policy's hit rate over vLLM align's."""
    from rich.table import Table

    table = Table(
        title=f"{trace.name} on {spec.name}: {len(trace.requests):,} requests, "
        f"{trace.prompt_tokens():,} prompt tokens, page {trace.block_size}; a checkpoint "
        f"{fmt_bytes(spec.checkpoint)}, a token {fmt_bytes(spec.full_kv + spec.window_kv)}"
    )
    for col in ("policy", "capacity", "token hit rate", "vs vllm", "FLOPs saved", "full KV",
                "window KV", "states", "checkpoints", "hit grid"):  # fmt: skip
        table.add_column(col, justify="left" if col == "policy" else "right", overflow="fold")
    base = {r.capacity_bytes: r.token_hit_rate for r in results if r.policy == "vllm"}
    over = False
    for r in results:
        b = base.get(r.capacity_bytes)
        past = sum(r.mean_bytes.values()) > r.capacity_bytes  # (only a peer's own rules)
        over |= past
        table.add_row(
            r.policy + (" *" if past else ""), fmt_bytes(r.capacity_bytes),
            f"{r.token_hit_rate:.4f}", f"{r.token_hit_rate / b:.2f}x" if b else "-",
            f"{r.flops_saved:.4f}", fmt_bytes(r.mean_bytes["full"]),
            fmt_bytes(r.mean_bytes["window"]), fmt_bytes(r.mean_bytes["states"]),
            f"{r.checkpoints:,}", str(r.block_tokens),
        )  # fmt: skip
    refused = [f"{r.policy} at {fmt_bytes(r.capacity_bytes)}: {r.refused:,}" for r in results
               if r.refused]  # fmt: skip
    table.caption = COLUMNS + (OVER if over else "") + (
        f"\nrefused (prompt + output over what the pool holds alone; each a miss): "
        f"{'; '.join(refused)}" if refused else "")  # fmt: skip
    console.print(table)


# what the hybrid table's columns say (its caption; docs/simulation.md says the same)
COLUMNS = (
    "vs vllm: the hit rate over vLLM align's at the same capacity; FLOPs saved: the "
    "prefill FLOPs the hits saved, of all; full KV, window KV, states: the bytes each "
    "kind held, the mean over the requests (after each); checkpoints: recurrent states "
    "taken in all; hit grid: the tokens a hit counts in (vLLM's block, else the page)."
)
OVER = (
    "\n* held more than its capacity: Marconi's simulator inserts a request after "
    "evicting all it can even when the request's own states and KV exceed the budget "
    "(its vLLM+ keeps a state every 32 tokens), and these rows replay its rules."
)


def plot_hybrid(results: list[HybridResult], trace: Trace, spec: ModelSpec, path: str) -> None:
    """Hit rate against capacity in bytes, one curve per policy."""
    from radixkv.sim.sweep import pyplot, save_plot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in dict.fromkeys(r.policy for r in results):
        pts = sorted((r.capacity_bytes / (1 << 30), r.token_hit_rate) for r in results
                     if r.policy == policy and r.capacity_bytes < UNBOUNDED)  # fmt: skip
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (GiB: full KV + window KV + states)")
    ax.set_ylabel("token hit rate")
    ax.set_ylim(0, 1.0)
    ax.set_title(f"Hybrid prefix caching: {trace.name} on {spec.name}")
    save_plot(plt, fig, ax, path)


__all__ = ["COLUMNS", "OVER", "plot_hybrid", "print_hybrid_table"]
