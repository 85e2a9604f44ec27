"""Bounded reads from a peer: a ``GET`` whose whole answer (headers and body) must arrive
within a total deadline and whose body is read up to a size cap.

Owns: `bounded_get`. Must not touch: what the answer means (the caller parses it).

Why: a peer (a worker answering the router's ``/health``, ``/v1/models`` or card read) is
not trusted. A per-read timeout bounds nothing against a peer that sends one byte a second,
and reading a body whole lets a 1 GiB answer cost the reader 1 GiB. Here the deadline covers
connecting, the headers and every body byte, and the body is kept only up to ``limit``
bytes: past it the read stops and raises, having held at most ``limit`` + one chunk.
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

import httpx


class PeerError(Exception):
    """The peer's answer broke a bound (too large, too slow) or the connection failed;
    the message says which, and ``refused`` is True when the peer could not be reached
    at all (its connection was refused or reset: a certain failure, not a slow one)."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class Answer(NamedTuple):
    status: int
    body: bytes


async def _read(client: httpx.AsyncClient, url: str, limit: int) -> Answer:
    # identity: the bytes counted are the bytes kept (no compressed answer grows here)
    async with client.stream("GET", url, headers={"accept-encoding": "identity"}) as r:
        body = bytearray()
        async for chunk in r.aiter_raw():
            body += chunk
            if len(body) > limit:
                raise PeerError(f"{url} answered more than {limit} bytes")
        return Answer(r.status_code, bytes(body))


async def bounded_get(client: httpx.AsyncClient, url: str, limit: int, deadline: float) -> Answer:
    """``GET url``: its status and body, all of it within ``deadline`` seconds and the body
    at most ``limit`` bytes (read raw: no decompression can grow it).

    Raises:
        PeerError: too slow, too large, or the connection failed (``refused``: it was
            refused, reset or closed before an answer).
    """
    try:
        return await asyncio.wait_for(_read(client, url, limit), deadline)
    except asyncio.TimeoutError:
        raise PeerError(f"{url} did not answer in full within {deadline:g} s") from None
    except (httpx.ConnectError, httpx.RemoteProtocolError) as e:
        raise PeerError(f"{url}: {type(e).__name__}: {e}", refused=True) from None
    except httpx.HTTPError as e:
        raise PeerError(f"{url}: {type(e).__name__}: {e}") from None


__all__ = ["Answer", "PeerError", "bounded_get"]
