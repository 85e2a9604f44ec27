"""A call that raises midway: the fault the lifecycle's state machines inject."""

from __future__ import annotations

from contextlib import contextmanager


# --- fault injection -------------------------------------------------------------------------
class InjectedFault(Exception):
    """Raised by a method under `inject_fault`."""


@contextmanager
def inject_fault(obj, name: str, after: int):
    """Make ``obj.name`` raise `InjectedFault` on its call number ``after`` (0-based),
    before doing anything: a call failing midway through an operation."""
    real = getattr(obj, name)
    calls = [0]

    def faulty(*args, **kwargs):
        calls[0] += 1
        if calls[0] == after + 1:
            raise InjectedFault(f"{name} call {calls[0]}")
        return real(*args, **kwargs)

    setattr(obj, name, faulty)
    try:
        yield
    finally:
        delattr(obj, name)
