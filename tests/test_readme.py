"""The README and the docs run as written: their Python snippets, and every shell block
marked ``bash runnable`` (on a fresh install, tiny models, bounded sizes)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from radixkv.web.process import free_port_pair

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
# the examples' ports: the one change a run makes is to give it ports of its own
PORTS = (8000, 8001, 8002, 8003, 8100, 5557, 5567)


def blocks(kind: str) -> list[tuple[str, str]]:
    """(``FILE:N``, text) of every fenced block whose info string is ``kind``."""
    fence = re.compile(rf"```{kind}\n(.*?)```", re.S)
    return [(f"{p.name}:{i}", m.group(1)) for p in DOCS
            for i, m in enumerate(fence.finditer(p.read_text()))]  # fmt: skip


def test_python_snippets_run(capsys):
    found = blocks("python")
    assert len(found) >= 4, "the README and docs show how to use the cache"
    for where, block in found:
        exec(compile(block, where, "exec"), {})
    assert "tensor([100, 101, 102, 103, 104])" in capsys.readouterr().out


RUNNABLE = blocks("bash runnable")


def test_the_readme_shows_a_runnable_example_of_each_command():
    shown = " ".join(script for where, script in RUNNABLE if where.startswith("README"))
    for command in ("radixkv serve", "radixkv route", "radixkv simulate", "radixkv make-model"):
        assert command in shown, command


def run_block(script: str, cwd: Path, timeout: float = 600) -> tuple[int, str]:
    """A shell block as a newcomer runs it (``bash -e``), on ports of its own; whatever
    it leaves running is killed. Its exit status and output."""
    env = {**os.environ, "RADIXKV_CACHE": str(cwd / "cache")}
    proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", script], cwd=cwd,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever it left running
    return proc.returncode, out


def own_ports(script: str) -> str:
    for port in PORTS:
        script = re.sub(rf"\b{port}\b", str(free_port_pair()), script)
    return script


@pytest.mark.slow
@pytest.mark.parametrize(("where", "script"), RUNNABLE, ids=[w for w, _ in RUNNABLE])
def test_every_runnable_block_runs_as_written_twice(where, script, tmp_path):
    """Twice in the same folder: a block that made a folder or left a file the first
    time runs again as written."""
    script = own_ports(script)
    for run in (1, 2):
        code, out = run_block(script, tmp_path)
        assert code == 0, f"{where} failed (run {run}):\n{script}\n--- its output ---\n{out}"
        assert "Traceback" not in out and "error:" not in out, out


@pytest.mark.slow
def test_a_server_that_cannot_start_ends_its_block_with_its_error(tmp_path):
    """The README's wait is bounded and reads the server's log: a model folder that
    does not exist ends the block at once with the server's one-line error, where an
    unbounded wait looped for ever."""
    import time

    serve = next(s for w, s in RUNNABLE if w.startswith("README") and "--port 8000" in s)
    script = own_ports(serve.replace("--model random", "--model no-such-folder"))
    start = time.monotonic()
    code, out = run_block(script, tmp_path, timeout=120)
    assert code != 0 and time.monotonic() - start < 60, out
    assert "error: --model no-such-folder" in out, out


def test_import_radixkv_is_light():
    """The claim in radixkv/__init__.py: numpy loads on first use, not on import; torch
    only when tensors are asked for (the tree itself needs none)."""
    import sys

    code = (
        "import sys, radixkv; assert 'torch' not in sys.modules and 'numpy' not in sys.modules;"
        "c = radixkv.RadixCache(page_size=1); c.insert([1, 2, 3]); assert c.match_len([1, 2]) == 2;"
        "assert 'numpy' in sys.modules and 'torch' not in sys.modules;"
        "v = c.match_prefix([1, 2, 3]).indices; assert 'torch' in sys.modules, v"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
