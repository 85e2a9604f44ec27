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
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
