"""Claude Code itself, unmodified (npm's ``@anthropic-ai/claude-code``), against `radixkv
serve` on a make-model folder with a 128k context: two turns of one session (``claude -p``,
then ``--continue``), both answered, the second read from the prompt cache. The model's
answers are scripted (`support.scripted`); everything else is Claude Code's own traffic:
its ~77k-token prompt (byte tokens), tools, ``cache_control`` breakpoints and streaming.

Needs ``npm`` and the npm registry (the package installs once into a cache folder);
without npm the test is skipped, saying so."""

from __future__ import annotations

import pytest
from support.claude import SCRIPT, claude_code, claude_env, model_folder, run_claude
from support.scripted import scripted_server

pytestmark = pytest.mark.slow


def test_claude_code_runs_two_turns_and_the_second_reads_the_cache(tmp_path):
    exe = claude_code()
    srv = scripted_server(SCRIPT, str(model_folder(tmp_path)), tmp_path, "--served-model-name",
                          "tiny", "--max-context-len", "131072", "--kv-tokens", "400000",
                          "--page-size", "16")  # fmt: skip
    env = claude_env(srv.url, tmp_path / "home", "tiny")

    def turn(*args: str) -> dict:
        return run_claude(exe, tmp_path / "work", env, *args)

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
