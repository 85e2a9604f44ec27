"""``radixkv simulate --trace LOG --model-spec MODEL``, where LOG is what ``radixkv serve
--served-log`` wrote: the server's requests replayed through its own engine and knobs
without the model (`radixkv.sim.served`), each request's cached tokens against the
server's.

Owns: the served log's flags, table and JSON. Must not touch: the replay
(`radixkv.sim.served`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from radixkv.cli.common import CliError, make_console
from radixkv.cli.common import write_output as write

# what a served log's replay takes; every other flag is the log's to say
TAKES = ("trace", "format", "model_spec", "policy", "json_out")


FLAGS = {"json_out": "--json", "csv_out": "--csv"}  # where a flag's dest is not its name


def refuse_flags(args: argparse.Namespace, defaults: dict[str, Any]) -> None:
    """Refuse any flag given away from its default but those a served log takes."""
    for dest, default in defaults.items():
        if dest not in TAKES and getattr(args, dest, default) != default:
            flag = FLAGS.get(dest, "--" + dest.replace("_", "-"))
            raise CliError(f"{flag}: not with a served log (it replays the server's own knobs "
                           "and arrivals)")  # fmt: skip


def run_served(args: argparse.Namespace, defaults: dict[str, Any],
               trace_errors: Callable[[str], Any]) -> int:  # fmt: skip
    """Replay the served log ``args.trace``; exit 0, the table printed (and ``--json``).
    A request whose cached tokens differ from the server's is listed, not an error: a
    server and its replay disagreeing is what this check is for."""
    from radixkv.sim.served import load_served, replay_served

    refuse_flags(args, defaults)
    if args.policy not in (None, "serve"):
        raise CliError("--policy: a served log replays the engine only (serve), got "
                       f"{args.policy!r}")  # fmt: skip
    if args.model_spec is None or not Path(args.model_spec).is_dir():
        raise CliError("--model-spec: a served log needs the model's folder (the engine is "
                       "built from its config.json)")  # fmt: skip
    with trace_errors(args.trace):
        log = load_served(args.trace)
    try:
        rep = replay_served(log, args.model_spec)
    except ValueError as e:
        raise CliError(f"--trace {args.trace}: {e}") from None
    console = make_console(stderr=args.json_out == "-")
    n = len(rep.cached)
    differ = [i for i in range(n) if rep.cached[i] != rep.server_cached[i]]
    console.print(f"{args.trace}: {n:,} requests replayed with the server's knobs "
                  f"({', '.join(f'{k}={v}' for k, v in log.knobs.items() if v is not None)})",
                  markup=False)  # fmt: skip
    console.print(f"token hit rate {rep.token_hit_rate:.4f} ({rep.hit_tokens:,} of "
                  f"{rep.prompt_tokens:,} prompt tokens), {rep.preemptions} preemptions",
                  markup=False)  # fmt: skip
    console.print(f"cached what the server cached: {rep.agree:,} of {n:,} requests"
                  + (f"; differ: {', '.join(map(str, differ[:20]))}" if differ else ""),
                  markup=False)  # fmt: skip
    rows = [{"request": i, "prompt_tokens": r.prompt_tokens, "cached": rep.cached[i],
             "server_cached": rep.server_cached[i]}
            for i, r in enumerate(log.trace.requests)]  # fmt: skip
    out = {"config": log.knobs, "requests": rows, "token_hit_rate": rep.token_hit_rate,
           "hit_tokens": rep.hit_tokens, "prompt_tokens": rep.prompt_tokens,
           "preemptions": rep.preemptions, "agree": rep.agree}  # fmt: skip
    write("--json", args.json_out, lambda: json.dumps(out, indent=2))
    return 0
