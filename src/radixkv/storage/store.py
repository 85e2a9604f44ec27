"""Page stores by URL: the Redis backend, and `open_store`, which opens any of them
(memory, a folder, Redis) behind the one prefix-shaped interface of `radixkv.storage.base`.

Owns: the Redis backend and opening a store by URL. Must not touch: the bytes of a page
(`radixkv.storage.page`) or the RESP wire (`radixkv.storage.resp`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlparse

from radixkv.storage.base import MemoryStore, PageStore, Parts, SoftStore, get_into
from radixkv.storage.files import FileStore
from radixkv.storage.resp import RespReader, command, send, set_commands


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
            return get_into(self, keys, parts)

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
        path = urlparse(url).path
        if not path:
            raise ValueError(f"storage {url!r}: a file store needs a folder, file:///DIR")
        return FileStore(path, max_bytes=max_bytes)
    if scheme in ("redis", "rediss", "unix"):
        return RedisStore(url, **kw)
    raise ValueError(f"storage {url!r}: expected memory://, file:///DIR, redis:// or rediss://")
