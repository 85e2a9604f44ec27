"""Telling a request's fault from the engine's own.

A request whose row cannot be sampled (non-finite logits) fails alone (`Engine._fail`).
`FaultWatch` counts such failures in a row; when too many come with no row sampled
between, the engine sends a one-token canary of its own, and only the canary failing too
makes it the engine's fault (`EngineFault`): the model fails for every row, and the engine
stops so that a server exits and its supervisor restarts it.

Owns: that decision. Must not touch: requests, the cache, the step (the engine acts on
what it says).
"""

from __future__ import annotations

from typing import Any

from radixkv.engine.request import EngineReq


class EngineFault(RuntimeError):
    """The engine itself is broken (the model fails for every request): it stops, and a
    server exits so that its supervisor restarts it."""


class FaultWatch:
    """Tells a request's fault from the engine's. Non-finite logits fail the request
    alone. When ``after`` different requests (the choices of one count once) failed so in
    a row with no row sampled between, the engine sends a canary: a one-token request of
    its own (the tokenizer's BOS, nothing cached). The canary sampled, the failures were
    the requests' own (a poisoned token: the counting starts over); the canary failing
    too, the model fails for every row: `EngineFault`. So requests alone never stop the
    engine, however many fail in a row."""

    def __init__(self, after: int = 4) -> None:
        self.after = after
        self.failing: dict[Any, str] = {}  # request (or group) -> why, since the last good row
        self.canary: Any = None  # the canary's request id while one is out
        self.canaries = 0  # sent so far

    def sampled(self, r: EngineReq, error: Exception | None) -> bool:
        """A row of ``r`` was sampled (``error`` None) or could not be. Returns True when
        a canary should be sent now.

        Raises:
            EngineFault: the canary could not be sampled either.
        """
        if self.canary is not None and r.rid == self.canary:
            self.canary = None
            if error is not None:
                raise EngineFault(f"the model failed for {len(self.failing)} requests in a row "
                                  f"and for a one-token canary of its own ({error})")  # fmt: skip
            self.failing.clear()
            return False
        if error is None:
            if self.failing:
                self.failing.clear()
            return False
        self.failing[r.group if r.group is not None else ("rid", r.rid)] = str(error)
        if len(self.failing) < self.after or self.canary is not None:
            return False
        self.canaries += 1
        self.canary = ("canary", self.canaries)
        return True


__all__ = ["EngineFault", "FaultWatch"]
