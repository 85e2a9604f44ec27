"""What every page store shares: the interface (`PageStore`), its counters
(`StoreStats`), the in-memory store, and soft failure (`SoftStore`: a store that fails is
skipped for a while, never waited on). The backends build on it (`radixkv.storage.store`
for Redis and `open_store`, `radixkv.storage.files` for a folder); it imports neither.

Owns: the store interface and its soft failures. Must not touch: a backend's wire or
files, or a page's bytes (`radixkv.storage.page`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger("radixkv.storage")


@dataclass
class StoreStats:
    """What a store did (read by the engine's metrics)."""

    pages_read: int = 0
    pages_written: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_s: float = 0.0
    write_s: float = 0.0
    errors: int = 0  # calls that failed (store down, full, timed out)
    corrupt: int = 0  # values that failed the header check
    unauthenticated: int = 0  # values whose MAC failed (or that had none) under a secret
    evicted_pages: int = 0  # removed to keep a capped store under its size
    evicted_bytes: int = 0


# Where `PageStore.get_into` puts a value of a given length: the buffers to fill, in
# order (their sizes sum to the length), or None to skip a value of that length.
Parts = Callable[[int, int], "list[memoryview] | None"]


def copy_into(value: bytes, parts: list[memoryview]) -> None:
    at = 0
    for part in parts:
        part[:] = value[at : at + len(part)]
        at += len(part)


def get_into(store: Any, keys: list[bytes], parts: Parts) -> list[bool | None]:
    """`PageStore.get_into` by way of ``get`` (one copy from each value)."""
    out: list[bool | None] = []
    for i, value in enumerate(store.get(keys)):
        where = None if value is None else parts(i, len(value))
        if where is not None:
            copy_into(value, where)  # type: ignore[arg-type]
        out.append(None if value is None else where is not None)
    return out


class PageStore(Protocol):
    stats: StoreStats

    def exists_prefix(self, keys: list[bytes]) -> int: ...
    def exists(self, keys: list[bytes]) -> list[bool]: ...  # each key, in one round trip
    def get(self, keys: list[bytes]) -> list[bytes | None]: ...
    def set(self, keys: list[bytes], values: list[bytes]) -> int: ...

    def get_into(self, keys: list[bytes], parts: Parts) -> list[bool | None]:
        """Read each key's value into the buffers ``parts(i, len(value))`` gives: per
        key ``True`` (read), ``None`` (missing) or ``False`` (``parts`` refused its
        length). Redis reads straight from the socket into them (no reply objects)."""
        ...


class MemoryStore:
    """A dict: for tests and single-process runs."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.stats = StoreStats()

    def exists_prefix(self, keys: list[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.data:
            n += 1
        return n

    def exists(self, keys: list[bytes]) -> list[bool]:
        return [k in self.data for k in keys]

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        return [self.data.get(k) for k in keys]

    def set(self, keys: list[bytes], values: list[bytes]) -> int:
        for k, v in zip(keys, values, strict=True):
            self.data[k] = v
        return len(keys)

    def get_into(self, keys: list[bytes], parts: Parts) -> list[bool | None]:
        return get_into(self, keys, parts)


class SoftStore:
    """A store whose failures are soft: a failed call counts an error, warns once, and
    marks the store down for ``retry_s`` seconds (every call a miss, none a wait)."""

    def __init__(self, name: str, retry_s: float) -> None:
        self.name, self.retry_s = name, retry_s
        self.clock = time.monotonic  # seconds (tests freeze it)
        self.stats = StoreStats()
        self._down_until = 0.0
        self._warned = False

    def _fail(self, what: str, e: BaseException) -> None:
        self.stats.errors += 1
        self._down_until = self.clock() + self.retry_s
        if not self._warned:
            log.warning("%s: %s failed (%s: %s); recomputing instead, retrying in %.0f s",
                        self.name, what, type(e).__name__, e, self.retry_s)  # fmt: skip
            self._warned = True

    def _call(self, what: str, fn: Any, default: Any) -> Any:
        if self.clock() < self._down_until:
            return default
        try:
            out = fn()
        except Exception as e:  # OSError, redis errors: the store is down, full or refuses
            self._fail(what, e)
            return default
        self._warned = False
        return out
