"""Stores for the tier tests: the machine's Redis, a Redis of a test's own to kill,
and an engine over a store."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

from radixkv.engine.engine import Engine
from radixkv.web.process import free_port

REDIS_URL = "redis://127.0.0.1:6379/15"


PROMPTS = ["You are a careful assistant who answers briefly. " * 4 + q
           for q in ("Where is Paris?", "Where is Rome?", "Where is Oslo?")]  # fmt: skip


class OwnRedis:
    """A redis-server of the test's own on a free port, to kill or to fill."""

    def __init__(self, *args: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.proc = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(self.port),
             "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.url = f"redis://127.0.0.1:{self.port}/0"
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def engine(storage: str | None, page: int = 4, **kw) -> Engine:
    return Engine("random", page_size=page, kv_tokens=4096, storage=storage, **kw)


def run(e: Engine) -> list[list[int]]:
    out = e.generate(PROMPTS, max_new_tokens=8, ignore_eos=True)
    if e.tier is not None:
        e.tier.flush()
    return [o.token_ids for o in out.outputs]
