"""``radixkv simulate``: replay a trace through the radix cache (hit rate against capacity
and policy), over tiers (``--tiers``) or over routed replicas (``--replicas``). The
replays live in `radixkv.sim`; this module parses, calls and prints.

Owns: the subcommand's flags and its printing. Must not touch: the replays
(`radixkv.sim`)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from radixkv.cli.common import (
    CliError,
    check_output,
    flag_error,
    make_console,
    number,
    positive_int,
)
from radixkv.cli.common import write_output as write
from radixkv.cli.progress import progress
from radixkv.router.policies import KV_OVERLAP_WEIGHT
from radixkv.units import BYTE_UNITS, parse_bytes

BYTE_SUFFIXES = tuple(u for u in BYTE_UNITS if u)  # "B", "KiB", ... "GB"

HELP = "replay a trace through the radix cache: hit rate vs capacity and policy"


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    sim = sub.add_parser(
        "simulate", parents=[common], help=HELP,
        description="Replay a request trace (or a built-in workload) through the radix cache "
        "and report how much prefill prefix caching saves.",
    )  # fmt: skip
    _input_flags(sim)
    _model_flags(sim)
    _output_flags(sim)
    _tiers_flags(sim)


def _input_flags(parser: argparse.ArgumentParser) -> None:
    sim = parser.add_argument_group("the trace and the cache")
    src = sim.add_mutually_exclusive_group()
    src.add_argument("--trace", help="a trace file (JSONL), or for --format agentic a "
                     "kv-cache-tester trace (.json, .json.gz) or a folder of them")  # fmt: skip
    src.add_argument("--workload", choices=["chat", "few-shot", "multi-turn", "shared-prefix"],
                     help="a built-in generated workload (default: shared-prefix)")  # fmt: skip
    sim.add_argument("--format", choices=["mooncake", "marconi", "tokens", "agentic", "served"],
                     default=None, help="trace format (default: agentic for a folder or a "
                     ".json/.json.gz file, else guessed from the first line); served: what "
                     "serve --served-log wrote, replayed with the server's own knobs and "
                     "arrivals, each request's cached tokens checked against the "
                     "server's")  # fmt: skip
    agent = parser.add_argument_group("agentic traces (--format agentic: recorded Claude "
                                      "Code sessions, kv-cache-tester's format)")  # fmt: skip
    agent.add_argument("--sessions", type=positive_int, default=None,
                       help="draw this many conversations (without replacement), each "
                       "starting at a uniform random time within --span [all, at 0]")  # fmt: skip
    agent.add_argument("--seed", type=number(int, 0, "an int >= 0"), default=0,
                       help="the draw's seed [0]")  # fmt: skip
    agent.add_argument("--span", type=number(float, 0.0, "seconds >= 0", 1e9), default=3600.0,
                       help="seconds the drawn sessions start within [3600]")  # fmt: skip
    agent.add_argument("--warm-prefix", type=number(float, 0.0, "a fraction in [0, 1]", 1.0),
                       default=0.0, metavar="P",
                       help="the first P of each trace's tool + system tokens is one "
                       "prefix every session shares, as kv-cache-tester's client models it "
                       "[0]")  # fmt: skip
    agent.add_argument("--max-context", type=positive_int, default=None, metavar="TOKENS",
                       help="as kv-cache-tester's client: draw only conversations whose "
                       "first call fits, and end each session before its first call over "
                       "it [none]")  # fmt: skip
    agent.add_argument("--recycle", action="store_true",
                       help="draw --sessions with replacement, each draw a session of its "
                       "own (the client's --recycle: a trace replayed with new text)")  # fmt: skip
    sim.add_argument(
        "--capacity", default="64k,256k,1M,inf",
        help="comma-separated: tokens (1M, 512k), blocks (2000blocks), KV bytes "
        "(8GiB or 8GB, with --model or --bytes-per-token) or inf [%(default)s]",
    )  # fmt: skip
    sim.add_argument("--policy", default=None,
                     help="comma-separated eviction policies, or 'all' [lru,lfu,belady; "
                     "lru,fifo with --scope block]")  # fmt: skip
    sim.add_argument("--scope", choices=["tree", "block"], default="tree",
                     help="tree: evict leaves only, as a radix cache (SGLang, radixkv); block: "
                     "evict any block, as a hash-based block pool (vLLM) [tree]")  # fmt: skip
    sim.add_argument("--block-size", type=positive_int, default=None,
                     help="tokens per cache page for token traces and generated workloads "
                     "[16]; Mooncake traces fix it at 512")  # fmt: skip


def _model_flags(parser: argparse.ArgumentParser) -> None:
    sim = parser.add_argument_group("model memory and accounting")
    sim.add_argument("--model", help="bytes per token of a catalog model, for GiB capacities")
    sim.add_argument("--model-spec", default=None,
                     help="a hybrid model (full, sliding-window and recurrent layers): a "
                     "preset (qwen3.5-4b, nemotron-h, gemma-3), a JSON file, or a model "
                     "folder (its config.json, in the bytes serve holds); replays with "
                     "the hybrid policies (radixkv; marconi, sglang+, vllm+ by Marconi's "
                     "own rules; sglang, vllm; and serve: the engine's own scheduler "
                     "and memory replayed without the model (a folder's, or one that is "
                     "only the spec's bytes; a hash-id trace in its units), index-only, "
                     "serve-sglang: the same with SGLang's fixed split of the bytes, "
                     "serve-session: with serve's session eviction order; "
                     "named only, session: radixkv's budget in the session order, for "
                     "agentic traces); capacities in bytes. Its table: full KV, window KV "
                     "and states are the bytes each kind held (the mean after each request), "
                     "checkpoints the states taken, hit grid the tokens a hit counts in; "
                     "a row marked * held past its capacity by Marconi's own rules "
                     "(docs/simulation.md, 'Reading the hybrid table')")  # fmt: skip
    sim.add_argument("--accounting", choices=["served", "after"], default=None,
                     help="with --model-spec: when a request's new KV counts against the "
                     "budget: served (while it runs, as the engine holds it) or after (once "
                     "cached, as Marconi's simulator counts); for radixkv, sglang and "
                     "vllm (serve is the engine; Marconi's rows count after) "
                     "[served]")  # fmt: skip
    sim.add_argument("--schedule", choices=["fcfs", "lpm"], default=None,
                     help="with --model-spec: the order requests are served in: fcfs (the "
                     "trace's) or lpm (the engine's default: of the requests that arrive "
                     "together, the longest cached prefix first) [lpm for serve, as "
                     "radixkv serve runs; fcfs for the others]")  # fmt: skip
    sim.add_argument(
        "--concurrency",
        type=positive_int,
        default=None,
        help="with --policy serve: requests the engine runs at once [1]",
    )
    sim.add_argument(
        "--chunk-size",
        type=positive_int,
        default=None,
        help="with --policy serve: prefill tokens a step, as serve's [512]",
    )
    sim.add_argument(
        "--checkpoint-every",
        type=positive_int,
        default=None,
        help="with --model-spec: the radixkv policy and serve also checkpoint every N "
        "tokens of a prompt, as serve --checkpoint-every does (a multiple of the trace's "
        "block size; the other rows are the peers' own) [never]",
    )
    sim.add_argument("--tokenizer",
                     help="for token traces whose lines carry text: 'byte' (UTF-8 bytes), "
                     "'smollm2', or a gguf_tokenizer.json written by the engine's weight "
                     "converter")  # fmt: skip
    sim.add_argument("--bytes-per-token", type=positive_int, help="custom KV bytes per token")
    sim.add_argument("--cache-outputs", action=argparse.BooleanOptionalAction, default=None,
                     help="cache prompt + output at finish, as engines do [on when the trace "
                     "carries outputs: generated workloads, Marconi traces, token traces "
                     "with outputs; Mooncake traces carry none]")  # fmt: skip


def _output_flags(parser: argparse.ArgumentParser) -> None:
    sim = parser.add_argument_group("output")
    sim.add_argument("--warmup", type=number(float, 0.0, "a fraction in [0, 1)"), default=0.0,
                     help="fraction of first requests left out of the rates [0]")  # fmt: skip
    sim.add_argument("--requests", type=positive_int, help="replay only the first N requests")
    sim.add_argument("--json", dest="json_out", help="write results as JSON here ('-' stdout)")
    sim.add_argument("--csv", dest="csv_out", help="write results as CSV here ('-' stdout)")
    sim.add_argument("--plot", help="write a hit-rate-vs-capacity plot (PNG) here")


def _tiers_flags(parser: argparse.ArgumentParser) -> None:
    sim = parser.add_argument_group("tiers, replicas and the sweep")
    sim.add_argument("--tiers", action="store_true",
                     help="simulate a device cache (--capacity) over a host tier "
                     "(--host-capacity) and a shared store; report hits by tier")  # fmt: skip
    sim.add_argument("--host-capacity", default="0",
                     help="with --tiers: comma-separated host tier sizes, in --capacity's "
                     "units [0]")  # fmt: skip
    sim.add_argument(
        "--shared",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --tiers: an unbounded shared store behind the host tier [on]",
    )
    sim.add_argument(
        "--host-bandwidth", type=number(float, 1e-3, "GB/s > 0", 1e6), default=25.0, metavar="GB/S",
        help="with --tiers: the host link's bandwidth, for the time host hits add to a "
        "request's first token (with --model or --bytes-per-token) [25: PCIe 4.0 x16]",
    )  # fmt: skip
    sim.add_argument(
        "--prefetch-within", type=number(float, 1e-3, "seconds > 0", 1e9), metavar="SECONDS",
        help="with --tiers, on a trace with sessions: load a waiting session's pages from "
        "the host tier in the link's idle time when it is predicted back within SECONDS "
        "(as the session order predicts; under --policy session a load evicts only what "
        "returns later) [off]",
    )  # fmt: skip
    sim.add_argument("--replicas",
                     help="comma-separated replica counts: route the trace over this many "
                     "replicas, each of --capacity (e.g. 8,16,32,64)")  # fmt: skip
    sim.add_argument("--router", default=None,
                     help="with --replicas: comma-separated round_robin, least_load, approx, "
                     "kv, oracle or 'all' [all]")  # fmt: skip
    sim.add_argument(
        "--kv-weight", type=number(float, 0.0, "a non-negative number"), default=KV_OVERLAP_WEIGHT,
        help="the kv router's weight on prefill blocks (Dynamo's overlap_score_weight; "
        f"Dynamo's default is 1) [{KV_OVERLAP_WEIGHT:g}]",
    )  # fmt: skip
    sim.add_argument("--workers", type=positive_int, help="processes for the sweep [all cores]")


def _load_trace(args: argparse.Namespace) -> Any:
    from radixkv.sim import traces
    from radixkv.sim.agentic import looks_agentic

    agentic = args.format == "agentic" or (
        args.format is None and bool(args.trace) and looks_agentic(args.trace))
    if not agentic:
        for flag, dest, default in _AGENTIC:
            if getattr(args, dest) != default:
                raise CliError(f"{flag}: only with --format agentic")
    if not args.trace:
        return traces.GENERATORS[args.workload or "shared-prefix"](block_size=args.block_size or 16)
    if agentic:
        return _load_agentic(args)
    tokenizer = None
    if args.tokenizer is not None:
        from radixkv.tokenizer import load_tokenizer

        try:
            tokenizer = load_tokenizer(args.tokenizer)
        except (ValueError, ModuleNotFoundError) as e:
            raise CliError(f"--tokenizer: {e}") from None
    with _trace_errors(args.trace):
        return traces.load_trace(args.trace, args.format, args.block_size, tokenizer)


@contextmanager
def _trace_errors(path: str) -> Iterator[None]:
    """A trace that cannot be read, or a bad record in it, as one CLI error line."""
    from radixkv.checkpoint.files import FolderError
    from radixkv.sim import traces

    try:
        yield
    except OSError as e:
        raise CliError(f"--trace {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise CliError(f"--trace {path}: not a UTF-8 text file") from None
    except traces.TraceError as e:
        raise CliError(str(e)) from None
    except FolderError as e:
        raise CliError(f"--trace {e}") from None
    except ValueError as e:
        raise flag_error(e) from None


def _is_served(args: argparse.Namespace) -> bool:
    from radixkv.sim.served import is_served_log

    if args.format is not None or not args.trace or not Path(args.trace).is_file():
        return args.format == "served"
    with _trace_errors(args.trace):
        return is_served_log(args.trace)


def _defaults() -> dict[str, Any]:
    """Each of the subcommand's flags (by its dest), with its default."""
    parser = argparse.ArgumentParser(add_help=False)
    for add in (_input_flags, _model_flags, _output_flags, _tiers_flags):
        add(parser)
    return vars(parser.parse_args([]))


_AGENTIC = (("--sessions", "sessions", None), ("--seed", "seed", 0), ("--span", "span", 3600.0),
            ("--warm-prefix", "warm_prefix", 0.0), ("--max-context", "max_context", None),
            ("--recycle", "recycle", False))  # fmt: skip


def _load_agentic(args: argparse.Namespace) -> Any:
    from radixkv.sim.agentic import load_agentic

    if args.block_size is not None:
        raise CliError("--block-size: an agentic trace's hash ids fix it (its block_size)")
    with _trace_errors(args.trace):
        return load_agentic(args.trace, args.sessions, args.seed, args.span, args.warm_prefix,
                            args.max_context, args.recycle)  # fmt: skip


def _replica_counts(args: argparse.Namespace) -> list[int]:
    if args.replicas is None:
        if args.router is not None:
            raise CliError("--router: needs --replicas")
        return []
    try:
        counts = [int(x) for x in args.replicas.split(",")]
    except ValueError:
        raise CliError(f"--replicas: expected counts like 8,16,32, got {args.replicas!r}") from None
    if any(c < 1 for c in counts):
        raise CliError(f"--replicas: counts must be positive, got {args.replicas!r}")
    return counts


def run(args: argparse.Namespace) -> int:

    from radixkv.sim import sweep

    for flag, dest in (("--json", args.json_out), ("--csv", args.csv_out), ("--plot", args.plot)):
        check_output(flag, dest)
    if args.plot == "-":
        raise CliError("--plot: give a file name (a PNG cannot go to stdout)")
    if args.warmup >= 1.0:
        raise CliError(f"--warmup: must be a fraction in [0, 1), got {args.warmup}")
    for flag, given in (("--prefetch-within", args.prefetch_within is not None),
                        ("--host-capacity", args.host_capacity != "0")):  # fmt: skip
        if given and not args.tiers:
            raise CliError(f"{flag}: only with --tiers")
    if _is_served(args):
        from radixkv.cli.simulate_served import run_served

        return run_served(args, _defaults(), _trace_errors)
    if args.model_spec is not None:
        return _hybrid(args)
    for flag, dest in _HYBRID_ONLY:
        if getattr(args, dest) is not None:
            raise CliError(f"{flag}: only with --model-spec (the hybrid replay)")
    if args.model and args.bytes_per_token:
        raise CliError("--bytes-per-token: give it or --model, not both")
    bpt = args.bytes_per_token
    if args.model:
        if args.model not in sweep.MODELS:
            raise CliError(f"--model: unknown {args.model!r}; known: {', '.join(sweep.MODELS)}")
        bpt = sweep.MODELS[args.model]
    try:
        policies = sweep.policy_list(args.policy, args.scope)
    except ValueError as e:
        raise flag_error(e) from None
    console = make_console(stderr=bool(args.json_out == "-" or args.csv_out == "-"))
    counts = _replica_counts(args)
    trace = _load_trace(args)
    if args.requests:
        trace.requests = trace.requests[: args.requests]
    try:
        labels = sweep.capacities(args.capacity, trace.block_size, bpt)
    except ValueError as e:
        raise CliError(f"--capacity: {e}") from None
    caps = list(labels)
    outputs = trace.carries_outputs() if args.cache_outputs is None else args.cache_outputs
    if counts:
        return _replicas(args, trace, counts, caps, labels, outputs, console)
    if args.tiers:
        return _tiers(args, trace, caps, labels, outputs, console, bpt)
    return _sweep(args, trace, caps, labels, policies, outputs, console)


def _sweep(args, trace, caps, labels, policies, outputs, console) -> int:  # type: ignore[no-untyped-def]
    from radixkv.sim import sweep

    total, done = len(sweep.bounded_caps(caps)) * len(policies), [0]
    what = f"replaying {len(trace.requests):,} requests: (capacity, policy) rows done"
    with progress(None, what, total) as update:

        def advance(_r: object) -> None:
            done[0] += 1
            update(done[0])

        results, ceiling = sweep.run_sweep(
            trace, caps, policies, outputs, args.warmup, args.workers,
            progress=advance, scope=args.scope,
        )  # fmt: skip
    sweep.print_table(results, ceiling, trace, console, labels)
    write("--json", args.json_out, lambda: sweep.to_json(results, ceiling))
    write("--csv", args.csv_out, lambda: sweep.to_csv(results))
    _plot(args.plot, lambda: sweep.plot(results, ceiling, trace, args.plot), console)
    return 0


def _plot(path: str | None, draw, console) -> None:  # type: ignore[no-untyped-def]
    """``--plot``: draw, or one line naming the flag."""
    if not path:
        return
    try:
        draw()
    except RuntimeError as e:
        raise CliError(f"--plot: {e}") from None
    except OSError as e:
        raise CliError(f"--plot: cannot write {path}: {e.strerror or e}") from None
    console.print(f"plot written to {path}", markup=False)


def _tiers(args, trace, caps, labels, outputs, console, bpt) -> int:  # type: ignore[no-untyped-def]
    from radixkv.sim import sweep, tiers

    hosts = []
    try:
        for text in args.host_capacity.split(","):
            units = sweep.parse_capacity(text, trace.block_size, bpt)
            if units is None:
                raise ValueError(f"capacity {text!r}: the host tier must be bounded")
            labels.setdefault(("host", units), text.strip())
            hosts.append(units)
    except ValueError as e:
        raise CliError(f"--host-capacity: {e}") from None
    policies = tuple(dict.fromkeys((args.policy or "lru").split(",")))
    for p in policies:
        if p not in ("lru", "session"):
            raise CliError(f"--policy: with --tiers the device's order is lru or session, "
                           f"got {p!r}")  # fmt: skip
    results, pooled = tiers.sweep_tiers(trace, caps, hosts, args.shared, outputs, policies,
                                        _ahead(args, trace, bpt))  # fmt: skip
    tiers.print_tiers_table(results, console, labels)
    for cap, host, rate in pooled:
        console.print(f"device {labels[cap]} + host {labels[('host', host)]}: one cache of "
                      f"that total size would hit {rate:.4f}", markup=False)  # fmt: skip
    bw = args.host_bandwidth * 1e9
    for r in results:
        if not (r.host_hit_requests and bpt):
            continue
        ahead = (f"; {r.prefetched_tokens:,} tokens loaded ahead of their session's return"
                 if args.prefetch_within else "")  # fmt: skip
        each, p90 = r.load_seconds(bpt, bw), r.load_p90_seconds(bpt, bw)
        mean = each * r.host_hit_requests / r.requests
        console.print(f"device {labels[r.device_units]} ({r.policy}) + host "
                      f"{labels[('host', r.host_units)]}: {r.host_hit_requests:,} requests "
                      f"loaded from the host when they arrived, {each * 1000:.1f} ms each; "
                      f"over all requests {mean * 1000:.1f} ms mean, {p90 * 1000:.1f} ms p90 "
                      f"({args.host_bandwidth:g} GB/s, {bpt:,} bytes a token){ahead}",
                      markup=False)  # fmt: skip
    rows = {"results": [r.to_dict() for r in results]}
    write("--json", args.json_out, lambda: json.dumps(rows, indent=2))
    return 0


def _ahead(args, trace, bpt):  # type: ignore[no-untyped-def]
    """``--prefetch-within``: the link's speed in tokens a ms, and the horizon."""
    from radixkv.sim.tiers import Ahead

    if args.prefetch_within is None:
        return None
    if not bpt:
        raise CliError("--prefetch-within: give --model or --bytes-per-token (a load's time "
                       "is its bytes over --host-bandwidth)")  # fmt: skip
    if not any(r.session is not None for r in trace.requests):
        raise CliError("--prefetch-within: the trace has no sessions (--format agentic has)")
    return Ahead(args.host_bandwidth * 1e9 / bpt / 1000.0, args.prefetch_within * 1000.0)


def _replicas(args, trace, counts, caps, labels, outputs, console) -> int:  # type: ignore[no-untyped-def]
    from radixkv.sim import replicas

    try:
        names = replicas.router_list(args.router)
    except ValueError as e:
        raise flag_error(e) from None
    results, bounds = replicas.sweep_replicas(trace, counts, caps, names, outputs, args.kv_weight)
    replicas.print_replicas_table(results, console, labels)
    for (n, cap), bound in bounds.items():
        console.print(f"{n} replicas x {labels[cap]}: one cache as large as all of them would "
                      f"hit {bound:.4f}", markup=False)  # fmt: skip
    rows = [r.to_dict() | {"pooled_bound": bounds[(r.replicas, r.capacity_units)]} for r in results]
    write("--json", args.json_out, lambda: json.dumps({"results": rows}, indent=2))
    if args.plot:
        try:
            replicas.plot_replicas(results, args.plot)
        except RuntimeError as e:
            raise CliError(f"--plot: {e}") from None
        console.print(f"plot written to {args.plot}", markup=False)
    return 0


def _hybrid_row(
    args: argparse.Namespace, trace: Any, spec: Any, cap: int, outputs: bool, policy: str
) -> Any:
    """One policy's row at one capacity: the engine's replay, or the budget simulator."""
    from radixkv.sim import hybrid

    if policy in SERVE:
        return _serve(args, trace, spec, cap, outputs, policy)
    every = (args.checkpoint_every or 0) if policy == "radixkv" else 0
    try:
        return hybrid.simulate_hybrid(trace, spec, cap, policy, outputs,
                                      args.accounting or "served", args.schedule or "fcfs",
                                      checkpoint_every=every)  # fmt: skip
    except ValueError as e:
        text = str(e)
        if not text.startswith("checkpoint_every"):
            raise
        raise CliError("--checkpoint-every" + text.removeprefix("checkpoint_every")) from None


# flags the hybrid replay has no use for: refused rather than ignored
_NOT_HYBRID = (("--model", "model"), ("--bytes-per-token", "bytes_per_token"),
               ("--tiers", "tiers"), ("--replicas", "replicas"), ("--router", "router"),
               ("--warmup", "warmup"), ("--csv", "csv_out"), ("--workers", "workers"))  # fmt: skip


_HYBRID_ONLY = (("--accounting", "accounting"), ("--schedule", "schedule"),
                ("--concurrency", "concurrency"), ("--chunk-size", "chunk_size"),
                ("--checkpoint-every", "checkpoint_every"))  # fmt: skip


# the engine: its --cache-split and --eviction-policy
SERVE = {"serve": ("one", "lru"), "serve-sglang": ("sglang", "lru"),
         "serve-session": ("one", "session")}  # fmt: skip


def _serve(
    args: argparse.Namespace, trace: Any, spec: Any, cap: int, outputs: bool, policy: str
) -> Any:
    from radixkv.sim.serve_replay import serve_result

    try:
        folder = args.model_spec if Path(args.model_spec).is_dir() else None
        return serve_result(trace, folder, spec, cap, args.concurrency or 1, outputs,
                            chunk_size=args.chunk_size or 512, schedule=args.schedule or "lpm",
                            split=SERVE[policy][0], eviction=SERVE[policy][1],
                            checkpoint_every=args.checkpoint_every or 0)  # fmt: skip
    except ValueError as e:
        text = str(e)
        if text.startswith("cache_bytes: "):
            raise CliError(f"--capacity: {text.removeprefix('cache_bytes: ')}") from None
        raise CliError(f"--policy serve: {text}") from None


def _hybrid(args: argparse.Namespace) -> int:
    from radixkv.sim import hybrid, hybrid_table, sweep, traces

    for flag, dest in _NOT_HYBRID:
        if getattr(args, dest, None):
            raise CliError(f"{flag}: not with --model-spec (the hybrid replay has its own budget)")
    if args.scope != "tree":
        raise CliError("--scope: not with --model-spec")
    try:
        spec = hybrid.model_spec(args.model_spec)
    except (ValueError, TypeError) as e:
        raise CliError(f"--model-spec: {e}") from None
    except OSError as e:
        raise CliError(f"--model-spec {args.model_spec}: {e.strerror or e}") from None
    policies = (args.policy or ",".join(hybrid.POLICIES)).split(",")
    valid = (*hybrid.POLICIES, hybrid.SESSION, *SERVE)
    bad = [p for p in policies if p not in valid]
    if bad:
        raise CliError(f"--policy: unknown {bad[0]!r} with --model-spec; valid: "
                       f"{', '.join(valid)}")  # fmt: skip
    serve = bool(SERVE.keys() & set(policies))
    for flag, value in (("--concurrency", args.concurrency), ("--chunk-size", args.chunk_size)):
        if value is not None and not serve:
            raise CliError(f"{flag}: only with --policy serve (the engine's own knob)")
    if args.checkpoint_every and not (serve or "radixkv" in policies):
        raise CliError("--checkpoint-every: only for the radixkv policy and serve (the "
                       "engine's knob; the other rows are the peers' own)")  # fmt: skip
    trace = _load_trace(args)
    if trace.block_size == traces.MOONCAKE_BLOCK:  # hybrid caches work in pages
        try:
            trace = traces.split_blocks(trace, args.block_size or 16)
        except ValueError as e:
            raise flag_error(e) from None
    if args.requests:
        trace.requests = trace.requests[: args.requests]
    per_token = spec.full_kv + spec.window_kv
    caps = []
    try:
        for text in args.capacity.split(","):
            units = sweep.parse_capacity(text, trace.block_size, per_token)  # validates
            if units is None:
                caps.append(hybrid.UNBOUNDED)
            elif text.strip().endswith(BYTE_SUFFIXES):  # bytes, exactly
                caps.append(parse_bytes(text))
            else:  # tokens or blocks
                caps.append(units * trace.block_size * per_token)
    except ValueError as e:
        raise CliError(f"--capacity: {e}") from None
    if serve and hybrid.UNBOUNDED in caps:
        raise CliError("--capacity: the serve policy replays a finite budget; give bytes, not inf")
    outputs = trace.carries_outputs() if args.cache_outputs is None else args.cache_outputs
    console = make_console(stderr=args.json_out == "-")
    results = []
    what = f"replaying {len(trace.requests):,} requests: (capacity, policy) rows done"
    with progress(None, what, len(caps) * len(policies)) as update:
        for cap in caps:
            for policy in policies:
                results.append(_hybrid_row(args, trace, spec, cap, outputs, policy))
                update(len(results))
    hybrid_table.print_hybrid_table(results, trace, spec, console)
    rows = {"model": spec.__dict__, "results": [r.to_dict() for r in results]}
    write("--json", args.json_out, lambda: json.dumps(rows, indent=2))
    _plot(args.plot, lambda: hybrid_table.plot_hybrid(results, trace, spec, args.plot),
          console)  # fmt: skip
    return 0
