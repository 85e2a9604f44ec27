"""Claude Code itself, unmodified (npm's ``@anthropic-ai/claude-code``), through `radixkv
route --policy kv` in front of two `radixkv serve` workers with KV events: two turns of
one session (``claude -p``, then ``--continue``) and a second session beside them, all
answered; the session's second turn goes back to the worker holding its first (read from
its cache). The workers' answers are scripted (`support.scripted`); everything else is
Claude Code's own traffic through the router: its ~77k-token prompt, tools,
``cache_control`` breakpoints, ``/v1/messages?beta=true``, streaming."""

from __future__ import annotations

import pytest
from support.claude import SCRIPT, claude_code, claude_env, model_folder, run_claude
from support.scripted import scripted_server

from radixkv.web.process import ServerProcess, free_port_pair

pytestmark = pytest.mark.slow


def test_claude_code_through_the_router_keeps_a_session_on_its_worker(tmp_path):
    exe = claude_code()
    folder = model_folder(tmp_path)
    workers, specs = [], []
    try:
        for i in range(2):
            events = free_port_pair()
            (tmp_path / f"w{i}").mkdir()
            workers.append(scripted_server(
                SCRIPT, str(folder), tmp_path / f"w{i}", "--served-model-name", "tiny",
                "--max-context-len", "131072", "--kv-tokens", "400000", "--page-size", "16",
                "--kv-events", f"tcp://127.0.0.1:{events}"))  # fmt: skip
            specs += ["--worker", f"{workers[-1].url},tcp://127.0.0.1:{events}"]
        router = ServerProcess("--model", str(folder), "--policy", "kv", *specs,
                               command="route", timeout=120)  # fmt: skip

        def turn(home: str, *args: str) -> dict:
            env = claude_env(router.url, tmp_path / home, "tiny")
            return run_claude(exe, tmp_path / "work", env, *args)

        try:
            first = turn("home", "Say hello")
            second = turn("home", "Say it again", "--continue")
            other = turn("home2", "Say hello")  # another user's session
        finally:
            assert router.stop() == 0
    finally:
        for w in workers:
            w.stop()
    for out, answer in ((first, "Hello from radixkv."), (second, "Hello again from radixkv."),
                        (other, "Hello from radixkv.")):  # fmt: skip
        assert not out["is_error"] and out["result"] == answer, out
        u = out["usage"]
        print(f"turn: read {u['cache_read_input_tokens']}, written "
              f"{u['cache_creation_input_tokens']}, uncached {u['input_tokens']}")
    assert first["session_id"] == second["session_id"] != other["session_id"]
    u = second["usage"]
    total = u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"]
    assert total > 20_000 and u["cache_read_input_tokens"] >= 0.9 * total, u
