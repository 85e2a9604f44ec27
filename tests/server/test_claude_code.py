"""Claude Code itself, unmodified (npm's ``@anthropic-ai/claude-code``), against `radixkv
serve` on a make-model folder with a 128k context: two turns of one session (``claude -p``,
then ``--continue``), both answered, the second read from the prompt cache. The model's
answers are scripted (`support.scripted`); everything else is Claude Code's own traffic:
its ~77k-token prompt (byte tokens), tools, ``cache_control`` breakpoints and streaming.

Needs ``npm`` and the npm registry (the package installs once into a cache folder);
without npm the test is skipped, saying so."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from support.scripted import scripted_server

pytestmark = pytest.mark.slow
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


def test_claude_code_runs_two_turns_and_the_second_reads_the_cache(tmp_path):
    exe = claude_code()
    from radixkv.cli import main

    folder = tmp_path / "qwen3"
    assert main(["make-model", "qwen3", str(folder), "--context", "131072"]) == 0
    script = {"rules": [{"when": "Say it again", "reply": "Hello again from radixkv."}],
              "default": "Hello from radixkv."}  # fmt: skip
    srv = scripted_server(script, str(folder), tmp_path, "--served-model-name", "tiny",
                          "--max-context-len", "131072", "--kv-tokens", "400000",
                          "--page-size", "16")  # fmt: skip
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "ANTHROPIC_BASE_URL": srv.url,
           "ANTHROPIC_API_KEY": "any", "ANTHROPIC_MODEL": "tiny",
           "ANTHROPIC_SMALL_FAST_MODEL": "tiny", "DISABLE_TELEMETRY": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}  # fmt: skip
    work = tmp_path / "work"
    work.mkdir()

    def turn(*args: str) -> dict:
        done = subprocess.run([str(exe), "-p", *args, "--output-format", "json"], cwd=work,
                              env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
        return json.loads(done.stdout)

    try:
        first = turn("Say hello")
        second = turn("Say it again", "--continue")
    finally:
        assert srv.stop() == 0
    for out, answer in ((first, "Hello from radixkv."), (second, "Hello again from radixkv.")):
        assert not out["is_error"] and out["result"] == answer, out
        u = out["usage"]
        total = u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"]
        assert total > 20_000  # Claude Code's prompt: system, 24 tools, the conversation
        split = u["cache_creation"]
        # its breakpoints are ephemeral without a ttl (5 minutes): the split says so
        assert split["ephemeral_1h_input_tokens"] == 0
        assert split["ephemeral_5m_input_tokens"] == u["cache_creation_input_tokens"]
        print(f"turn: prompt {total} tokens, read {u['cache_read_input_tokens']}, "
              f"written {u['cache_creation_input_tokens']}, ttft {out.get('ttft_ms')} ms")
    assert first["session_id"] == second["session_id"]
    u = second["usage"]
    total = u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"]
    assert u["cache_read_input_tokens"] >= 0.9 * total
