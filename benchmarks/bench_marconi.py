"""Marconi's own rows against Marconi's published results, and radixkv beside them.

Marconi's published simulator (github ruipeterpan/marconi, run unchanged) gave these
token hit rates on its 120-session chat trace (``../shared/data/marconi``: its README
states the settings: the NVIDIA 7B hybrid, ``eff_weight=0``, ``bootstrap_multiplier=5``,
logical time, per request a lookup of the input, then an insert of input + output).
This replays the same trace through `radixkv.sim.marconi` (its rules, reimplemented)
and radixkv's own policy, and prints each cell beside the published one. radixkv is
shown twice: as the engine serves it (``radixkv``: a request's new KV counts against the
budget while it runs) and as Marconi's simulator counts (``radixkv@after``: the budget
is fit after each request, so a running request may overflow it; the same accounting
as Marconi's rows, so the policies compare like for like):

    python benchmarks/bench_marconi.py [--trace chat120_seed7.jsonl.gz] \\
        [--model-spec marconi-7b-hybrid.json] [--page 1]

Exit status 1 when a Marconi row is more than 0.01 off its published cell (page 1).

With ``--engine`` it also replays the trace through the engine itself (``serve``:
`radixkv.sim.serve_replay`, the scheduler, lifecycle and one arena of `radixkv serve`,
the model only its cache's shape, chunks of 512, one request at a time): what the
server caches, where the ``radixkv`` row is the budget simulator's model of it. A
request longer than the engine's pool holds alone is refused, as the server refuses it
(a miss; the count is printed). About 5 s a size (docs/performance.md):

    python benchmarks/bench_marconi.py --engine [--page 16]

With ``--by-request GB`` it compares radixkv (as served) with Marconi's own row at that
size request by request: where each hits more, and why radixkv hit less (one token: an
engine computes a prompt's last token; more: its KV was evicted, or held without a state
to resume from):

    python benchmarks/bench_marconi.py --by-request 5

With ``--mooncake conversation_trace.jsonl`` it replays Mooncake's trace instead (its
512-token blocks as units, no outputs, the Qwen3.5-like spec unless given), every policy
at fractions of all its prompt tokens' KV, with no published cells to compare:

    python benchmarks/bench_marconi.py --mooncake conversation_trace.jsonl \\
        [--fractions 0.01,0.05,0.25] [--policies radixkv,marconi,sglang+,vllm+,sglang,vllm] \\
        [--checkpoint-every 2048]
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import sys
import tempfile
import time
from pathlib import Path

from radixkv.sim import traces
from radixkv.sim.hybrid import POLICIES, model_spec, simulate_hybrid
from radixkv.sim.serve_replay import serve_result

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "marconi"
SIZES = (0.5e9, 1e9, 2e9, 5e9)  # bytes, 1 GB = 10^9 as Marconi counts
# Marconi's published token hit rates at those sizes (its data README's table)
PUBLISHED = {
    "vllm+": (0.067, 0.068, 0.076, 0.135),
    "sglang+": (0.063, 0.162, 0.340, 0.649),
    "marconi": (0.061, 0.155, 0.310, 0.649),
}
TOLERANCE = 0.01


def load(path: Path, page: int) -> traces.Trace:
    if path.suffix == ".gz":  # the loader reads plain JSONL
        with gzip.open(path, "rb") as src, tempfile.NamedTemporaryFile(suffix=".jsonl") as tmp:
            shutil.copyfileobj(src, tmp)
            tmp.flush()
            return traces.load_trace(tmp.name, "marconi", page)
    return traces.load_trace(str(path), "marconi", page)


def mooncake(args: argparse.Namespace) -> int:
    trace = traces.load_trace(args.mooncake)
    spec = model_spec(args.model_spec or "qwen3.5-4b")
    every = sum(r.num_prompt_units for r in trace.requests) * trace.block_size * spec.full_kv
    fractions = [float(f) for f in args.fractions.split(",")]
    print(f"{trace.name}: {len(trace.requests):,} requests, {spec.name}, units of "
          f"{trace.block_size} tokens")  # fmt: skip
    print(f"{'policy':<9}" + "".join(f"{f:>10.0%}" for f in fractions) + "   seconds")
    for policy in args.policies.split(","):
        t0 = time.perf_counter()
        kw = {"checkpoint_every": args.checkpoint_every} if policy == "radixkv" else {}
        rates = [simulate_hybrid(trace, spec, int(every * f), policy, False, **kw).token_hit_rate
                 for f in fractions]  # fmt: skip
        print(f"{policy:<9}" + "".join(f"{r:>10.3f}" for r in rates)
              + f"   {time.perf_counter() - t0:.1f}", flush=True)  # fmt: skip
    return 0


def by_request(trace: traces.Trace, spec, cap: int) -> None:  # type: ignore[no-untyped-def]
    """radixkv as served against Marconi's row at ``cap``, request by request."""
    ours: list[tuple[int, int | None]] = []
    theirs: list[int] = []
    simulate_hybrid(trace, spec, cap, "radixkv", True,
                    on_request=lambda _r, hit, kv: ours.append((hit, kv)))  # fmt: skip
    simulate_hybrid(
        trace, spec, cap, "marconi", True, on_request=lambda _r, hit, _k: theirs.append(hit)
    )
    total = trace.prompt_tokens()
    more = [(a, b) for (a, _), b in zip(ours, theirs, strict=True) if a > b]
    less = [(a, b, kv) for (a, kv), b in zip(ours, theirs, strict=True) if a < b]
    one = [x for x in less if x[1] - x[0] == 1]
    evicted = [x for x in less if x[1] - x[0] > 1 and x[2] is not None and x[2] < x[1]]
    stateless = [x for x in less if x[1] - x[0] > 1 and x not in evicted]

    def share(rows: list, lost: bool = True) -> str:
        tokens = sum((b - a) if lost else (a - b) for a, b, *_ in rows)
        return f"{len(rows):>4} requests, {tokens:>8,} tokens ({tokens / total:.4f} of all)"

    print(f"{cap / 1e9:g} GB, radixkv as served against Marconi's row, request by request:")
    print(f"  radixkv hits more     {share(more, lost=False)}")
    print(f"  radixkv hits less     {share(less)}")
    print(f"    by one token        {share(one)}  (a prompt's last token: engines compute it)")
    print(f"    its KV was evicted  {share(evicted)}")
    print(f"    KV held, no state   {share(stateless)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=DATA / "chat120_seed7.jsonl.gz")
    ap.add_argument("--model-spec", default=None)
    ap.add_argument("--page", type=int, default=1)
    ap.add_argument("--mooncake", help="Mooncake's trace: replay it instead")
    ap.add_argument("--fractions", default="0.01,0.05,0.25")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--checkpoint-every", type=int, default=0,
                    help="Mooncake: radixkv also checkpoints every N tokens of a prompt, as "
                    "serve --checkpoint-every (a multiple of 512)")  # fmt: skip
    ap.add_argument("--engine", action="store_true",
                    help="also the engine's rows (serve: what radixkv serve caches)")  # fmt: skip
    ap.add_argument("--by-request", type=float, metavar="GB",
                    help="radixkv against Marconi's row at GB, request by request")  # fmt: skip
    args = ap.parse_args()
    if args.mooncake:
        return mooncake(args)
    args.model_spec = args.model_spec or str(DATA / "marconi-7b-hybrid.json")
    if not args.trace.exists():
        print(f"no trace at {args.trace}: give --trace (Marconi's format)", file=sys.stderr)
        return 2
    trace, spec = load(args.trace, args.page), model_spec(args.model_spec)
    trace.name = args.trace.name.split(".")[0]
    if args.by_request:
        by_request(trace, spec, int(args.by_request * 1e9))
        return 0
    print(f"{trace.name}: {len(trace.requests)} requests, {trace.prompt_tokens():,} prompt "
          f"tokens, page {args.page}; {spec.name}")  # fmt: skip
    print(f"{'policy':<13}" + "".join(f"{s / 1e9:>19g} GB" for s in SIZES) + "   seconds")
    rates, worst, refused = {}, 0.0, {}
    ours = ("serve", "radixkv", "radixkv@after") if args.engine else ("radixkv", "radixkv@after")
    for policy in (*ours, *PUBLISHED):
        t0 = time.perf_counter()
        name, _, acc = policy.partition("@")
        if name == "serve":
            rows = [serve_result(trace, None, spec, int(s)) for s in SIZES]
            refused = {s: r.refused for s, r in zip(SIZES, rows, strict=True) if r.refused}
        else:
            rows = [simulate_hybrid(trace, spec, int(s), name, True, acc or "served")
                    for s in SIZES]  # fmt: skip
        rates[policy] = [r.token_hit_rate for r in rows]
        theirs = PUBLISHED.get(policy)
        cells = [f"{r:.3f}" + (f" (theirs {theirs[i]:.3f})" if theirs else "")
                 for i, r in enumerate(rates[policy])]  # fmt: skip
        if theirs:
            worst = max([worst, *(abs(a - b) for a, b in zip(rates[policy], theirs, strict=True))])
        print(f"{policy:<13}" + "".join(f"{c:>22}" for c in cells)
              + f"   {time.perf_counter() - t0:.1f}")  # fmt: skip
    best = [max(row[i] for row in PUBLISHED.values()) for i in range(len(SIZES))]
    for row in ours:
        print(
            f"{row + ' / best published':<30}"
            + "".join(f"{r / b:>13.2f}x" for r, b in zip(rates[row], best, strict=True))
        )
    print(f"largest |row - published|: {worst:.4f} (tolerance {TOLERANCE})")
    for s, n in refused.items():
        print(f"serve at {s / 1e9:g} GB refused {n} request(s): longer than its pool holds alone")
    return 1 if args.page == 1 and worst > TOLERANCE else 0


if __name__ == "__main__":
    sys.exit(main())
