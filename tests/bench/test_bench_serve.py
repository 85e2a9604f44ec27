"""`radixkv bench-serve` sizes its prompts to the server and never prints nan."""

from __future__ import annotations

import asyncio
import io
import math

import pytest
from rich.console import Console

from radixkv.bench.client import (
    BenchConfig,
    fit_to_server,
    format_report,
    longest_prompt_words,
    report,
    run_bench,
)
from radixkv.web.process import ServerProcess


def test_default_sizes_shrink_to_fit_and_explicit_ones_are_refused():
    cfg = BenchConfig(num_prompts=24, max_tokens=8)
    fitted = fit_to_server(cfg, 4096, tokens_per_word=6.0)  # a byte tokenizer
    words, carried = longest_prompt_words(fitted)
    assert words * 6.0 + carried + 8 <= 0.8 * 4096 and fitted.system_words < cfg.system_words
    assert fit_to_server(cfg, 1 << 20, 6.0) == cfg  # room enough: unchanged
    turns = fit_to_server(BenchConfig(workload="multi-turn", max_tokens=64), 2048, 6.0)
    words, carried = longest_prompt_words(turns)
    assert words * 6.0 + carried + 64 <= 2048
    with pytest.raises(ValueError, match="system_words=3000"):
        fit_to_server(BenchConfig(system_words=3000), 4096, 6.0)
    explicit = BenchConfig(system_words=600, max_tokens=8)  # 628 words ~ 3.8k tokens: fits
    assert fit_to_server(explicit, 4096, 6.0) == explicit
    with pytest.raises(ValueError, match="nothing fits"):
        fit_to_server(BenchConfig(max_tokens=4000), 4096, 6.0)


def test_a_report_with_no_completed_request_prints_dashes():
    cfg = BenchConfig(num_prompts=2)
    rep = report(cfg, "m", [], 2, 1.0, {}, {})
    assert math.isnan(rep["ttft_s"]["p50"])
    out = io.StringIO()
    format_report(rep, Console(file=out, width=120))
    text = out.getvalue()
    assert "nan" not in text and "- / - / - ms" in text and "0 / 0 / 2" in text


def test_the_defaults_run_against_the_random_model():
    """The finding: 24/24 failed for a 4,499-token prompt against a 4,096 context."""
    with ServerProcess("--model", "random", "--page-size", "16", timeout=60) as srv:
        cfg = BenchConfig(url=srv.url, num_prompts=24, max_concurrency=4, max_tokens=8)
        rep = asyncio.run(run_bench(cfg))
    assert rep["requests"]["completed"] == 24 and rep["requests"]["failed"] == 0
    assert rep["config"]["system_words"] < 1000 and rep["cached_tokens"] > 0


def test_multi_turn_chats_can_open_with_one_shared_system_prompt():
    from radixkv.bench.client import shared_system

    cfg = BenchConfig(workload="multi-turn", shared_system_words=50)
    (msg,) = shared_system(cfg)
    assert msg["role"] == "system" and len(msg["content"].split()) == 55
    assert shared_system(BenchConfig(workload="multi-turn")) == []
    # its words count toward the longest prompt, so sizes still fit the server
    plain = longest_prompt_words(BenchConfig(workload="multi-turn"))[0]
    assert longest_prompt_words(cfg)[0] == plain + 50
    with pytest.raises(ValueError, match="shared_system_words"):
        BenchConfig(shared_system_words=-1)


def test_piped_progress_says_soon_then_every_period_with_an_estimate():
    """Piped (a log, CI), a long command prints a line after ``first`` seconds, then one
    a period while it runs (from a timer: a single long step is not silent), and one
    when it ends; one that ends sooner prints nothing (its error stays one line)."""
    import threading

    from radixkv.cli.progress import progress

    out = io.StringIO()
    console = Console(file=out, width=200)  # not a terminal
    with progress(console, "quick", total=4, first=60) as update:
        update(4)
    assert out.getvalue() == ""
    ticked = threading.Event()
    with progress(console, "work", total=4, every=0.05, first=0.05) as update:
        update(1)
        while out.getvalue().count("\n") < 3:  # the timer's lines, with the count so far
            ticked.wait(0.01)
        update(4)
    lines = out.getvalue().splitlines()
    assert "work: 1/4 (25%), 0s, about 0s left" in lines
    assert lines[-1] == "work: 4/4 (100%), 0s, done"


def _first_line_s(argv: list[str], limit: float = 60) -> tuple[float, str]:
    """Seconds until a command's piped output shows its first line (stdout and stderr)."""
    import subprocess
    import sys
    import time

    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "radixkv.cli", *argv], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        line = proc.stdout.readline()
        return time.monotonic() - start, line
    finally:
        proc.kill()
        proc.communicate(timeout=limit)


@pytest.mark.slow
def test_bench_serve_and_demo_say_what_they_do_within_five_seconds():
    """Piped, bench-serve's first progress line and the demo's first line come at once
    (bench-serve was silent for 272 s, the demo's first run for about 90)."""
    with ServerProcess("--model", "random", "--page-size", "16", timeout=60) as srv:
        took, line = _first_line_s(["bench-serve", "--url", srv.url, "--num-prompts", "400",
                                    "--max-tokens", "64"])  # fmt: skip
        assert took < 5 and line.startswith("bench-serve shared-prefix: requests done: "), line
    took, line = _first_line_s(["demo", "--model", "random"])
    assert took < 5 and line.startswith("loading the model (random)"), line
