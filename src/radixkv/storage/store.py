"""Page stores: where stored pages live (memory, a folder, Redis), behind one
prefix-shaped interface (see `radixkv.storage`).

Owns: the backends and their soft failures (a store that fails is skipped for a while,
never waited on). Must not touch: the bytes of a page (`radixkv.storage.page`) or the
RESP wire (`radixkv.storage.resp`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlparse

from radixkv.storage.resp import RespReader, command, send, set_commands

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


def _copy_into(value: bytes, parts: list[memoryview]) -> None:
    at = 0
    for part in parts:
        part[:] = value[at : at + len(part)]
        at += len(part)


def _get_into(store: Any, keys: list[bytes], parts: Parts) -> list[bool | None]:
    """`PageStore.get_into` by way of ``get`` (one copy from each value)."""
    out: list[bool | None] = []
    for i, value in enumerate(store.get(keys)):
        where = None if value is None else parts(i, len(value))
        if where is not None:
            _copy_into(value, where)  # type: ignore[arg-type]
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
        return _get_into(self, keys, parts)


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


class RedisStore(SoftStore):
    """Pages in Redis (or Valkey), pipelined; ``rediss://`` for TLS.

    Args:
        url: ``redis://HOST:PORT/DB``; ``redis://HOST:PORT?cluster=1`` for a Redis Cluster
            (any node; single-key commands, so pages spread over the cluster's slots).
        timeout: seconds a call may take before it counts as failed.
        retry_s: after a failure, the store is skipped (every call a miss) this long.
        ttl_s: expiry of written pages (``None``: none; let ``maxmemory`` evict).
    """

    def __init__(
        self, url: str, timeout: float = 0.5, retry_s: float = 5.0, ttl_s: int | None = None
    ) -> None:
        import redis
        from redis.cluster import RedisCluster

        super().__init__(f"redis store {url}", retry_s)
        self.url, self.ttl_s = url, ttl_s
        parsed = urlparse(url)
        cluster = self._cluster = "cluster=1" in parsed.query.split("&")
        kw = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
        if cluster:  # Redis Cluster: the same single-key pipelines, split by node
            self.client = RedisCluster.from_url(parsed._replace(query="").geturl(), **kw)
        else:
            self.client = redis.Redis.from_url(
                url,
                retry_on_timeout=False,
                socket_read_size=1 << 22,  # pages are ~1 MB: read them in few syscalls
                **kw,
            )

    def exists_prefix(self, keys: list[bytes]) -> int:
        if not keys:
            return 0

        def run() -> int:
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(k)
            found = pipe.execute()
            n = 0
            while n < len(found) and found[n]:
                n += 1
            return n

        return self._call("exists", run, 0)

    def exists(self, keys: list[bytes]) -> list[bool]:
        if not keys:
            return []

        def run() -> list[bool]:
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(k)
            return [bool(x) for x in pipe.execute()]

        return self._call("exists", run, [False] * len(keys))

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        if not keys:
            return []

        def run() -> list[bytes | None]:
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.get(k)
            out: list[bytes | None] = []
            for r in pipe.execute(raise_on_error=False):
                if isinstance(r, Exception):
                    if "WRONGTYPE" not in str(r):
                        raise r
                    r = b""  # a key of another type: not a page (the tier rewrites it)
                out.append(r)
            return out

        return self._call("get", run, [None] * len(keys))

    def get_into(self, keys: list[bytes], parts: Parts) -> list[bool | None]:
        """Pipelined GETs whose values go from the socket straight into ``parts``:
        no reply object and no copy per page (redis-py's replies plus a copy read SmolLM2
        pages at 280-930 MB/s here, the socket into the buffers at 1.3-1.9 GB/s), over
        TCP, TLS or a Unix socket alike. A Redis Cluster goes through ``get``."""
        if not keys:
            return []
        if self._cluster:
            return _get_into(self, keys, parts)

        def run() -> list[bool | None]:
            with self._connection() as conn:
                send(conn._sock, [b"".join(command(b"GET", k) for k in keys)])
                reader = RespReader(conn._sock)
                return [reader.bulk_into(lambda n, i=i: parts(i, n)) for i in range(len(keys))]

        return self._call("get", run, [None] * len(keys))

    def set(self, keys: list[bytes], values: list[bytes]) -> int:
        if not keys:
            return 0

        if self._cluster:

            def run() -> int:
                pipe = self.client.pipeline(transaction=False)
                for k, v in zip(keys, values, strict=True):
                    pipe.set(k, v, ex=self.ttl_s)
                results = pipe.execute(raise_on_error=False)
                bad = [r for r in results if isinstance(r, Exception)]
                if bad:  # e.g. OOM with maxmemory and noeviction: a full store
                    raise bad[0]
                return len(keys)

        else:

            def run() -> int:
                with self._connection() as conn:
                    send(conn._sock, set_commands(keys, values, self.ttl_s))
                    reader = RespReader(conn._sock)
                    replies = [reader.line() for _ in keys]  # all of them: the stream stays whole
                bad = [r for r in replies if not r.startswith(b"+")]
                if bad:  # e.g. OOM with maxmemory and noeviction: a full store
                    import redis

                    raise redis.ResponseError(bad[0][1:].decode(errors="replace"))
                return len(keys)

        return self._call("set", run, 0)

    @contextmanager
    def _connection(self) -> Iterator[Any]:
        """A pooled connection for raw RESP; dropped, never reused, if the block raises
        (replies may be left unread)."""
        pool = self.client.connection_pool
        try:
            conn = pool.get_connection()
        except TypeError:  # redis-py before 5.3 wants a command name
            conn = pool.get_connection("GET")
        try:
            yield conn
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)


def open_store(url: str, max_bytes: int | None = None, **kw: Any) -> PageStore:
    """``memory://``, ``file:///DIR``, ``redis://HOST:PORT/DB`` or ``rediss://...``;
    ``max_bytes`` caps a file store (`radixkv.storage.files`).

    Raises:
        ValueError: an unknown scheme.
    """
    scheme = urlparse(url).scheme
    if max_bytes is not None and scheme != "file":
        raise ValueError(f"storage_max_bytes: only a file:// store takes a size cap; size "
                         f"{scheme}:// in the store itself (Redis: maxmemory)")  # fmt: skip
    if scheme == "memory":
        return MemoryStore()
    if scheme == "file":
        from radixkv.storage.files import FileStore

        path = urlparse(url).path
        if not path:
            raise ValueError(f"storage {url!r}: a file store needs a folder, file:///DIR")
        return FileStore(path, max_bytes=max_bytes)
    if scheme in ("redis", "rediss", "unix"):
        return RedisStore(url, **kw)
    raise ValueError(f"storage {url!r}: expected memory://, file:///DIR, redis:// or rediss://")
