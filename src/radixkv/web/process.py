"""`ServerProcess`: ``radixkv serve`` (or ``radixkv route``) in a child process on a port
the OS picks, for tests, benchmarks and scripts that need a real server to talk to.

Owns: starting and stopping a server process. Must not touch: the server itself."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

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


BANNER = re.compile(r"^radixkv (?:serve|route): .* on (http://\S+)/v1 \(Ctrl-C stops\)$", re.M)


class ServerProcess:
    """Start ``radixkv COMMAND ARGS`` on a port of its own and wait until ``/health``
    answers.

    The server binds ``--port 0`` (the OS picks a free port, so two servers started at
    once never race for one) and says which in its start-up banner; its standard error
    goes to a log file kept for the whole run (`stderr`), and any failure to start raises
    with that log, so the cause is never lost.

    Args:
        args: the command's arguments (not ``--port``).
        command: ``serve`` or ``route``.
        timeout: seconds to wait for the server (a first SmolLM2 run converts its GGUF).
        port: the port to serve on (a restart on its predecessor's port) [one of its own].
        launcher: what runs in place of ``python -m radixkv.cli`` (a test's own entry
            point; it is given the command and its arguments) [that].

    Raises:
        RuntimeError: the server exited or did not answer in time (with its log).
    """

    def __init__(
        self, *args: str, command: str = "serve", timeout: float = 120, port: int | None = None,
        launcher: list[str] | None = None,
    ) -> None:
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (kept open for the run)
            prefix=f"radixkv-{command}-", suffix=".log"
        )
        self.proc = subprocess.Popen(
            [*(launcher or [sys.executable, "-m", "radixkv.cli"]), command, "--port",
             str(port or 0), *args],
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            text=True,
        )
        deadline = time.monotonic() + timeout
        try:
            self.url = self._wait_for_banner(deadline)
            self.port = int(self.url.rsplit(":", 1)[1])
            wait_healthy(self.proc, self.url, max(1.0, deadline - time.monotonic()))
        except BaseException as e:
            self.stop(signal.SIGKILL, 5)
            if isinstance(e, RuntimeError):
                raise RuntimeError(f"{e}\n--- its stderr ---\n{self.stderr()[-4000:]}") from None
            raise

    def _wait_for_banner(self, deadline: float) -> str:
        """The server's URL, from its banner (printed once it listens and is loaded)."""
        while time.monotonic() < deadline:
            found = BANNER.search(self.stderr())
            if found:
                return found.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}")
            time.sleep(0.05)  # polls the log: the banner is the event waited for
        raise RuntimeError("the server printed no banner in time")

    def stderr(self) -> str:
        """Everything the server wrote to its standard error so far."""
        with open(self._log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

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
