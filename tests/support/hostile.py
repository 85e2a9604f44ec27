"""`HostileWorker`: an HTTP server on loopback that plays a worker gone wrong, for the
router's hardening tests: it hangs on POSTs, fails them at once, drips or floods its
answers, or serves a card it was given. It stands in for no radixkv part: it is the peer
the router must survive, scripted so each failure is exact and repeatable.

Behaviors (``routes``: ``"METHOD PATH"`` -> one of these):

- ``("json", obj, status)``: the object as JSON;
- ``("hang",)``: read the request, answer nothing, until the client closes the connection
  (counted in `open_hangs`, so a test sees the router close it) or the server stops;
- ``("fail",)``: a 500 with an OpenAI error body, at once;
- ``("drip", status)``: headers, then one byte a second, for ever;
- ``("flood", nbytes)``: a 200 JSON-typed body of ``nbytes`` bytes, sent in 1 MiB chunks
  (never held whole here).
"""

from __future__ import annotations

import json
import select
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

CHUNK = 1 << 20


class HostileWorker:
    def __init__(self, routes: dict[str, tuple]) -> None:
        self.routes = dict(routes)
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        self.open_hangs = 0  # hung requests whose client has not closed yet
        self.max_hangs = 0  # the most open at once
        self.posts = 0  # POSTs received
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def do_GET(self) -> None:
                owner._serve(self, "GET")

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                self.rfile.read(length)
                with owner.lock:
                    owner.posts += 1
                owner._serve(self, "POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def _serve(self, h: BaseHTTPRequestHandler, method: str) -> None:
        path = h.path.split("?", 1)[0]
        route = self.routes.get(f"{method} {path}", ("json", {"error": "no route"}, 404))
        kind = route[0]
        try:
            if kind == "json":
                self._json(h, route[1], route[2] if len(route) > 2 else 200)
            elif kind == "fail":
                self._json(h, {"error": {"message": "boom", "type": "server_error",
                                         "param": None, "code": None}}, 500)  # fmt: skip
            elif kind == "hang":
                self._hang(h)
            elif kind == "drip":
                self._drip(h, route[1])
            elif kind == "flood":
                self._flood(h, route[1])
        except (BrokenPipeError, ConnectionResetError, OSError):
            h.close_connection = True

    @staticmethod
    def _json(h: BaseHTTPRequestHandler, obj: Any, status: int) -> None:
        data = json.dumps(obj).encode()
        h.send_response(status)
        h.send_header("content-type", "application/json")
        h.send_header("content-length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _hang(self, h: BaseHTTPRequestHandler) -> None:
        with self.lock:
            self.open_hangs += 1
            self.max_hangs = max(self.max_hangs, self.open_hangs)
        try:
            sock = h.connection
            while not self.stop_event.is_set():
                ready, _, _ = select.select([sock], [], [], 0.05)
                if ready and not sock.recv(1, socket.MSG_PEEK):
                    break  # the client closed the connection
        finally:
            with self.lock:
                self.open_hangs -= 1
            h.close_connection = True

    def _drip(self, h: BaseHTTPRequestHandler, status: int) -> None:
        h.send_response(status)
        h.send_header("content-type", "application/json")
        h.send_header("content-length", str(1 << 30))
        h.end_headers()
        h.wfile.flush()
        while not self.stop_event.wait(1.0):
            h.wfile.write(b" ")
            h.wfile.flush()
        h.close_connection = True

    def _flood(self, h: BaseHTTPRequestHandler, nbytes: int) -> None:
        h.send_response(200)
        h.send_header("content-type", "application/json")
        h.send_header("content-length", str(nbytes))
        h.end_headers()
        block = b" " * CHUNK
        left = nbytes
        while left > 0 and not self.stop_event.is_set():
            h.wfile.write(block[: min(left, CHUNK)])
            left -= CHUNK
        h.close_connection = True

    def stop(self) -> None:
        self.stop_event.set()
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> HostileWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def card_of(url: str) -> dict:
    """A real worker's ``/v1/models`` answer (a hostile one copies it to pass the checks)."""
    import httpx

    return httpx.get(f"{url}/v1/models", timeout=10).json()


__all__ = ["HostileWorker", "card_of"]
