"""Page stores and the page format (see `radixkv.storage`)."""

from __future__ import annotations

import logging
import os
import struct
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

log = logging.getLogger("radixkv.storage")

MAGIC = b"RKV1"
FORMAT_VERSION = 1
# magic, version, fingerprint (16 bytes), key hash (8 bytes), payload length, CRC-32
_HEADER = struct.Struct(">4sH16s8sQI")


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


class PageCodec:
    """Wraps a page's payload in a checked header.

    Args:
        fingerprint: 16 bytes naming the model, dtype, page size and KV layout.
    """

    def __init__(self, fingerprint: bytes) -> None:
        if len(fingerprint) != 16:
            raise ValueError("fingerprint must be 16 bytes")
        self.fingerprint = fingerprint

    def encode(self, key_hash: bytes, payload: bytes) -> bytes:
        header = _HEADER.pack(
            MAGIC, FORMAT_VERSION, self.fingerprint, key_hash, len(payload), zlib.crc32(payload)
        )
        return header + payload

    def decode(self, key_hash: bytes, value: bytes | None) -> memoryview | None:
        """The payload (a view, no copy), or ``None`` when the value is missing or fails
        any check (another format or model, another key, truncated, corrupted)."""
        if value is None or len(value) < _HEADER.size:
            return None
        magic, version, fp, kh, length, crc = _HEADER.unpack_from(value)
        payload = memoryview(value)[_HEADER.size :]
        if (magic, version, fp, kh) != (MAGIC, FORMAT_VERSION, self.fingerprint, key_hash):
            return None
        if len(payload) != length or zlib.crc32(payload) != crc:
            return None
        return payload


class PageStore(Protocol):
    stats: StoreStats

    def exists_prefix(self, keys: list[bytes]) -> int: ...
    def get(self, keys: list[bytes]) -> list[bytes | None]: ...
    def set(self, keys: list[bytes], values: list[bytes]) -> int: ...


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

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        return [self.data.get(k) for k in keys]

    def set(self, keys: list[bytes], values: list[bytes]) -> int:
        for k, v in zip(keys, values, strict=True):
            self.data[k] = v
        return len(keys)


class FileStore:
    """One file per page under ``root`` (``root/ab/abcdef...``); writes go to a temporary
    file and are renamed into place, so readers in other processes never see half a page."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.stats = StoreStats()

    def _path(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[-2:] / name

    def exists_prefix(self, keys: list[bytes]) -> int:
        n = 0
        while n < len(keys) and self._path(keys[n]).exists():
            n += 1
        return n

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for k in keys:
            try:
                out.append(self._path(k).read_bytes())
            except OSError:
                out.append(None)
        return out

    def set(self, keys: list[bytes], values: list[bytes]) -> int:
        done = 0
        for k, v in zip(keys, values, strict=True):
            path = self._path(k)
            try:
                path.parent.mkdir(exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
                with os.fdopen(fd, "wb") as f:
                    f.write(v)
                os.replace(tmp, path)
                done += 1
            except OSError as e:
                self.stats.errors += 1
                log.warning("file store: cannot write %s: %s", path, e)
                break
        return done


class RedisStore:
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

        self.url, self.retry_s, self.ttl_s = url, retry_s, ttl_s
        parsed = urlparse(url)
        cluster = "cluster=1" in parsed.query.split("&")
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
        self.stats = StoreStats()
        self._down_until = 0.0
        self._warned = False

    def _call(self, what: str, fn: Any, default: Any) -> Any:
        if time.monotonic() < self._down_until:
            return default
        try:
            return fn()
        except Exception as e:  # redis errors, OSError: the store is down or refuses
            self.stats.errors += 1
            self._down_until = time.monotonic() + self.retry_s
            if not self._warned:
                log.warning("redis store %s failed (%s: %s); recomputing instead, retrying "
                            "in %.0f s", what, type(e).__name__, e, self.retry_s)  # fmt: skip
                self._warned = True
            return default

    def _ok(self) -> None:
        self._warned = False

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

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        if not keys:
            return []

        def run() -> list[bytes | None]:
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.get(k)
            return pipe.execute()

        return self._call("get", run, [None] * len(keys))

    def set(self, keys: list[bytes], values: list[bytes]) -> int:
        if not keys:
            return 0

        def run() -> int:
            pipe = self.client.pipeline(transaction=False)
            for k, v in zip(keys, values, strict=True):
                pipe.set(k, v, ex=self.ttl_s)
            results = pipe.execute(raise_on_error=False)
            bad = [r for r in results if isinstance(r, Exception)]
            if bad:  # e.g. OOM with maxmemory and noeviction: a full store
                raise bad[0]
            return len(keys)

        return self._call("set", run, 0)


def open_store(url: str, **kw: Any) -> PageStore:
    """``memory://``, ``file:///DIR``, ``redis://HOST:PORT/DB`` or ``rediss://...``.

    Raises:
        ValueError: an unknown scheme.
    """
    scheme = urlparse(url).scheme
    if scheme == "memory":
        return MemoryStore()
    if scheme == "file":
        path = urlparse(url).path
        if not path:
            raise ValueError(f"storage {url!r}: a file store needs a folder, file:///DIR")
        return FileStore(path)
    if scheme in ("redis", "rediss", "unix"):
        return RedisStore(url, **kw)
    raise ValueError(f"storage {url!r}: expected memory://, file:///DIR, redis:// or rediss://")
