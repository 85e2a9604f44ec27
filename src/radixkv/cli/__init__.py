"""The ``radixkv`` command line: a dispatcher. Each subcommand is a module of its own (its
parser and its run; `radixkv.cli.common` holds what they share); the logic lives in the
library. Subcommands import their (heavier) modules lazily, so ``radixkv --help`` starts
without torch.

One error style: bad input prints one line ``error: FILE:LINE: what is wrong`` or
``error: --flag: what is wrong`` to stderr and exits 2; Ctrl-C exits 130; an unexpected
failure prints one ``error:`` line and exits 1. Never a traceback, unless ``--debug``.

Owns: the parser and the dispatch. Must not touch: any subcommand's logic.
"""

from __future__ import annotations

import argparse
import sys

from radixkv import __version__
from radixkv.cli import bench_serve, demo, make_model, route, serve, simulate
from radixkv.cli.common import EXIT_BAD_INPUT, EXIT_INTERRUPTED, CliError, Parser

# in the order ``radixkv --help`` lists them
SUBCOMMANDS = {
    "simulate": simulate,
    "demo": demo,
    "serve": serve,
    "bench-serve": bench_serve,
    "route": route,
    "make-model": make_model,
}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="radixkv", description="Automatic prefix caching for LLM KV caches.")
    parser.add_argument("--version", action="version", version=f"radixkv {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="show a traceback when something fails"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    # --debug is also taken after the subcommand; SUPPRESS keeps the top-level value
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    for module in SUBCOMMANDS.values():
        module.add_parser(sub, common)
    SUBPARSERS.clear()
    SUBPARSERS.update(sub.choices)
    return parser


SUBPARSERS: dict[str, argparse.ArgumentParser] = {}  # the subcommands' parsers, by name


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
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # refused by the subcommand's parser, pointing to its own --help
        sub = SUBPARSERS.get(args.command, parser)
        sub.error(f"unrecognized arguments: {' '.join(unknown)}")
    _show_startup_progress()
    module = SUBCOMMANDS.get(args.command)
    if module is None:
        parser.print_help()
        return 0
    try:
        return module.run(args)
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


__all__ = ["CliError", "build_parser", "main"]
