"""A small RESP client for the two hot paths of the Redis store: pipelined GETs read from
the socket straight into the caller's buffers, and SETs sent as one scatter-gather write.

Owns: the wire bytes of GET and SET (RESP2 and RESP3 replies). Must not touch: which keys
or values (the store's), connections (redis-py's pool lends them).
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from typing import Any

IOV_BATCH = 512  # buffers a sendmsg call takes (the system's limit is 1024)


def command(*args: bytes) -> bytes:
    """A RESP command (an array of bulk strings)."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def set_commands(keys: list[bytes], values: list[bytes], ttl_s: int | None) -> list[Any]:
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


def send(sock: Any, buffers: list[Any]) -> None:
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


class RespReader:
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
        """One GET reply: ``None`` for nil, else whether ``parts(length)`` took it; a key
        of another type (``WRONGTYPE``) is ``False`` too: a value that is not a page,
        which the caller counts and writes over, not a failure of the store.

        Raises:
            redis.ResponseError: any other error reply; ConnectionError: a reply of
                another kind.
        """
        line = self.line()
        kind = line[:1]
        if kind == b"_" or line == b"$-1":
            return None
        if kind == b"-":
            if line.startswith(b"-WRONGTYPE"):
                return False  # a complete reply: the stream stays whole
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
