"""What every subcommand shares: the one error style, argument types, output files, the
key flags and the serve extra's check.

One error style: bad input prints one line ``error: FILE:LINE: what is wrong`` or
``error: --flag: what is wrong`` to stderr and exits 2; Ctrl-C exits 130; an unexpected
failure prints one ``error:`` line and exits 1. Never a traceback, unless ``--debug``.

Owns: the CLI's shared flags, types and error style. Must not touch: any subcommand's
logic.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
SERVE_MODULES = ("fastapi", "uvicorn", "prometheus_client", "httpx", "msgspec", "zmq")
LOG_LEVELS = ["critical", "error", "warning", "info", "debug"]


class CliError(Exception):
    """Bad input: printed as ``error: <message>``, exit status 2."""


class DefaultsFormatter(argparse.HelpFormatter):
    """``--help`` shows every option's default, as ``[value]`` after its help (an option
    whose help names its default already, ``[...]``, is left as it is)."""

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and default_shown(action):  # no help: its default alone
            action.help = "[" + str(action.default).replace("%", "%%") + "]"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = (action.help or "").strip()
        if "[" not in text and default_shown(action):
            default = str(action.default).replace("%", "%%")
            text = f"{text} [{default}]" if text else f"[{default}]"
        return text


def default_shown(action: argparse.Action) -> bool:
    return bool(action.option_strings) and action.default not in (
        None, False, argparse.SUPPRESS
    ) and action.nargs != 0  # fmt: skip


class Parser(argparse.ArgumentParser):
    """The one error style (``error: ...``, exit 2, pointing to this command's help) and
    every default shown in ``--help``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


def number(kind: type, lo: float, what: str, hi: float | None = None) -> Callable[[str], Any]:
    """An argument type: a ``kind`` number at least ``lo`` and, given ``hi``, at most
    ``hi`` (nan refused)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if not value >= lo:  # also refuses nan
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        if hi is not None and not value <= hi:
            raise argparse.ArgumentTypeError(f"must be {what} up to {hi:g}, got {text!r}")
        return value

    return parse


positive_int = number(int, 1, "a positive integer")


def byte_size(text: str) -> int:
    """An argument type: a byte size (`radixkv.units.parse_bytes`)."""
    from radixkv.units import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"must be {e} (or auto, off)") from None


port_number = number(int, 0, "a port number")


def flag_error(e: ValueError) -> CliError:
    """A config error ("kv_tokens must be ...", "url: ...") as ``--flag: message``."""
    text = str(e)
    name, _, rest = text.partition(" ")
    if name.endswith(":"):
        name, text = name[:-1], rest
    return CliError(f"--{name.replace('_', '-')}: {text}")


def require_serve_extra() -> None:
    import importlib.util

    lacking = [m for m in SERVE_MODULES if importlib.util.find_spec(m) is None]
    if lacking:
        raise CliError(
            f"needs {', '.join(lacking)} (the serve extra): pip install 'radixkv[serve]'"
        )


def add_key_flags(parser: argparse.ArgumentParser, admin: str) -> None:
    """``--api-key`` and ``--admin-key``, as `radixkv.web.access` applies them on a
    server and on a router (``admin``: what the admin key opens)."""
    parser.add_argument("--api-key", default=os.environ.get("RADIXKV_API_KEY"),
                        help="every request but /health must send Authorization: Bearer "
                        "KEY [$RADIXKV_API_KEY; none: open]")  # fmt: skip
    parser.add_argument("--admin-key", default=os.environ.get("RADIXKV_ADMIN_KEY"),
                        help=f"the key admin endpoints ({admin}) need; without one they "
                        "answer 403 [$RADIXKV_ADMIN_KEY]")  # fmt: skip


def check_output(flag: str, dest: str | None) -> None:
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


def write_output(flag: str, dest: str | None, text: Callable[[], str]) -> None:
    """``text()`` to ``dest`` (``-``: stdout; ``None``: nowhere)."""
    if dest is None:
        return
    if dest == "-":
        sys.stdout.write(text())
        return
    try:
        with open(dest, "w", encoding="utf-8") as f:
            f.write(text())
    except OSError as e:
        raise CliError(f"{flag}: cannot write {dest}: {e.strerror or e}") from None


def listen(host: str, port: int) -> Any:
    """A socket listening on ``host:port`` (`radixkv.web.serving.bind`), or ``--port``'s
    (``--host``'s) one-line error."""
    from radixkv.web.serving import bind

    try:
        return bind(host, port)
    except OSError as e:
        flag = "--host" if isinstance(e, socket.gaierror) else "--port"
        raise CliError(f"{flag}: cannot listen on {host}:{port} ({e.strerror or e})") from None


PIPED_WIDTH = 400  # a table's width when the output is not a terminal: never cut


def make_console(stderr: bool = False) -> Any:
    """A rich console for tables: on a terminal its width (columns wrap, never cut
    numbers); piped into a file or a pager, wide enough that nothing is cut (rich
    assumes 80 columns there and cut cells to ``0.14…``)."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty() or os.environ.get("COLUMNS"):
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=PIPED_WIDTH)
