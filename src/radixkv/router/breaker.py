"""A circuit breaker per worker: a worker whose requests keep failing is taken out of
routing for a while, then tried with one request before it gets traffic again.

Owns: the breaker's state machine and its clock. Must not touch: HTTP (the proxy tells it
each request's outcome), health checks (a worker's ``/health`` may say 200 while every
request fails: the two are kept apart, `radixkv.router.fleet.Worker`), or routing.

Why: a worker that answers every request with a 500 at once looks idle (nothing in
flight, nothing cached) and so takes most of the traffic under ``kv`` and
``least_load``. Counting outcomes stops that: it is out after ``failures`` in a row.

States (SGLang's gateway has the same three; its default is 10 failures to trip, ours
is 5: a failing worker that answers at once takes a request every few milliseconds)::

    closed     -- failures in a row reach ``failures`` -->  open
    open       -- ``cooldown`` s pass -------------------->  half_open
    half_open  -- one request (the probe) admitted; it succeeds -> closed,
                  it fails -> open again, its cooldown doubled (at most ``max_cooldown``)

Invariants: ``admits()`` is True only when closed, or half-open with no probe in flight;
a success while closed resets the count; the breaker never opens with ``failures`` 0
(turned off). Every call is O(1).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


@dataclass(frozen=True)
class BreakerConfig:
    """``failures``: failed requests in a row that open it (0: never opens);
    ``cooldown``: seconds it stays open the first time; ``max_cooldown``: the most a
    doubled cooldown reaches."""

    failures: int = 5
    cooldown: float = 10.0
    max_cooldown: float = 120.0

    def __post_init__(self) -> None:
        if isinstance(self.failures, bool) or not isinstance(self.failures, int) or (
                self.failures < 0):  # fmt: skip
            raise ValueError(f"failures must be an int >= 0, got {self.failures!r}")
        for name in ("cooldown", "max_cooldown"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    0 < value < float("inf")):  # fmt: skip
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


class Breaker:
    """One worker's breaker (see the module docstring)."""

    def __init__(
        self, config: BreakerConfig | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config, self.clock = config or BreakerConfig(), clock
        self.state = CLOSED
        self.failed = 0  # failures in a row
        self.cooldown = self.config.cooldown
        self.until = 0.0  # open: when it turns half-open
        self.probing = False  # half-open: the probe is in flight

    def admits(self) -> bool:
        """May a request go to the worker now? (An open breaker whose cooldown is over
        turns half-open here.)"""
        if self.state == OPEN and self.clock() >= self.until:
            self.state, self.probing = HALF_OPEN, False
        if self.state == HALF_OPEN:
            return not self.probing
        return self.state == CLOSED

    def started(self) -> None:
        """A request went to the worker: while half-open it is the probe."""
        if self.state == HALF_OPEN:
            self.probing = True

    def abandoned(self) -> None:
        """A request ended with no outcome (its client left first): a probe may go again."""
        if self.state == HALF_OPEN:
            self.probing = False

    def succeeded(self) -> None:
        self.failed = 0
        if self.state == HALF_OPEN:
            self.state, self.probing, self.cooldown = CLOSED, False, self.config.cooldown

    def failed_once(self) -> bool:
        """A request failed; True when this opened the breaker."""
        self.failed += 1
        if self.state == HALF_OPEN:  # the probe failed: open again, for longer
            self.cooldown = min(2 * self.cooldown, self.config.max_cooldown)
            return self._open()
        if self.state == CLOSED and 0 < self.config.failures <= self.failed:
            return self._open()
        return False

    def _open(self) -> bool:
        self.state, self.probing = OPEN, False
        self.until = self.clock() + self.cooldown
        return True


__all__ = ["CLOSED", "HALF_OPEN", "OPEN", "Breaker", "BreakerConfig"]
