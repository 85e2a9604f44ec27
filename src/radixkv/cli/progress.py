"""How far a long command is: a rich progress bar on a terminal, and where the output is
piped (a log, CI, ``| tee``), a plain line at once and then one every few seconds with
what is done and an estimate of what is left. A command that runs for minutes is never
silent (bench-serve printed nothing for 272 s when piped).

Owns: `progress`. Must not touch: what the command does (it reports a count it is given).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

EVERY_S = 5.0  # seconds between two piped lines
FIRST_S = 1.0  # ... and before the first: a command done (or refused) sooner says nothing

Update = Callable[..., None]  # update(done, total=None)


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class _Lines:
    """The piped form: a line after ``first`` seconds, then one every ``every`` seconds
    from a timer thread (so a single long step is not silent either), and one at the end
    if any came before (a command that ends or fails sooner says nothing more than its
    result: its error stays the one line it writes)."""

    def __init__(
        self, console: Any, what: str, total: int | None, every: float, first: float
    ) -> None:
        self.console, self.what, self.total, self.every = console, what, total, every
        self.first = first
        self.start = time.monotonic()
        self.done, self.said = 0, False
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.timer = threading.Thread(target=self._tick, daemon=True)

    def _tick(self) -> None:
        wait = self.first
        while not self.stop.wait(wait):
            self.line()
            wait = self.every

    def line(self, final: bool = False) -> None:
        elapsed = time.monotonic() - self.start
        text = f"{self.what}: {self.done:,}"
        if self.total:
            text += f"/{self.total:,} ({100 * self.done / self.total:.0f}%)"
        text += f", {_clock(elapsed)}"
        if final:
            text += ", done"
        elif self.total and self.done:
            text += f", about {_clock(elapsed * (self.total - self.done) / self.done)} left"
        with self.lock:
            self.console.print(text, markup=False, highlight=False)
            self.said = True

    def update(self, done: int, total: int | None = None) -> None:
        self.done = done
        if total is not None:
            self.total = total


@contextmanager
def progress(
    console: Any, what: str, total: int | None = None, every: float = EVERY_S,
    first: float = FIRST_S,
) -> Iterator[Update]:  # fmt: skip
    """Yields ``update(done, total=None)``: the count so far (and the total, once
    known). On a terminal a transient bar; piped, ``what: done/total (p%), elapsed,
    about T left`` after ``first`` seconds, then every ``every`` while it runs, and
    when it ends (if it said anything before).
    ``console``: where to say it (None: standard error, so a table piped from standard
    output stays clean)."""
    if console is None:
        from radixkv.cli.common import make_console

        console = make_console(stderr=True)
    if console.is_terminal:
        from rich.progress import Progress

        with Progress(console=console, transient=True) as bar:
            task = bar.add_task(what, total=total)

            def update(done: int, total: int | None = None) -> None:
                bar.update(task, completed=done, total=total)

            yield update
        return
    lines = _Lines(console, what, total, every, first)
    lines.timer.start()
    ok = False
    try:
        yield lines.update
        ok = True
    finally:
        lines.stop.set()
        lines.timer.join()
        if ok and lines.said:
            lines.line(final=True)


__all__ = ["EVERY_S", "FIRST_S", "progress"]
