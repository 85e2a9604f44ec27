"""Page stores and the page format (see `radixkv.storage`)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import ssl
import struct
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

log = logging.getLogger("radixkv.storage")

MAGIC = b"RKV2"
FORMAT_VERSION = 2
KEY_HASH_BYTES = 16  # a page's chained hash (radixkv.tree.page_hash)
MAC_BYTES = 32  # keyed BLAKE2b-256 over the header and payload, with a storage secret
_FLAG_MAC = 1
# magic, version, fingerprint (16 bytes), key hash (16 bytes), flags, payload length, CRC-32
_HEADER = struct.Struct(">4sH16s16sBQI")
IOV_BATCH = 512  # buffers a sendmsg call takes (the system's limit is 1024)


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


class PageError(ValueError):
    """A stored value that must not be used; ``kind`` is ``corrupt`` (the header, length
    or CRC check failed: another format, model or key, truncated, flipped bits) or
    ``unauthenticated`` (a storage secret is set and the value's MAC is missing or
    wrong)."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


class PageCodec:
    """Wraps a page's payload in a checked header, and with a secret a MAC.

    Args:
        fingerprint: 16 bytes naming the model (`radixkv.storage.identity`).
        secret: a storage secret shared by the engines of one fleet: every page then
            carries a keyed BLAKE2b-256 MAC over its header and payload, and a page
            whose MAC fails (or that has none) is refused. Without one, anyone who can
            write to the store can change what the engines compute.
    """

    def __init__(self, fingerprint: bytes, secret: bytes | None = None) -> None:
        if len(fingerprint) != 16:
            raise ValueError("fingerprint must be 16 bytes")
        if secret is not None and not (isinstance(secret, bytes) and secret):
            raise ValueError("secret must be non-empty bytes")
        self.fingerprint = fingerprint
        self.secret = secret
        # the MAC key: a digest of the secret (any length), never the secret itself
        self._mac_key = (
            hashlib.blake2b(secret, digest_size=32, person=b"radixkv-page-mac").digest()
            if secret is not None
            else b""
        )

    def _mac(self, header: bytes | memoryview, payload: bytes | memoryview) -> bytes:
        h = hashlib.blake2b(digest_size=MAC_BYTES, key=self._mac_key)
        h.update(header)
        h.update(payload)
        return h.digest()

    def encode(self, key_hash: bytes, payload: bytes) -> bytes:
        flags = _FLAG_MAC if self.secret is not None else 0
        header = _HEADER.pack(
            MAGIC, FORMAT_VERSION, self.fingerprint, key_hash, flags, len(payload),
            zlib.crc32(payload),
        )  # fmt: skip
        if self.secret is None:
            return header + payload
        return header + payload + self._mac(header, payload)

    def decode(self, key_hash: bytes, value: bytes) -> memoryview:
        """The payload (a view, no copy).

        Raises:
            PageError: the value fails a check (see `PageError`)."""
        view = memoryview(value)
        if len(view) < _HEADER.size:
            raise PageError("corrupt")
        length = _HEADER.unpack_from(view)[5]
        end = _HEADER.size + length
        mac = view[end:]
        self.check(key_hash, view[: _HEADER.size], view[_HEADER.size : end], mac)
        return view[_HEADER.size : end]

    def value_parts(self, length: int, payload_len: int) -> tuple[int, int] | None:
        """How a stored value of ``length`` bytes splits when its payload should be
        ``payload_len``: (header, MAC) sizes, or ``None`` when it cannot be such a page.
        A value with and one without a MAC both split (`check` says which may be used)."""
        if length == _HEADER.size + payload_len:
            return _HEADER.size, 0
        if length == _HEADER.size + payload_len + MAC_BYTES:
            return _HEADER.size, MAC_BYTES
        return None

    def check(
        self, key_hash: bytes, header: memoryview, payload: memoryview, mac: memoryview
    ) -> None:
        """Check a value given in its parts (a store may read them straight into
        separate buffers: `PageStore.get_into`).

        Raises:
            PageError: the value fails a check (see `PageError`)."""
        if len(header) != _HEADER.size:
            raise PageError("corrupt")
        magic, version, fp, kh, flags, length, crc = _HEADER.unpack_from(header)
        if (magic, version, fp, kh) != (MAGIC, FORMAT_VERSION, self.fingerprint, key_hash):
            raise PageError("corrupt")
        if len(payload) != length or len(mac) != (MAC_BYTES if flags & _FLAG_MAC else 0):
            raise PageError("corrupt")
        if zlib.crc32(payload) != crc:
            raise PageError("corrupt")
        if self.secret is not None and (
            not flags & _FLAG_MAC or not hmac.compare_digest(mac, self._mac(header, payload))
        ):
            raise PageError("unauthenticated")


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

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        return [self.data.get(k) for k in keys]

    def set(self, keys: list[bytes], values: list[bytes]) -> int:
        for k, v in zip(keys, values, strict=True):
            self.data[k] = v
        return len(keys)

    def get_into(self, keys: list[bytes], parts: Parts) -> list[bool | None]:
        return _get_into(self, keys, parts)


class _SoftStore:
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


class FileStore(_SoftStore):
    """One file per page under ``root`` (``root/ab/abcdef...``); writes go to a temporary
    file and are renamed into place, so readers in other processes never see half a page,
    and a write that fails (a full disk) removes its temporary file. A folder that cannot
    be created or written (at start or later) is soft, as a down Redis is: a warning
    naming the path, then misses until it works again.

    Args:
        root: the folder (created on first use, with its parents).
        retry_s: after a failure, the store is skipped this long.
    """

    def __init__(self, root: str | Path, retry_s: float = 5.0) -> None:
        super().__init__(f"file store {root}", retry_s)
        self.root = Path(root)
        self._ready = False
        self._call("open", self._open, None)

    def _open(self) -> None:
        if not self._ready:
            self.root.mkdir(parents=True, exist_ok=True)
            self._ready = True

    def _path(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[-2:] / name

    def exists_prefix(self, keys: list[bytes]) -> int:
        def run() -> int:
            self._open()
            n = 0
            while n < len(keys) and self._path(keys[n]).exists():
                n += 1
            return n

        return self._call("exists", run, 0)

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        def run() -> list[bytes | None]:
            self._open()
            out: list[bytes | None] = []
            for k in keys:
                try:
                    out.append(self._path(k).read_bytes())
                except FileNotFoundError:
                    out.append(None)
            return out

        return self._call("get", run, [None] * len(keys))

    def get_into(self, keys: list[bytes], parts: Parts) -> list[bool | None]:
        return _get_into(self, keys, parts)

    def set(self, keys: list[bytes], values: list[bytes]) -> int:
        def run() -> int:
            self._open()
            done = 0
            for k, v in zip(keys, values, strict=True):
                path = self._path(k)
                try:
                    path.parent.mkdir(exist_ok=True)  # not the root: a vanished root fails
                    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
                except OSError as e:
                    self._fail("set", e)
                    return done
                try:
                    with os.fdopen(fd, "wb") as f:
                        f.write(v)
                    os.replace(tmp, path)
                except OSError as e:
                    Path(tmp).unlink(missing_ok=True)  # a full disk stays no fuller
                    self._fail("set", e)
                    return done
                done += 1
            return done

        return self._call("set", run, 0)


class RedisStore(_SoftStore):
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

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        if not keys:
            return []

        def run() -> list[bytes | None]:
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.get(k)
            return pipe.execute()

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
                _send(conn._sock, [b"".join(_command(b"GET", k) for k in keys)])
                reader = _RespReader(conn._sock)
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
                    _send(conn._sock, _set_commands(keys, values, self.ttl_s))
                    reader = _RespReader(conn._sock)
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


def _command(*args: bytes) -> bytes:
    """A RESP command (an array of bulk strings)."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def _set_commands(keys: list[bytes], values: list[bytes], ttl_s: int | None) -> list[Any]:
    """SET commands as buffers to send, each value as its own buffer (never copied)."""
    if ttl_s is None:
        head, tail = b"*3\r\n", b"\r\n"
    else:  # SET key value EX seconds: the two last arguments follow the value
        ttl = str(ttl_s).encode()
        head, tail = b"*5\r\n", b"\r\n$2\r\nEX\r\n$%d\r\n%s\r\n" % (len(ttl), ttl)
    out: list[Any] = []
    for k, v in zip(keys, values, strict=True):
        out.append(b"%s$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (head, len(k), k, len(v)))
        out.append(v)
        out.append(tail)
    return out


def _send(sock: Any, buffers: list[Any]) -> None:
    """Send ``buffers`` in order: scatter-gather (``sendmsg``, no copy), or one by one
    on a TLS socket, which has no ``sendmsg``."""
    if sock is None:
        raise ConnectionError("not connected")
    if isinstance(sock, ssl.SSLSocket):
        for b in buffers:
            sock.sendall(b)
        return
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]
    at = 0  # the first buffer not wholly sent
    while at < len(views):
        sent = sock.sendmsg(views[at : at + IOV_BATCH])
        while sent:
            if sent >= len(views[at]):
                sent -= len(views[at])
                at += 1
            else:
                views[at] = views[at][sent:]
                sent = 0


class _RespReader:
    """Replies (RESP2 or RESP3) off a socket: a bulk string goes straight into the
    caller's buffers with ``recv_into``; only line headers pass through a small buffer."""

    CHUNK = 1 << 16  # a read for headers; also the longest reply line taken

    def __init__(self, sock: Any) -> None:
        if sock is None:
            raise ConnectionError("not connected")
        self.sock = sock
        self.buf = bytearray()
        self.pos = 0  # buf[pos:] is unread: consuming moves pos, never the bytes

    def _fill(self) -> None:
        if self.pos:
            del self.buf[: self.pos]
            self.pos = 0
        if len(self.buf) > self.CHUNK:
            raise ConnectionError("a reply line longer than 64 KiB: not Redis")
        chunk = self.sock.recv(self.CHUNK)
        if not chunk:
            raise ConnectionError("Redis closed the connection mid-reply")
        self.buf += chunk

    def line(self) -> bytes:
        while (end := self.buf.find(b"\r\n", self.pos)) < 0:
            self._fill()
        line = bytes(self.buf[self.pos : end])
        self.pos = end + 2
        return line

    def _read_into(self, view: memoryview) -> None:
        take = min(len(self.buf) - self.pos, len(view))
        view[:take] = memoryview(self.buf)[self.pos : self.pos + take]
        self.pos += take
        while take < len(view):
            n = self.sock.recv_into(view[take:])
            if not n:
                raise ConnectionError("Redis closed the connection mid-reply")
            take += n

    def _skip(self, n: int) -> None:
        while n:
            if self.pos == len(self.buf):
                self._fill()
            take = min(n, len(self.buf) - self.pos)
            self.pos += take
            n -= take

    def bulk_into(self, parts: Callable[[int], list[memoryview] | None]) -> bool | None:
        """One GET reply: ``None`` for nil, else whether ``parts(length)`` took it.

        Raises:
            redis.ResponseError: an error reply; ConnectionError: a reply of another kind.
        """
        line = self.line()
        kind = line[:1]
        if kind == b"_" or line == b"$-1":
            return None
        if kind == b"-":
            import redis

            raise redis.ResponseError(line[1:].decode(errors="replace"))
        if kind != b"$":
            raise ConnectionError(f"unexpected reply to GET: {line[:40]!r}")
        n = int(line[1:])
        where = parts(n)
        if where is None or sum(len(p) for p in where) != n:
            self._skip(n + 2)
            return False
        for view in where:
            self._read_into(view)
        self._skip(2)  # the bulk string's CRLF
        return True


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
