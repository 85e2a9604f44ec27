"""Claude Code itself, from npm (``@anthropic-ai/claude-code``), for the tests that run
it against a local server: installed once into a cache folder; without npm the test is
skipped, saying so."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

VERSION = "2.1.197"  # the version the capture and docs/agents.md describe
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "radixkv-tests"


def claude_code() -> Path:
    """The ``claude`` command, installed from npm once."""
    folder = CACHE / f"claude-code-{VERSION}"
    exe = folder / "node_modules" / ".bin" / "claude"
    if exe.exists():
        return exe
    if shutil.which("npm") is None:
        pytest.skip("needs npm to install Claude Code")
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["npm", "install", "--prefix", str(folder), "--no-audit", "--no-fund",
                    f"@anthropic-ai/claude-code@{VERSION}"], check=True, timeout=600,
                   capture_output=True)  # fmt: skip
    return exe


def claude_env(url: str, home: Path, model: str) -> dict[str, str]:
    """The environment that points Claude Code at ``url``, offline, in its own ``home``."""
    home.mkdir(exist_ok=True)
    return {"PATH": os.environ["PATH"], "HOME": str(home), "ANTHROPIC_BASE_URL": url,
            "ANTHROPIC_API_KEY": "any", "ANTHROPIC_MODEL": model,
            "ANTHROPIC_SMALL_FAST_MODEL": model, "DISABLE_TELEMETRY": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}  # fmt: skip


# the scripted model's answers: each turn says which it read
SCRIPT = {"rules": [{"when": "Say it again", "reply": "Hello again from radixkv."}],
          "default": "Hello from radixkv."}  # fmt: skip


def model_folder(tmp: Path) -> Path:
    """A make-model Qwen3 folder with Claude Code's 128k context."""
    from radixkv.cli import main

    folder = tmp / "qwen3"
    assert main(["make-model", "qwen3", str(folder), "--context", "131072"]) == 0
    return folder


def run_claude(exe: Path, work: Path, env: dict[str, str], *args: str) -> dict:
    """``claude -p ARGS --output-format json`` in ``work``: its JSON answer."""
    work.mkdir(exist_ok=True)
    done = subprocess.run([str(exe), "-p", *args, "--output-format", "json"], cwd=work,
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    return json.loads(done.stdout)
