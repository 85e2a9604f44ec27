"""``radixkv serve``: an OpenAI-compatible server with prefix caching. The server lives in
`radixkv.server`; this module parses, checks, builds and runs it.

Owns: the subcommand's flags and how they become configs. Must not touch: the server or
the engine."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from radixkv.cli.common import (
    LOG_LEVELS,
    CliError,
    add_key_flags,
    byte_size,
    flag_error,
    listen,
    number,
    positive_int,
    require_serve_extra,
)

HELP = "an OpenAI-compatible server with prefix caching"
# (radixkv.engine.config's and radixkv.server.tools's, without importing torch here)
CACHE_SPLITS = ("one", "sglang")
TOOL_PARSERS = ("hermes", "llama3_json", "mistral")


def cache_size(text: str) -> int | str | None:
    """``--cache-bytes``: a byte size, ``auto`` or ``off`` (None)."""
    if text in ("auto", "off"):
        return None if text == "off" else text
    return byte_size(text)


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    serve = sub.add_parser(
        "serve",
        parents=[common],
        help=HELP,
        description="Serve a model over the OpenAI API (completions, chat, streaming) with "
        "prefix caching, Prometheus metrics at /metrics and per-tenant cache salts.",
    )
    _model_flags(serve)
    _memory_flags(serve)
    _scheduling_flags(serve)
    _storage_flags(serve)
    _events_flags(serve)
    _access_flags(serve)


def _model_flags(parser: argparse.ArgumentParser) -> None:
    serve = parser.add_argument_group("the model and the address")
    serve.add_argument(
        "--model",
        default="auto",
        help="auto (SmolLM2 if installed, else a tiny random model), smollm2, random, or a "
        "checkpoint folder [auto]",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind [127.0.0.1]")
    serve.add_argument("--port", type=number(int, 0, "a port number"), default=8000)
    serve.add_argument("--served-model-name", help="the model id clients send [the model's]")
    serve.add_argument(
        "--tool-call-parser", choices=("auto", "none", *TOOL_PARSERS), default="auto",
        help="how the model writes tool calls: hermes (<tool_call> JSON: Qwen), llama3_json, "
        "mistral ([TOOL_CALLS]); auto: the one the chat template shows the model, if any; "
        "none: refuse tools [auto]",
    )  # fmt: skip


def _memory_flags(parser: argparse.ArgumentParser) -> None:
    serve = parser.add_argument_group("cache memory")
    serve.add_argument("--page-size", type=positive_int, default=16, help="[16]")
    serve.add_argument(
        "--cache-bytes", type=cache_size, default="auto", metavar="SIZE",
        help="one byte budget (384KiB, 256MiB, 4GiB) for full-attention KV, sliding-window "
        "KV and recurrent-state checkpoints together, split as requests need it and "
        "evicted in the simulator's radixkv order; auto: on a hybrid model the bytes the "
        "separate pools of --kv-tokens would take, in one budget; off: those separate "
        "pools (--kv-tokens, --window-tokens, --max-checkpoints) [auto; off with "
        "--window-tokens]",
    )  # fmt: skip
    serve.add_argument(
        "--cache-split", choices=CACHE_SPLITS, default="one",
        help="with --cache-bytes: one arena (one), or SGLang's fixed ratios into separate "
        "pools (sglang: states 0.9x the full KV's bytes, window 0.8x its tokens) [one]",
    )  # fmt: skip
    serve.add_argument(
        "--kv-tokens",
        type=positive_int,
        default=None,
        help="full-attention KV, tokens: the plain pool; with --cache-bytes auto what "
        "sizes the budget; with a --cache-bytes SIZE the most the budget holds (a cap) "
        "[65536]",
    )
    serve.add_argument(
        "--max-checkpoints", type=positive_int, default=None,
        help="recurrent-state checkpoints the prefix cache holds (Qwen3.5) [64; with "
        "--cache-bytes: as many as the budget holds]",
    )  # fmt: skip
    serve.add_argument(
        "--checkpoint-every", type=number(int, 0, "a non-negative integer"), default=0,
        help="recurrent models also checkpoint every N tokens of a prefill, a multiple of "
        "--page-size (0: only at prompt ends, branch points and boundaries) [0]",
    )  # fmt: skip
    serve.add_argument(
        "--window-tokens", type=number(int, 0, "a non-negative integer"), default=None,
        help="the sliding-window layers' own KV pool (Gemma 3, Mistral, Qwen with sliding "
        "layers): running requests keep only their last window, the cache the windows a "
        "match can end at; 0: keep them in the full pool; with a --cache-bytes SIZE the "
        "most window KV the budget holds (a cap) [sized at start]",
    )  # fmt: skip
    serve.add_argument(
        "--max-retained-tokens", type=number(int, 0, "a non-negative integer"), default=None,
        help="prompt-cache retention (prompt_cache_options, prompt_cache_retention, "
        "breakpoints): tokens one cache_salt keeps retained; 0: off [an eighth of --kv-tokens]",
    )  # fmt: skip


def _scheduling_flags(parser: argparse.ArgumentParser) -> None:
    serve = parser.add_argument_group("scheduling")
    serve.add_argument(
        "--max-running", type=positive_int, default=32, help="requests running at once [32]"
    )
    serve.add_argument(
        "--chunk-size", type=positive_int, default=512, help="prefill tokens per step [512]"
    )
    serve.add_argument(
        "--max-context-len", type=positive_int, default=4096, help="prompt + output [4096]"
    )
    serve.add_argument(
        "--eviction-policy", default="lru",
        help="lru, lfu, fifo, slru, ...; session: agents' sessions (Claude Code's session "
        "header, metadata.user_id, prompt_cache_key) ordered by their predicted return: one "
        "that called a tool is kept over one whose turn ended [lru]",
    )  # fmt: skip
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


def _storage_flags(parser: argparse.ArgumentParser) -> None:
    serve = parser.add_argument_group("tiers below the device")
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
        "--storage-max-bytes",
        type=positive_int,
        default=None,
        help="with a file:// store: the most bytes its folder holds; the least recently "
        "used pages are removed beyond [what it holds plus half its disk's free space at "
        "start, printed]",
    )
    serve.add_argument(
        "--host-tokens",
        type=number(int, 0, "a non-negative integer"),
        default=0,
        help="KV tokens of a host-memory tier below the device pool [0: none]",
    )
    serve.add_argument(
        "--prefetch-within", type=number(float, 1e-3, "seconds > 0", 1e9), metavar="SECONDS",
        help="with --eviction-policy session and a tier: load a waiting agent's pages back "
        "from the tier when it is predicted back within SECONDS, evicting only what returns "
        "later: while no request runs, and a chunk's worth a step while busy [off]",
    )  # fmt: skip
    serve.add_argument(
        "--write-policy",
        choices=["write_through", "write_through_selective", "write_back"],
        default="write_through",
        help="when pages reach --storage [write_through]",
    )


def _events_flags(parser: argparse.ArgumentParser) -> None:
    serve = parser.add_argument_group("KV events")
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
        "the events unauthenticated (see docs/security.md)",
    )


def _access_flags(parser: argparse.ArgumentParser) -> None:
    serve = parser.add_argument_group("access and checks")
    add_key_flags(serve, "/flush_cache")
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
        "--served-log",
        metavar="FILE",
        help="append each finished request (its token ids, the engine step it arrived at) "
        "to FILE, created for its owner only, up to 1 GiB: `radixkv simulate --trace FILE "
        "--model-spec MODEL` replays it and checks each request's cached tokens",
    )
    serve.add_argument("--log-level", default="warning", choices=LOG_LEVELS)


# engine settings a flag sets, by their config names (a message naming one names its flag)
SIZING_FIELDS = ("cache_bytes", "kv_tokens", "window_tokens", "max_checkpoints", "host_tokens",
                 "chunk_size", "max_running", "max_context_len", "page_size",
                 "checkpoint_every", "max_retained_tokens", "eviction_policy",
                 "served_log", "prefetch_within")  # fmt: skip


def _sizing_flag(message: str, args: argparse.Namespace) -> str | None:
    """The flag an engine's sizing error is about: the setting it starts with
    (``window_tokens must ...``), or for what the machine cannot hold (``needs ... GiB``)
    the flag that sized it: ``--cache-bytes`` when a size was given (it sizes every pool,
    SGLang's split included), else the largest part's. None: the model's own (its
    config), which names ``--model``."""
    first = message.split(" ", 1)[0].rstrip(":")
    if first in SIZING_FIELDS:
        return f"--{first.replace('_', '-')}"
    if not message.startswith("needs"):
        return None
    if isinstance(args.cache_bytes, int):
        return "--cache-bytes"
    part = message.partition("(")[2].split("=", 1)[0].strip()
    return f"--{part.replace('_', '-')}" if part in SIZING_FIELDS else "--kv-tokens"


def run(args: argparse.Namespace) -> int:
    require_serve_extra()
    if args.port > 65535:
        raise CliError(f"--port: must be a port number, got {args.port}")
    sock = listen(args.host, args.port)  # first of all: a busy port is refused at once
    from radixkv.engine.config import EngineConfig
    from radixkv.events import exposure_problem
    from radixkv.server.serve import ServeConfig, build_server, engine_failure
    from radixkv.web.access import Access
    from radixkv.web.serving import bound_url

    hosts = args.allowed_hosts
    budget = args.cache_bytes
    if budget == "auto" and args.window_tokens:
        budget = None  # it sizes the separate window pool
    try:
        engine_config = EngineConfig(
            prefix_cache=not args.no_prefix_cache, page_size=args.page_size,
            schedule_policy=args.schedule_policy, chunk_size=args.chunk_size,
            max_running=args.max_running, cache_bytes=budget, cache_split=args.cache_split,
            kv_tokens=args.kv_tokens or 65536 if budget in (None, "auto") else args.kv_tokens,
            max_context_len=args.max_context_len, eviction_policy=args.eviction_policy,
            check_memory=args.check_memory, storage=args.storage, host_tokens=args.host_tokens,
            write_policy=args.write_policy, storage_secret=args.storage_secret,
            storage_max_bytes=args.storage_max_bytes, max_checkpoints=args.max_checkpoints,
            checkpoint_every=args.checkpoint_every,
            max_retained_tokens=args.max_retained_tokens, window_tokens=args.window_tokens,
            served_log=args.served_log, prefetch_within=args.prefetch_within,
        )  # fmt: skip
        access = Access.for_bind(
            args.host, api_key=args.api_key, admin_key=args.admin_key,
            max_request_bytes=args.max_request_bytes,
            allowed_hosts=tuple(h.strip().lower() for h in hosts.split(",")) if hosts else None,
        )  # fmt: skip
    except ValueError as e:
        raise flag_error(e) from None
    serve = ServeConfig(
        args.model, args.host, args.port, args.served_model_name, args.max_queue,
        args.log_level, args.kv_events, args.kv_events_replay, access, args.kv_events_key,
        args.kv_events_mode == "tokens", args.tool_call_parser,
    )  # fmt: skip
    if args.kv_events:
        problem = exposure_problem(args.kv_events, args.kv_events_replay, args.kv_events_insecure)
        if problem:
            raise CliError(problem)
    try:
        server, aeng = build_server(serve, engine_config)
    except (FileNotFoundError, ValueError, ModuleNotFoundError) as e:
        flag = _sizing_flag(str(e), args)
        if flag is not None:  # a size the flags set, against this model or this machine
            text = str(e).removeprefix(f"{flag[2:].replace('-', '_')}:").strip()
            raise CliError(f"{flag}: {text}") from None
        raise CliError(f"--model {args.model}: {e}") from None
    except (MemoryError, RuntimeError) as e:  # the allocator said no, past every check
        if isinstance(e, RuntimeError) and "alloc" not in str(e).lower():
            raise
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise CliError(f"{_sizing_flag('needs', args)}: the cache could not be allocated "
                       f"({first}): give a smaller size") from None  # fmt: skip
    except Exception as e:
        if type(e).__name__ == "ZMQError":  # pyzmq's: a bad or busy events address
            raise CliError(f"--kv-events {args.kv_events}: cannot bind ({e})") from None
        raise
    name = server.config.app.state.api.model_name
    where = f"{bound_url(sock)}/v1"
    print(f"radixkv serve: {name} ({aeng.engine.model_name}) on {where} (Ctrl-C stops)",
          file=sys.stderr, flush=True)  # fmt: skip
    for line in aeng.engine.memory_summary():
        print(f"  {line}", file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    failed = engine_failure(aeng)
    if failed is not None:  # a supervisor restarts it; /health said why meanwhile
        print(f"error: the engine failed: {failed!r}; exiting so it can be restarted",
              file=sys.stderr, flush=True)  # fmt: skip
        return 1
    return 0
