"""`ServerProcess`: ``radixkv serve`` (or ``radixkv route``) in a child process on a free
loopback port, for tests, benchmarks and scripts that need a real server to talk to.

Owns: starting and stopping a server process. Must not touch: the server itself."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from typing import IO, Any

import httpx

_handed_out: set[int] = set()  # ports this process gave out: never given twice


def _bindable(port: int) -> bool:
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False


def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago, and not handed out before by
    this process (so two servers started together never get the same one)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def free_port_pair() -> int:
    """A port ``p`` with ``p`` and ``p + 1`` free (a KV events PUB port and its replay
    port, vLLM's convention), neither handed out before by this process."""
    while True:
        port = free_port()
        if port < 65535 and port + 1 not in _handed_out and _bindable(port + 1):
            _handed_out.add(port + 1)
            return port


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float) -> None:
    """Wait until ``url``/health answers 200 (any server: radixkv's, a peer's).

    Raises:
        RuntimeError: ``proc`` exited, or did not answer in ``timeout`` s (it is killed).
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr else ""
            raise RuntimeError(f"the server exited with {proc.returncode}: {err}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server did not answer within {timeout} s")


class ServerProcess:
    """Start ``radixkv COMMAND ARGS`` on a free port and wait until ``/health`` answers.

    Args:
        args: the command's arguments (not ``--port``).
        command: ``serve`` or ``route``.
        timeout: seconds to wait for the server (a first SmolLM2 run converts its GGUF).
        stderr: where the server's standard error goes (``subprocess.PIPE`` to read it).
        port: the port to serve on (a restart on its predecessor's port) [a free one].

    Raises:
        RuntimeError: the server exited or did not answer in time.
    """

    def __init__(
        self,
        *args: str,
        command: str = "serve",
        timeout: float = 120,
        stderr: int | IO[Any] | None = None,
        port: int | None = None,
    ) -> None:
        self.port = free_port() if port is None else port
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "radixkv.cli", command, "--port", str(self.port), *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL if stderr is None else stderr,
            text=True,
        )
        wait_healthy(self.proc, self.url, timeout)

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30) -> int:
        """Send ``sig`` and wait; returns the exit status (kills it after ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
