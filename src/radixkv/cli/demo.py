"""``radixkv demo``: a real model on built-in prompts, without and then with the prefix
cache. The demo lives in `radixkv.engine.demo`; this module parses, runs and prints.

Owns: the subcommand's flags. Must not touch: the demo's logic."""

from __future__ import annotations

import argparse
from typing import Any

from radixkv.cli.common import CliError, make_console, positive_int

HELP = "run a real model on built-in prompts without and with prefix caching"


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    demo = sub.add_parser(
        "demo", parents=[common], help=HELP,
        description="Run built-in workloads (capital-of questions; chat questions sharing a "
        "long system prompt) without and then with the prefix cache, and compare.",
    )  # fmt: skip
    demo.add_argument("--model", default="auto",
                      help="auto (SmolLM2 if installed, else a tiny random model), smollm2, "
                      "random, or a checkpoint folder [auto]")  # fmt: skip
    demo.add_argument("--max-new-tokens", type=positive_int, default=24)
    demo.add_argument("--page-size", type=positive_int, default=1)


def run(args: argparse.Namespace) -> int:

    from radixkv.engine.demo import run_demo

    try:
        summary = run_demo(args.model, args.max_new_tokens, args.page_size, make_console())
    except (FileNotFoundError, ValueError, ModuleNotFoundError) as e:
        raise CliError(f"--model {args.model}: {e}") from None
    return 0 if all(w["identical"] for w in summary["workloads"].values()) else 1
