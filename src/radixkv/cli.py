"""The ``radixkv`` command line. Subcommands import their (heavier) modules lazily.

One error style: bad input prints one line ``error: FILE:LINE: what is wrong`` or
``error: --flag: what is wrong`` to stderr and exits 2; Ctrl-C exits 130; an unexpected
failure prints one ``error:`` line and exits 1. Never a traceback, unless ``--debug``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from radixkv import __version__
from radixkv.router.policies import KV_OVERLAP_WEIGHT

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


class CliError(Exception):
    """Bad input: printed as ``error: <message>``, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


def _number(kind: type, lo: float, what: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if not value >= lo:  # also refuses nan
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value

    return parse


positive_int = _number(int, 1, "a positive integer")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="radixkv", description="Automatic prefix caching for LLM KV caches.")
    parser.add_argument("--version", action="version", version=f"radixkv {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="show a traceback when something fails"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    # --debug is also taken after the subcommand; SUPPRESS keeps the top-level value
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )

    sim = sub.add_parser(
        "simulate",
        parents=[common],
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
        help="comma-separated: tokens (1M, 512k), blocks (2000blocks), KV bytes "
        "(8GiB or 8GB, with --model or --bytes-per-token) or inf [%(default)s]",
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
        type=positive_int,
        default=None,
        help="tokens per cache page for token traces and generated workloads [16]; "
        "Mooncake traces fix it at 512",
    )
    sim.add_argument("--model", help="bytes per token of a catalog model, for GiB capacities")
    sim.add_argument(
        "--tokenizer",
        help="for token traces whose lines carry text: 'byte' (UTF-8 bytes), 'smollm2', or "
        "a gguf_tokenizer.json written by the engine's weight converter",
    )
    sim.add_argument("--bytes-per-token", type=positive_int, help="custom KV bytes per token")
    sim.add_argument(
        "--cache-outputs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="cache prompt + output at finish, as engines do [on for generated "
        "workloads; Mooncake traces carry no output blocks]",
    )
    sim.add_argument(
        "--warmup",
        type=_number(float, 0.0, "a fraction in [0, 1)"),
        default=0.0,
        help="fraction of first requests left out of the rates [0]",
    )
    sim.add_argument("--requests", type=positive_int, help="replay only the first N requests")
    sim.add_argument("--json", dest="json_out", help="write results as JSON here ('-' stdout)")
    sim.add_argument("--csv", dest="csv_out", help="write results as CSV here ('-' stdout)")
    sim.add_argument("--plot", help="write a hit-rate-vs-capacity plot (PNG) here")
    sim.add_argument(
        "--tiers",
        action="store_true",
        help="simulate a device cache (--capacity) over a host tier (--host-capacity) and "
        "a shared store; report hits by tier",
    )
    sim.add_argument(
        "--host-capacity",
        default="0",
        help="with --tiers: comma-separated host tier sizes, in --capacity's units [0]",
    )
    sim.add_argument(
        "--shared",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --tiers: an unbounded shared store behind the host tier [on]",
    )
    sim.add_argument(
        "--replicas",
        help="comma-separated replica counts: route the trace over this many replicas, "
        "each of --capacity (e.g. 8,16,32,64)",
    )
    sim.add_argument(
        "--router",
        default=None,
        help="with --replicas: comma-separated round_robin, least_load, approx, kv, oracle "
        "or 'all' [all]",
    )
    sim.add_argument(
        "--kv-weight",
        type=_number(float, 0.0, "a non-negative number"),
        default=KV_OVERLAP_WEIGHT,
        help="the kv router's weight on prefill blocks (Dynamo's overlap_score_weight; "
        f"Dynamo's default is 1) [{KV_OVERLAP_WEIGHT:g}]",
    )
    sim.add_argument("--workers", type=positive_int, help="processes for the sweep [all cores]")
    demo = sub.add_parser(
        "demo",
        parents=[common],
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
    demo.add_argument("--max-new-tokens", type=positive_int, default=24)
    demo.add_argument("--page-size", type=positive_int, default=1)
    add_serve_parser(sub, common)
    add_bench_serve_parser(sub, common)
    add_route_parser(sub, common)
    return parser


def add_route_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    r = sub.add_parser(
        "route",
        parents=[common],
        help="a cache-aware router over several radixkv serve (or vLLM) replicas",
        description="An OpenAI-compatible proxy that sends each request to the replica "
        "most likely to hold its prefix, fed by the replicas' KV events.",
    )
    r.add_argument(
        "--worker",
        action="append",
        required=True,
        metavar="URL[,EVENTS]",
        help="a replica, e.g. http://127.0.0.1:8001,tcp://127.0.0.1:5557 (repeat the flag)",
    )
    r.add_argument("--policy", choices=["kv", "approx", "least_load", "round_robin"], default="kv")
    r.add_argument("--model", default="auto", help="whose tokenizer to route with [auto]")
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=_number(int, 0, "a port number"), default=8100)
    r.add_argument(
        "--kv-weight", type=_number(float, 0.0, "a non-negative number"),
        default=KV_OVERLAP_WEIGHT,
        help="weight on prefill blocks in the kv cost (Dynamo's overlap_score_weight; "
        f"Dynamo's default is 1) [{KV_OVERLAP_WEIGHT:g}]",
    )  # fmt: skip
    r.add_argument("--health-interval", type=_number(float, 0.05, "seconds >= 0.05"), default=1.0)
    r.add_argument("--kv-events-key", default=os.environ.get("RADIXKV_EVENTS_KEY"),
                   help="the workers' --kv-events-key [$RADIXKV_EVENTS_KEY]")  # fmt: skip
    _add_key_flags(r, "/workers: list, add, remove")
    r.add_argument("--worker-api-key", default=os.environ.get("RADIXKV_WORKER_API_KEY"),
                   help="the workers' --api-key: the router sends it to them (never the "
                   "client's key) [$RADIXKV_WORKER_API_KEY]")  # fmt: skip
    r.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"])  # fmt: skip


def _add_key_flags(parser: argparse.ArgumentParser, admin: str) -> None:
    """``--api-key`` and ``--admin-key``, as `radixkv.web.access` applies them on a
    server and on a router (``admin``: what the admin key opens)."""
    parser.add_argument("--api-key", default=os.environ.get("RADIXKV_API_KEY"),
                        help="every request but /health must send Authorization: Bearer "
                        "KEY [$RADIXKV_API_KEY; none: open]")  # fmt: skip
    parser.add_argument("--admin-key", default=os.environ.get("RADIXKV_ADMIN_KEY"),
                        help=f"the key admin endpoints ({admin}) need; without one they "
                        "answer 403 [$RADIXKV_ADMIN_KEY]")  # fmt: skip


def cmd_route(args: argparse.Namespace) -> int:
    _require_serve_extra()
    from radixkv.engine.engine import load_tokenizer
    from radixkv.router.proxy import Router, WorkerSpec, build_router_app, check_workers
    from radixkv.web.serving import uvicorn_server

    try:
        specs = [WorkerSpec.parse(w) for w in args.worker]
    except ValueError as e:
        raise CliError(f"--worker: {e}") from None
    try:
        tokenizer = load_tokenizer(args.model)
    except (ValueError, ModuleNotFoundError, FileNotFoundError) as e:
        raise CliError(f"--model {args.model}: {e}") from None
    from radixkv.router.proxy import ADMIN_PATHS
    from radixkv.web.access import Access

    try:
        access = Access.for_bind(
            args.host, api_key=args.api_key, admin_key=args.admin_key, admin_paths=ADMIN_PATHS
        )
        if args.worker_api_key is not None and not args.worker_api_key.strip():
            raise ValueError("worker_api_key must be a non-empty string")
    except ValueError as e:
        raise _flag_error(e) from None
    key = args.kv_events_key.encode() if args.kv_events_key else None
    router = Router(
        specs, args.policy, tokenizer, args.kv_weight, key, worker_key=args.worker_api_key
    )
    problems = check_workers(specs, tokenizer, headers=router.worker_headers)
    if problems:
        raise CliError("; ".join(problems))
    app = build_router_app(router, args.health_interval, access)
    print(
        f"radixkv route: {args.policy} over {len(specs)} workers on "
        f"http://{args.host}:{args.port}/v1 (Ctrl-C stops)",
        file=sys.stderr,
        flush=True,
    )
    server = uvicorn_server(app, args.host, args.port, args.log_level)
    server.run()
    if not server.started:
        raise CliError(f"--port: could not listen on {args.host}:{args.port}")
    return 0


def add_serve_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    serve = sub.add_parser(
        "serve",
        parents=[common],
        help="an OpenAI-compatible server with prefix caching",
        description="Serve a model over the OpenAI API (completions, chat, streaming) with "
        "prefix caching, Prometheus metrics at /metrics and per-tenant cache salts.",
    )
    serve.add_argument(
        "--model",
        default="auto",
        help="auto (SmolLM2 if installed, else a tiny random model), smollm2, random, or a "
        "checkpoint folder [auto]",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind [127.0.0.1]")
    serve.add_argument("--port", type=_number(int, 0, "a port number"), default=8000)
    serve.add_argument("--served-model-name", help="the model id clients send [the model's]")
    serve.add_argument("--page-size", type=positive_int, default=16, help="[16]")
    serve.add_argument("--kv-tokens", type=positive_int, default=65536, help="KV pool [65536]")
    serve.add_argument(
        "--max-running", type=positive_int, default=32, help="requests running at once [32]"
    )
    serve.add_argument(
        "--chunk-size", type=positive_int, default=512, help="prefill tokens per step [512]"
    )
    serve.add_argument(
        "--max-context-len", type=positive_int, default=4096, help="prompt + output [4096]"
    )
    serve.add_argument("--eviction-policy", default="lru", help="lru, lfu, fifo, ... [lru]")
    serve.add_argument("--schedule-policy", default="lpm", choices=["lpm", "fcfs"])
    serve.add_argument(
        "--no-prefix-cache", action="store_true", help="recompute every prompt (a baseline)"
    )
    serve.add_argument(
        "--max-queue",
        type=positive_int,
        default=1024,
        help="waiting requests at most; beyond, 503 with Retry-After [1024]",
    )
    serve.add_argument(
        "--storage",
        metavar="URL",
        help="a shared KV page store: redis://127.0.0.1:6379/0, file:///DIR or memory:// "
        "(write-through: prompts' missing pages are read from it, finished ones written)",
    )
    serve.add_argument(
        "--storage-secret",
        metavar="SECRET",
        help="a secret the engines sharing --storage hold: every page carries a MAC and "
        "one whose MAC fails is a miss (default: $RADIXKV_STORAGE_SECRET; prefer it, a "
        "command line is visible to other users). Without one, anyone who can write to "
        "the store can change what the engines compute",
    )
    serve.add_argument(
        "--host-tokens",
        type=_number(int, 0, "a non-negative integer"),
        default=0,
        help="KV tokens of a host-memory tier below the device pool [0: none]",
    )
    serve.add_argument(
        "--write-policy",
        choices=["write_through", "write_through_selective", "write_back"],
        default="write_through",
        help="when pages reach --storage [write_through]",
    )
    serve.add_argument(
        "--kv-events",
        metavar="ENDPOINT",
        help="publish KV events (vLLM's ZeroMQ wire) on this PUB address, e.g. "
        "tcp://127.0.0.1:5557; replay on the next port",
    )
    serve.add_argument("--kv-events-replay", metavar="ENDPOINT", help="[the next port]")
    serve.add_argument(
        "--kv-events-key",
        default=os.environ.get("RADIXKV_EVENTS_KEY"),
        help="a key shared with the router: tenants' cache salts travel as keyed digests "
        "under it [$RADIXKV_EVENTS_KEY; none: unkeyed digests]",
    )
    serve.add_argument(
        "--kv-events-mode",
        choices=["tokens", "hashes"],
        default="tokens",
        help="tokens: block hashes, token ids and salt digests (any router); hashes: block "
        "hashes only, no prompt text (a router that hashes as radixkv does) [tokens]",
    )
    serve.add_argument(
        "--kv-events-insecure",
        action="store_true",
        help="allow --kv-events on a non-loopback address: anyone who reaches it reads "
        "the events unauthenticated (see the README's 'Exposing it')",
    )
    _add_key_flags(serve, "/flush_cache")
    serve.add_argument(
        "--max-request-bytes",
        type=positive_int,
        default=4 << 20,
        help="the largest request body; beyond, 413 [4194304]",
    )
    serve.add_argument(
        "--allowed-hosts",
        metavar="NAMES",
        help="comma-separated host names a request's Host header may name [loopback names "
        "while --host is loopback; else any]",
    )
    serve.add_argument(
        "--check-memory",
        action="store_true",
        help="verify every memory invariant after each step; a violation stops the engine "
        "and /health turns 503 (slow: for tests and debugging)",
    )
    serve.add_argument(
        "--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"]
    )


def _flag_error(e: ValueError) -> CliError:
    """A config error ("kv_tokens must be ...", "url: ...") as ``--flag: message``."""
    text = str(e)
    name, _, rest = text.partition(" ")
    if name.endswith(":"):
        name, text = name[:-1], rest
    return CliError(f"--{name.replace('_', '-')}: {text}")


SERVE_MODULES = ("fastapi", "uvicorn", "prometheus_client", "httpx", "msgspec", "zmq")


def _require_serve_extra() -> None:
    import importlib.util

    lacking = [m for m in SERVE_MODULES if importlib.util.find_spec(m) is None]
    if lacking:
        raise CliError(
            f"needs {', '.join(lacking)} (the serve extra): pip install 'radixkv[serve]'"
        )


def add_bench_serve_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    b = sub.add_parser(
        "bench-serve",
        parents=[common],
        help="load-test an OpenAI-compatible server on loopback",
        description="Send a bounded, seeded workload to a server on this machine and report "
        "time to first token, inter-token and end-to-end latency (p50/p90/p99), throughput "
        "and the server's prefix-cache hit rate.",
    )
    b.add_argument("--url", default="http://127.0.0.1:8000", help="[http://127.0.0.1:8000]")
    b.add_argument("--workload", choices=["shared-prefix", "multi-turn", "file"],
                   default="shared-prefix")  # fmt: skip
    b.add_argument("--dataset", help="JSONL of prompts for --workload file")
    b.add_argument("--num-prompts", type=positive_int, default=64, help="requests at most [64]")
    b.add_argument(
        "--request-rate",
        type=_number(float, 0.0, "a positive number or inf"),
        default=math.inf,
        help="Poisson arrivals per second; inf sends at once [inf]",
    )
    b.add_argument("--max-concurrency", type=positive_int, default=8, help="in flight [8]")
    b.add_argument(
        "--time-limit",
        type=_number(float, 0.001, "a positive number of seconds"),
        default=600.0,
        help="seconds; then nothing new is sent and in-flight requests stop [600]",
    )
    b.add_argument("--max-tokens", type=positive_int, default=32, help="per request [32]")
    b.add_argument("--groups", type=positive_int, default=8, help="shared-prefix groups [8]")
    b.add_argument("--prompts-per-group", type=positive_int, default=8, help="[8]")
    b.add_argument("--system-words", type=positive_int, default=1000,
                   help="shared system prompt length in words (~tokens) [1000]")  # fmt: skip
    b.add_argument("--question-words", type=positive_int, default=24, help="[24]")
    b.add_argument("--conversations", type=positive_int, default=8, help="multi-turn [8]")
    b.add_argument("--turns", type=positive_int, default=4, help="multi-turn [4]")
    b.add_argument("--first-words", type=positive_int, default=200,
                   help="multi-turn first message length [200]")  # fmt: skip
    b.add_argument("--message-words", type=positive_int, default=24,
                   help="multi-turn later messages [24]")  # fmt: skip
    b.add_argument("--shared-system-words", type=_number(int, 0, "a non-negative integer"),
                   default=0, help="multi-turn: one system message of this many words opens "
                   "every conversation [0: none]")  # fmt: skip
    b.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    b.add_argument("--model", help="model id to send [the server's]")
    b.add_argument("--seed", type=_number(int, 0, "a non-negative integer"), default=0)
    b.add_argument("--api-key", default=os.environ.get("RADIXKV_API_KEY"),
                   help="for a server started with --api-key [$RADIXKV_API_KEY]")  # fmt: skip
    b.add_argument("--json", dest="json_out", help="write the report (with outputs) here")


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import asyncio

    _require_serve_extra()
    from rich.console import Console
    from rich.progress import Progress

    from radixkv.server.bench_serve import BenchConfig, format_report, run_bench, write_json

    _check_output("--json", args.json_out)
    if args.json_out == "-":
        raise CliError("--json: give a file name")
    try:
        names = {f.name for f in dataclasses.fields(BenchConfig)}  # the flags' own names
        cfg = BenchConfig(**{k: v for k, v in vars(args).items() if k in names})
    except ValueError as e:
        raise _flag_error(e) from None
    console = Console(stderr=True)
    import httpx

    try:
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task(f"{cfg.workload} requests", total=None)
            rep = asyncio.run(
                run_bench(cfg, lambda done, total: bar.update(task, completed=done, total=total))
            )
    except httpx.TransportError as e:
        raise CliError(f"--url {args.url}: cannot reach the server ({e})") from None
    except ValueError as e:
        raise CliError(str(e)) from None
    format_report(rep, Console())
    if args.json_out:
        write_json(rep, args.json_out)
    return 0 if rep["requests"]["completed"] else 1


def cmd_serve(args: argparse.Namespace) -> int:
    _require_serve_extra()
    from radixkv.engine.config import EngineConfig
    from radixkv.server.serve import ServeConfig, build_server

    if args.port > 65535:
        raise CliError(f"--port: must be a port number, got {args.port}")
    try:
        engine_config = EngineConfig(
            prefix_cache=not args.no_prefix_cache,
            page_size=args.page_size,
            schedule_policy=args.schedule_policy,
            chunk_size=args.chunk_size,
            max_running=args.max_running,
            kv_tokens=args.kv_tokens,
            max_context_len=args.max_context_len,
            eviction_policy=args.eviction_policy,
            check_memory=args.check_memory,
            storage=args.storage,
            host_tokens=args.host_tokens,
            write_policy=args.write_policy,
            storage_secret=args.storage_secret,
        )
    except ValueError as e:
        raise _flag_error(e) from None
    from radixkv.web.access import Access

    try:
        hosts = args.allowed_hosts
        access = Access.for_bind(
            args.host,
            api_key=args.api_key,
            admin_key=args.admin_key,
            max_request_bytes=args.max_request_bytes,
            allowed_hosts=tuple(h.strip().lower() for h in hosts.split(",")) if hosts else None,
        )
    except ValueError as e:
        raise _flag_error(e) from None
    serve = ServeConfig(
        args.model,
        args.host,
        args.port,
        args.served_model_name,
        args.max_queue,
        args.log_level,
        args.kv_events,
        args.kv_events_replay,
        access,
        args.kv_events_key,
        args.kv_events_mode == "tokens",
    )
    if args.kv_events:
        from radixkv.events import is_loopback_endpoint, replay_endpoint

        try:
            replay = args.kv_events_replay or replay_endpoint(args.kv_events)
        except ValueError as e:
            raise CliError(f"--kv-events: {e}") from None
        for flag, where in (("--kv-events", args.kv_events), ("--kv-events-replay", replay)):
            if not is_loopback_endpoint(where) and not args.kv_events_insecure:
                raise CliError(
                    f"{flag} {where}: not a loopback address, and KV events are "
                    "unauthenticated; add --kv-events-insecure to publish there"
                )
    try:
        server, aeng = build_server(serve, engine_config)
    except (FileNotFoundError, ValueError, ModuleNotFoundError) as e:
        raise CliError(f"--model {args.model}: {e}") from None
    except Exception as e:
        if type(e).__name__ == "ZMQError":  # pyzmq's: a bad or busy events address
            raise CliError(f"--kv-events {args.kv_events}: cannot bind ({e})") from None
        raise
    name = server.config.app.state.api.model_name
    print(
        f"radixkv serve: {name} ({aeng.engine.model_name}) on "
        f"http://{args.host}:{args.port}/v1 (Ctrl-C stops)",
        file=sys.stderr,
        flush=True,
    )
    server.run()
    if not server.started:
        raise CliError(f"--port: could not listen on {args.host}:{args.port}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from rich.console import Console

    from radixkv.engine.demo import run_demo

    try:
        summary = run_demo(args.model, args.max_new_tokens, args.page_size, Console())
    except (FileNotFoundError, ValueError, ModuleNotFoundError) as e:
        raise CliError(f"--model {args.model}: {e}") from None
    return 0 if all(w["identical"] for w in summary["workloads"].values()) else 1


def _tokenizer(name: str | None):  # -> Tokenizer | None
    if name is None:
        return None
    from radixkv.engine import tokenizer as tk
    from radixkv.engine.weights import smollm2_folder, smollm2_missing

    if name == "byte":
        return tk.ByteTokenizer()
    if name == "smollm2":
        missing = smollm2_missing()
        if missing:
            raise CliError(f"--tokenizer smollm2: {missing}")
        return tk.BPETokenizer(smollm2_folder() / "gguf_tokenizer.json")
    if not Path(name).is_file():
        raise CliError(
            f"--tokenizer: {name!r} is not 'byte', 'smollm2' or an existing gguf_tokenizer.json"
        )
    try:
        return tk.BPETokenizer(name)
    except (ValueError, KeyError, OSError) as e:
        raise CliError(f"--tokenizer {name}: not a gguf_tokenizer.json ({e})") from None


def _load_trace(args: argparse.Namespace):  # -> Trace
    from radixkv.sim import traces

    if args.trace:
        fmt = args.format
        try:
            if fmt is None:
                with open(args.trace, encoding="utf-8") as f:
                    first = next((line for line in f if line.strip()), "")
                fmt = "mooncake" if "hash_ids" in first else "tokens"
            if fmt == "mooncake":
                if args.block_size not in (None, traces.MOONCAKE_BLOCK):
                    raise CliError(
                        f"--block-size: Mooncake traces have {traces.MOONCAKE_BLOCK}-token "
                        f"blocks (their hash_ids fix it), got {args.block_size}"
                    )
                return traces.load_mooncake(args.trace)
            return traces.load_token_jsonl(
                args.trace, args.block_size or 16, _tokenizer(args.tokenizer)
            )
        except OSError as e:
            raise CliError(f"--trace {args.trace}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise CliError(f"--trace {args.trace}: not a UTF-8 text file") from None
        except ValueError as e:
            raise CliError(str(e)) from None
    gen = traces.GENERATORS[args.workload or "shared-prefix"]
    return gen(block_size=args.block_size or 16)


def _check_output(flag: str, dest: str | None) -> None:
    """Refuse an output path that cannot be written, before any work is done."""
    if dest is None or dest == "-":
        return
    path = Path(dest)
    if path.is_dir():
        raise CliError(f"{flag}: {dest} is a folder; give a file name")
    folder = path.parent
    if not folder.is_dir():
        raise CliError(f"{flag}: folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise CliError(f"{flag}: {dest} is not writable")


def _write(flag: str, dest: str, text: str) -> None:
    try:
        with open(dest, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise CliError(f"{flag}: cannot write {dest}: {e.strerror or e}") from None


def cmd_simulate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from radixkv.sim import replay, sweep

    for flag, dest in (("--json", args.json_out), ("--csv", args.csv_out), ("--plot", args.plot)):
        _check_output(flag, dest)
    if args.plot == "-":
        raise CliError("--plot: give a file name (a PNG cannot go to stdout)")
    if args.warmup >= 1.0:
        raise CliError(f"--warmup: must be a fraction in [0, 1), got {args.warmup}")
    if args.model and args.bytes_per_token:
        raise CliError("--bytes-per-token: give it or --model, not both")
    bpt = args.bytes_per_token
    if args.model:
        if args.model not in sweep.MODELS:
            raise CliError(f"--model: unknown {args.model!r}; known: {', '.join(sweep.MODELS)}")
        bpt = sweep.MODELS[args.model]
    valid = replay.POLICY_NAMES if args.scope == "tree" else replay.BLOCK_POLICIES
    default = "lru,lfu,belady" if args.scope == "tree" else "lru,fifo"
    policy_arg = args.policy or default
    policies = list(valid) if policy_arg == "all" else policy_arg.split(",")
    for p in policies:
        if p not in valid:
            raise CliError(
                f"--policy: unknown {p!r} for --scope {args.scope}; valid: {', '.join(valid)}"
            )
    console = Console(stderr=bool(args.json_out == "-" or args.csv_out == "-"))
    replica_counts = _replica_counts(args)
    trace = _load_trace(args)
    if args.requests:
        trace.requests = trace.requests[: args.requests]
    labels: dict[int | None, str] = {}
    try:
        for text in args.capacity.split(","):
            units = sweep.parse_capacity(text, trace.block_size, bpt)
            labels.setdefault(units, text.strip())
    except ValueError as e:
        raise CliError(f"--capacity: {e}") from None
    caps = list(labels)
    outputs = args.cache_outputs if args.cache_outputs is not None else not args.trace
    if replica_counts:
        return _simulate_replicas(args, trace, replica_counts, caps, labels, outputs, console)
    if args.tiers:
        return _simulate_tiers(args, trace, caps, labels, outputs, console, bpt)
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
    sweep.print_table(results, ceiling, trace, console, labels)
    for flag, dest, text in (
        ("--json", args.json_out, lambda: sweep.to_json(results, ceiling)),
        ("--csv", args.csv_out, lambda: sweep.to_csv(results)),
    ):
        if dest == "-":
            sys.stdout.write(text())
        elif dest:
            _write(flag, dest, text())
    if args.plot:
        try:
            sweep.plot(results, ceiling, trace, args.plot)
        except RuntimeError as e:
            raise CliError(f"--plot: {e}") from None
        except OSError as e:
            raise CliError(f"--plot: cannot write {args.plot}: {e.strerror or e}") from None
        console.print(f"plot written to {args.plot}", markup=False)
    return 0


def _simulate_tiers(
    args: argparse.Namespace,
    trace: Any,
    caps: list[int | None],
    labels: dict,
    outputs: bool,
    console: Any,
    bpt: int | None,
) -> int:
    import json

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
    results = [
        tiers.simulate_tiers(trace, cap, host, args.shared, outputs)
        for cap in caps
        for host in dict.fromkeys(hosts)
    ]
    tiers.print_tiers_table(results, console, labels)
    for cap in caps:
        for host in dict.fromkeys(hosts):
            if cap is not None:
                pooled = replay_pooled(trace, cap + host, outputs)
                console.print(
                    f"device {labels[cap]} + host {labels[('host', host)]}: one cache of that "
                    f"total size would hit {pooled:.4f}",
                    markup=False,
                )
    if args.json_out:
        text = json.dumps({"results": [r.to_dict() for r in results]}, indent=2)
        sys.stdout.write(text) if args.json_out == "-" else _write("--json", args.json_out, text)
    return 0


def replay_pooled(trace: Any, units: int, outputs: bool) -> float:
    from radixkv.sim.replay import simulate

    return simulate(trace, units, "lru", outputs).token_hit_rate


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


def _simulate_replicas(
    args: argparse.Namespace,
    trace: Any,
    counts: list[int],
    caps: list[int | None],
    labels: dict[int | None, str],
    outputs: bool,
    console: Any,
) -> int:
    import json

    from radixkv.sim import replicas

    names = replicas.ROUTERS if args.router in (None, "all") else tuple(args.router.split(","))
    for name in names:
        if name not in replicas.ROUTERS:
            raise CliError(f"--router: unknown {name!r}; valid: {', '.join(replicas.ROUTERS)}")
    results = []
    bounds = {}
    for cap in caps:
        for n in counts:
            bounds[(n, cap)] = replicas.pooled_bound(trace, n, cap)
            for name in names:
                results.append(
                    replicas.simulate_replicas(
                        trace, n, cap, name, outputs, kv_weight=args.kv_weight
                    )
                )
    replicas.print_replicas_table(results, console, labels)
    for (n, cap), bound in bounds.items():
        console.print(
            f"{n} replicas x {labels[cap]}: one cache as large as all of them would hit "
            f"{bound:.4f}",
            markup=False,
        )
    rows = [r.to_dict() | {"pooled_bound": bounds[(r.replicas, r.capacity_units)]} for r in results]
    if args.json_out:
        text = json.dumps({"results": rows}, indent=2)
        sys.stdout.write(text) if args.json_out == "-" else _write("--json", args.json_out, text)
    if args.plot:
        try:
            replicas.plot_replicas(results, args.plot)
        except RuntimeError as e:
            raise CliError(f"--plot: {e}") from None
        console.print(f"plot written to {args.plot}", markup=False)
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "simulate": cmd_simulate,
    "demo": cmd_demo,
    "serve": cmd_serve,
    "bench-serve": cmd_bench_serve,
    "route": cmd_route,
}


def _show_startup_progress() -> None:
    """Long start-up steps (a GGUF conversion, hashing weights) say what they do."""
    import logging

    startup = logging.getLogger("radixkv.startup")
    if not startup.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("radixkv: %(message)s"))
        startup.addHandler(handler)
        startup.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _show_startup_progress()
    command = COMMANDS.get(args.command)
    if command is None:
        parser.print_help()
        return 0
    try:
        return command(args)
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:
        if args.debug:
            raise
        print(
            f"error: {type(e).__name__}: {e} (run with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
