"""Running an ASGI app with uvicorn the way radixkv's servers do: on SIGINT/SIGTERM a hook
first (abort what is in flight), then a graceful stop that exits 0.

Before serving, everything allocated at start (imports, torch, the model, the
tokenizer) moves to the garbage collector's permanent generation (``gc.freeze``): a full
collection while serving then scans only what serving made. Measured on `radixkv route`
under bench_route's 48 chats x 16 concurrent: its full collections took 135-163 ms each
(every request in flight stalled that long), 8 ms frozen; all collections of the run
together 420 ms, then 94 ms.

Owns: the uvicorn server object and its signal handling, and `until_disconnected` (what
the server and the router await to learn a client left). Must not touch: the app.
"""

from __future__ import annotations

import gc
import socket
from typing import Any

GRACEFUL_TIMEOUT_S = 5  # at most this long for open connections after the aborts


async def until_disconnected(request: Any) -> None:
    """Returns when the client of ``request`` (a Starlette request whose body was read
    whole) has gone: what it receives next is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def bind(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` (``0``: a port the OS picks), made before any
    slow start-up, so a port in use is refused at once (uvicorn serves on it:
    ``server.run(sockets=[sock])``).

    Raises:
        OSError: the address cannot be bound (in use, not this machine's).
    """
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def bound_url(sock: socket.socket) -> str:
    """``http://HOST:PORT`` of a bound socket (its real port, when 0 was asked)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def uvicorn_server(app: Any, host: str, port: int, log_level: str, on_exit: Any = None) -> Any:
    """A uvicorn server that calls ``on_exit()`` first on SIGINT/SIGTERM and exits 0
    after a requested, completed shutdown."""
    import uvicorn

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=log_level in ("info", "debug", "trace"),
        timeout_graceful_shutdown=GRACEFUL_TIMEOUT_S,
    )

    class Server(uvicorn.Server):
        def run(self, sockets: Any = None) -> None:
            gc.freeze()  # what start made is never garbage: full collections skip it
            super().run(sockets)

        def handle_exit(self, sig: int, frame: Any) -> None:
            if on_exit is not None:
                on_exit()
            super().handle_exit(sig, frame)
            # uvicorn re-raises a caught signal after shutting down (exit 130/143)
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()

    return Server(config)
