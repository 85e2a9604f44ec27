"""``radixkv bench-serve``: load-test an OpenAI-compatible server on loopback. The load
generator lives in `radixkv.bench`; this module parses, runs and prints.

Owns: the subcommand's flags. Must not touch: the load generator's logic."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from typing import Any

from radixkv.cli.common import (
    CliError,
    check_output,
    flag_error,
    make_console,
    number,
    positive_int,
    require_serve_extra,
)
from radixkv.cli.progress import progress

HELP = "load-test an OpenAI-compatible server on loopback"


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    b = sub.add_parser(
        "bench-serve",
        parents=[common],
        help=HELP,
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
        type=number(float, 0.0, "a positive number or inf"),
        default=math.inf,
        help="Poisson arrivals per second; inf sends at once [inf]",
    )
    b.add_argument("--max-concurrency", type=positive_int, default=8, help="in flight [8]")
    b.add_argument(
        "--time-limit",
        type=number(float, 0.001, "a positive number of seconds"),
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
    b.add_argument("--shared-system-words", type=number(int, 0, "a non-negative integer"),
                   default=0, help="multi-turn: one system message of this many words opens "
                   "every conversation [0: none]")  # fmt: skip
    b.add_argument("--cache-keys", action="store_true",
                   help="shared-prefix: each group sends its own prompt_cache_key "
                   "(tenant-<group>)")  # fmt: skip
    b.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    b.add_argument("--model", help="model id to send [the server's]")
    b.add_argument("--seed", type=number(int, 0, "a non-negative integer"), default=0)
    b.add_argument("--api-key", default=os.environ.get("RADIXKV_API_KEY"),
                   help="for a server started with --api-key [$RADIXKV_API_KEY]")  # fmt: skip
    b.add_argument("--json", dest="json_out", help="write the report (with outputs) here")


def run(args: argparse.Namespace) -> int:
    import asyncio

    require_serve_extra()
    from radixkv.bench.client import BenchConfig, format_report, run_bench, write_json

    check_output("--json", args.json_out)
    if args.json_out == "-":
        raise CliError("--json: give a file name")
    try:
        names = {f.name for f in dataclasses.fields(BenchConfig)}  # the flags' own names
        cfg = BenchConfig(**{k: v for k, v in vars(args).items() if k in names})
    except ValueError as e:
        raise flag_error(e) from None
    console = make_console(stderr=True)
    import httpx

    try:
        with progress(console, f"bench-serve {cfg.workload}: requests done") as update:
            rep = asyncio.run(run_bench(cfg, update))
    except httpx.TransportError as e:
        raise CliError(f"--url {args.url}: cannot reach the server ({e})") from None
    except ValueError as e:
        raise CliError(str(e)) from None
    format_report(rep, make_console())
    if args.json_out:
        write_json(rep, args.json_out)
    return 0 if rep["requests"]["completed"] else 1
