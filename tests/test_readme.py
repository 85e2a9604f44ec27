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


@pytest.mark.slow
@pytest.mark.parametrize(("where", "script"), RUNNABLE, ids=[w for w, _ in RUNNABLE])
def test_every_runnable_block_runs_as_written(where, script, tmp_path):
    for port in PORTS:
        script = re.sub(rf"\b{port}\b", str(free_port_pair()), script)
    env = {**os.environ, "RADIXKV_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", script], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever it left running
    assert proc.returncode == 0, f"{where} failed:\n{script}\n--- its output ---\n{out}"
    assert "Traceback" not in out and "error:" not in out, out


def test_import_radixkv_is_light():
    """The claim in radixkv/__init__.py: torch and numpy load on first use, not on import."""
    import sys

    code = (
        "import sys, radixkv; assert 'torch' not in sys.modules and 'numpy' not in sys.modules;"
        "radixkv.RadixCache; assert 'torch' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
