"""``radixkv route``: a cache-aware router over several ``radixkv serve`` (or vLLM)
replicas. The router lives in `radixkv.router`; this module parses, checks and runs it.

Owns: the subcommand's flags and the router's start-up checks. Must not touch: routing."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from radixkv.cli.common import (
    LOG_LEVELS,
    CliError,
    add_key_flags,
    flag_error,
    listen,
    number,
    positive_int,
    require_serve_extra,
)
from radixkv.router.policies import KV_OVERLAP_WEIGHT

HELP = "a cache-aware router over several radixkv serve (or vLLM) replicas"


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    r = sub.add_parser(
        "route",
        parents=[common],
        help=HELP,
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
    r.add_argument("--model", default=None,
                   help="whose tokenizer to route with (auto, random, smollm2, a folder) "
                   "[the workers': their /v1/models cards name it]")  # fmt: skip
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=number(int, 0, "a port number"), default=8100)
    r.add_argument(
        "--kv-weight", type=number(float, 0.0, "a non-negative number"),
        default=KV_OVERLAP_WEIGHT,
        help="weight on prefill blocks in the kv cost (Dynamo's overlap_score_weight; "
        f"Dynamo's default is 1) [{KV_OVERLAP_WEIGHT:g}]",
    )  # fmt: skip
    r.add_argument("--block-size", type=positive_int, default=None,
                   help="the workers' KV page size, for workers whose /v1/models does not "
                   "say it (vLLM) [the workers' cards]")  # fmt: skip
    r.add_argument("--health-interval", type=number(float, 0.05, "seconds >= 0.05"), default=1.0)
    r.add_argument("--worker-connections", type=positive_int, default=64,
                   help="connections to each worker at once: a hung worker cannot take "
                   "those the others need [64]")  # fmt: skip
    r.add_argument("--header-timeout", type=number(float, 0.001, "seconds > 0", 1e7),
                   default=1800.0, metavar="SECONDS",
                   help="seconds a worker has to start its answer (a non-streamed answer "
                   "starts when it is whole); past it the client gets a 504 and the worker's "
                   "connection is closed, which cancels the request [1800]")  # fmt: skip
    r.add_argument("--breaker-failures", type=number(int, 0, "an int >= 0", 1 << 20),
                   default=5, metavar="N",
                   help="failed requests in a row (5xx, no headers in time, a broken "
                   "connection) that take a worker out; 0: never [5]")  # fmt: skip
    r.add_argument("--breaker-cooldown", type=number(float, 0.001, "seconds > 0", 1e6),
                   default=10.0, metavar="SECONDS",
                   help="seconds a worker stays out before one request tries it; doubled "
                   "each time that request fails, up to 120 [10]")  # fmt: skip
    r.add_argument("--kv-events-key", default=os.environ.get("RADIXKV_EVENTS_KEY"),
                   help="the workers' --kv-events-key [$RADIXKV_EVENTS_KEY]")  # fmt: skip
    add_key_flags(r, "/workers: list, add, remove")
    r.add_argument("--worker-api-key", default=os.environ.get("RADIXKV_WORKER_API_KEY"),
                   help="the workers' --api-key: the router sends it to them (never the "
                   "client's key) [$RADIXKV_WORKER_API_KEY]")  # fmt: skip
    r.add_argument("--log-level", default="warning", choices=LOG_LEVELS)


def run(args: argparse.Namespace) -> int:
    require_serve_extra()
    sock = listen(args.host, args.port)  # first of all: a busy port is refused at once
    from radixkv.router.breaker import BreakerConfig
    from radixkv.router.fleet import card_problems, radixkv_info, read_cards, workers_tokenizer
    from radixkv.router.proxy import Limits, Router, WorkerSpec, build_router_app, check_workers
    from radixkv.tokenizer import load_tokenizer
    from radixkv.web.serving import bound_url, uvicorn_server

    try:
        specs = [WorkerSpec.parse(w) for w in args.worker]
    except ValueError as e:
        raise CliError(f"--worker: {e}") from None
    from radixkv.router.proxy import ADMIN_PATHS
    from radixkv.web.access import Access

    try:
        access = Access.for_bind(
            args.host, api_key=args.api_key, admin_key=args.admin_key, admin_paths=ADMIN_PATHS
        )
        if args.worker_api_key is not None and not args.worker_api_key.strip():
            raise ValueError("worker_api_key must be a non-empty string")
    except ValueError as e:
        raise flag_error(e) from None
    key = args.kv_events_key.encode() if args.kv_events_key else None
    headers = {"authorization": f"Bearer {args.worker_api_key}"} if args.worker_api_key else {}
    cards = read_cards(specs, headers)  # all at once, each within 5 s and 1 MiB
    bad = [p for url, c in cards.items() for p in card_problems(url, c)]
    if bad:
        raise CliError("; ".join(bad))
    tokenizer = None
    try:
        if args.model is None:
            tokenizer = workers_tokenizer(cards)
            if tokenizer is None:
                logging.getLogger("radixkv.router").warning(
                    "no worker names its tokenizer: routing with --model auto's"
                )
        if tokenizer is None:
            tokenizer = load_tokenizer(args.model or "auto")
    except (ValueError, ModuleNotFoundError, FileNotFoundError) as e:
        raise CliError(f"--model {args.model}: {e}" if args.model else str(e)) from None
    problems = check_workers(specs, tokenizer, headers=headers, cards=cards)
    sizes = {radixkv_info(c).get("page_size") for c in cards.values()} - {None}
    if args.block_size is not None and sizes and sizes != {args.block_size}:
        problems.append(f"--block-size {args.block_size}: the workers' page size is {sizes}")
    if problems:
        raise CliError("; ".join(problems))
    if args.block_size is None and not sizes and any(s.events for s in specs):
        raise CliError("--block-size: no worker's card says its page size (vLLM workers): "
                       "give the workers' block size")  # fmt: skip
    router = Router(specs, args.policy, tokenizer, args.kv_weight, key,
                    worker_key=args.worker_api_key, cards=cards,
                    block_size=args.block_size,
                    breaker=BreakerConfig(args.breaker_failures, args.breaker_cooldown,
                                          max(120.0, args.breaker_cooldown)))  # fmt: skip
    limits = Limits(args.worker_connections, args.header_timeout)
    app = build_router_app(router, args.health_interval, access, limits)
    print(
        f"radixkv route: {args.policy} over {len(specs)} workers on "
        f"{bound_url(sock)}/v1 (Ctrl-C stops)",
        file=sys.stderr,
        flush=True,
    )
    server = uvicorn_server(app, args.host, args.port, args.log_level)
    server.run(sockets=[sock])
    return 0
