"""``radixkv bench-serve``: a load generator for OpenAI-compatible servers on loopback.

What users of ``vllm bench serve`` and ``sglang.bench_serving`` expect: generated
shared-prefix or multi-turn workloads (or a JSONL file of prompts), Poisson arrivals at
``request_rate`` or a fixed ``max_concurrency``, streamed requests timed on the client
(time to first token, inter-token latency, end-to-end latency: p50/p90/p99), request and
token throughput, and the server's prefix-cache hit rate read from its ``/metrics``.

It is bounded: at most ``num_prompts`` requests, and ``time_limit`` seconds after which
nothing new is sent and what is in flight is cancelled. It sends only to loopback
addresses.

Owns: the workloads, the client, the timings and the report. Must not touch: any
server's internals; it sends HTTP to loopback only.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import math
import random
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlparse

import httpx


class LongestPrompt(NamedTuple):
    """The longest prompt a workload sends (`longest_prompt_words`)."""

    words: int
    carried_tokens: int  # output tokens of earlier turns it carries


WORKLOADS = ("shared-prefix", "multi-turn", "file")
# A fixed vocabulary of common words: about one token each for a BPE tokenizer.
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "you",
    "that",
    "it",
    "he",
    "was",
    "for",
    "on",
    "are",
    "as",
    "with",
    "his",
    "they",
    "at",
    "be",
    "this",
    "have",
    "from",
    "or",
    "one",
    "had",
    "by",
    "word",
    "but",
    "not",
    "what",
    "all",
    "were",
    "we",
    "when",
    "your",
    "can",
    "said",
    "there",
    "use",
    "an",
    "each",
    "which",
    "she",
    "do",
    "how",
    "their",
    "if",
    "will",
    "up",
    "other",
    "about",
    "out",
    "many",
    "then",
    "them",
    "these",
    "so",
    "some",
    "her",
    "would",
    "make",
    "like",
    "him",
    "into",
    "time",
    "has",
    "look",
    "two",
    "more",
    "write",
    "go",
    "see",
    "number",
    "no",
    "way",
    "could",
    "people",
    "my",
    "than",
    "first",
    "water",
    "been",
    "call",
    "who",
    "oil",
    "its",
    "now",
    "find",
    "long",
    "down",
    "day",
    "did",
    "get",
    "come",
    "made",
    "may",
]


@dataclass
class BenchConfig:
    """One benchmark run.

    Attributes:
        url: the server's base URL (``http://127.0.0.1:8000``); loopback only.
        workload: ``shared-prefix``, ``multi-turn`` or ``file``.
        dataset: the JSONL file for ``file`` (lines with ``prompt`` or ``messages``,
            optional ``max_tokens``).
        num_prompts: requests at most.
        request_rate: requests per second (Poisson arrivals); ``inf`` sends at once.
        max_concurrency: requests in flight at most (``None``: unbounded).
        time_limit: seconds; then nothing new is sent and in-flight requests are cancelled.
        max_tokens: output tokens per request.
        groups, prompts_per_group, system_words, question_words: shared-prefix shape.
        conversations, turns, first_words, message_words: multi-turn shape.
        shared_system_words: multi-turn: every conversation opens with one system
            message of this many words, the same for all (0: none).
        seed: seeds prompts and arrivals.
        model: the model id to send (default: the server's first model).
        endpoint: ``completions`` or ``chat``.
        api_key: sent as ``Authorization: Bearer`` (a server started with ``--api-key``).
        cache_keys: shared-prefix: each group is a tenant that sends its own
            ``prompt_cache_key`` (``tenant-<group>``).

    The built-in workloads' prompt sizes left at their defaults are shrunk to fit the
    server's ``max_model_len`` (`fit_to_server`); sizes given explicitly that cannot fit
    are refused before anything is sent.
    """

    url: str = "http://127.0.0.1:8000"
    workload: str = "shared-prefix"
    dataset: str | None = None
    num_prompts: int = 64
    request_rate: float = math.inf
    max_concurrency: int | None = 8
    time_limit: float = 600.0
    max_tokens: int = 32
    groups: int = 8
    prompts_per_group: int = 8
    system_words: int = 1000
    question_words: int = 24
    conversations: int = 8
    turns: int = 4
    first_words: int = 200
    message_words: int = 24
    shared_system_words: int = 0
    seed: int = 0
    model: str | None = None
    endpoint: str = "completions"
    api_key: str | None = None
    cache_keys: bool = False

    def __post_init__(self) -> None:
        check_loopback(self.url)
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {self.workload!r}")
        if self.workload == "file" and not self.dataset:
            raise ValueError("workload 'file' needs a dataset path")
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be completions or chat, got {self.endpoint!r}")
        for name in ("num_prompts", "max_tokens", "groups", "prompts_per_group", "turns",
                     "conversations", "system_words", "question_words", "first_words",
                     "message_words"):  # fmt: skip
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        n = self.shared_system_words
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"shared_system_words must be an int >= 0, got {n!r}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not 0 < self.time_limit < math.inf:
            raise ValueError(
                f"time_limit must be a positive number of seconds, got {self.time_limit}"
            )


SIZE_FIELDS = {  # per workload: the word counts fit_to_server may shrink (the first)
    "shared-prefix": ("system_words", "question_words"),
    "multi-turn": ("first_words", "message_words"),
}
TEMPLATE_TOKENS = 32  # a chat template's and a prompt's own framing, at most (a margin)
FIT_MARGIN = 0.8
PROBE_WORDS = 32  # small enough for any context (~200 tokens under a byte tokenizer)


def longest_prompt_words(cfg: BenchConfig) -> LongestPrompt:
    """(words, output tokens carried) of the longest prompt the workload sends: a
    multi-turn conversation's last turn carries its earlier messages and answers."""
    if cfg.workload == "shared-prefix":
        return LongestPrompt(cfg.system_words + cfg.question_words + 4, 0)
    turns = min(cfg.turns, cfg.num_prompts)
    words = cfg.shared_system_words + cfg.first_words + (turns - 1) * cfg.message_words
    return LongestPrompt(words + 4 * turns, (turns - 1) * cfg.max_tokens)


def fit_to_server(cfg: BenchConfig, max_model_len: int, tokens_per_word: float) -> BenchConfig:
    """``cfg`` with its default prompt sizes shrunk so that the longest prompt plus its
    output fits ``max_model_len`` (the server's, from ``/v1/models``).

    Raises:
        ValueError: it cannot fit (sizes given explicitly, or too little room even for
            the smallest prompt); the message says by how much.
    """
    if cfg.workload not in SIZE_FIELDS:
        return cfg
    # words differ in length: keep FIT_MARGIN of the room for the sampled average
    room = (max_model_len - cfg.max_tokens - TEMPLATE_TOKENS) * FIT_MARGIN

    def need(c: BenchConfig) -> float:
        words, carried = longest_prompt_words(c)
        return words * tokens_per_word + carried

    big = SIZE_FIELDS[cfg.workload][0]
    if getattr(cfg, big) != BenchConfig.__dataclass_fields__[big].default:
        # given explicitly: kept unless the estimate alone, without the margin, overflows
        if need(cfg) <= max_model_len - cfg.max_tokens:
            return cfg
        raise ValueError(
            f"{big}={getattr(cfg, big)}: the longest prompt is ~{need(cfg):.0f} tokens, and "
            f"with max_tokens={cfg.max_tokens} it does not fit the server's "
            f"max_model_len={max_model_len}"
        )
    if need(cfg) <= room:
        return cfg
    fitted = cfg
    for words in range(getattr(cfg, big), 0, -1):  # shrink the long part first
        fitted = replace(cfg, **{big: words})
        if need(fitted) <= room:
            return fitted
    raise ValueError(
        f"even a 1-word {big} gives a ~{need(fitted):.0f}-token prompt: with "
        f"max_tokens={cfg.max_tokens} nothing fits the server's max_model_len={max_model_len}"
    )


async def tokens_per_word(http: httpx.AsyncClient, cfg: BenchConfig, model: str) -> float:
    """Prompt tokens per word of this workload's text on this server (one probe request
    of PROBE_WORDS words; a byte tokenizer gives ~6, a BPE ~1.3)."""
    text = _words(random.Random(cfg.seed), PROBE_WORDS)
    r = await http.post(cfg.url.rstrip("/") + "/v1/completions",
                        json={"model": model, "prompt": text, "max_tokens": 1})  # fmt: skip
    if r.status_code != 200:
        raise ValueError(f"the probe request failed: HTTP {r.status_code} {r.text[:200]}")
    return r.json()["usage"]["prompt_tokens"] / PROBE_WORDS


def check_loopback(url: str) -> None:
    """Refuse any URL whose host is not a loopback address (load goes nowhere else)."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"url must look like http://127.0.0.1:8000, got {url!r}")
    host = parsed.hostname
    if host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"url: {host} is not a loopback address; bench-serve only loads loopback")


# --- workloads ---------------------------------------------------------------------------
@dataclass
class Item:
    """One request to send: a prompt (text) or chat messages, and its conversation."""

    prompt: str | list[dict]
    max_tokens: int
    conversation: int = -1  # multi-turn: requests of one conversation run in order
    turn: int = 0
    cache_key: str | None = None  # its prompt_cache_key (a tenant's)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def shared_prefix_items(cfg: BenchConfig) -> list[Item]:
    rng = random.Random(cfg.seed)
    systems = [f"You are assistant {g}. {_words(rng, cfg.system_words)}" for g in range(cfg.groups)]

    def key(g: int) -> str | None:
        return f"tenant-{g}" if cfg.cache_keys else None

    items = [
        Item(
            f"{systems[g]}\nQuestion {g}.{i}: {_words(rng, cfg.question_words)}?",
            cfg.max_tokens,
            cache_key=key(g),
        )
        for g in range(cfg.groups)
        for i in range(cfg.prompts_per_group)
    ]
    rng.shuffle(items)
    return items[: cfg.num_prompts]


def multi_turn_items(cfg: BenchConfig) -> list[Item]:
    """The first message of each turn; the history (earlier prompts and the server's
    answers) is prepended when the turn is sent."""
    rng = random.Random(cfg.seed)
    items = []
    for c in range(cfg.conversations):
        for t in range(cfg.turns):
            n = cfg.first_words if t == 0 else cfg.message_words
            items.append(Item(f"User {c}, turn {t}: {_words(rng, n)}", cfg.max_tokens, c, t))
    items.sort(key=lambda it: (it.turn, it.conversation))
    return items[: cfg.num_prompts]


def shared_system(cfg: BenchConfig) -> list[dict]:
    """The system message every multi-turn conversation opens with (none: [])."""
    if not cfg.shared_system_words:
        return []
    words = _words(random.Random(cfg.seed + 1), cfg.shared_system_words)
    return [{"role": "system", "content": f"You are a helpful assistant. {words}"}]


def file_items(cfg: BenchConfig) -> list[Item]:
    assert cfg.dataset is not None
    items = []
    with open(cfg.dataset, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                prompt = rec["messages"] if "messages" in rec else rec["prompt"]
                if not isinstance(prompt, (str, list)) or not prompt:
                    raise ValueError("prompt must be a non-empty string (or messages a list)")
                max_tokens = rec.get("max_tokens", cfg.max_tokens)
                if (
                    isinstance(max_tokens, bool)
                    or not isinstance(max_tokens, int)
                    or max_tokens < 1
                ):
                    raise ValueError("max_tokens must be a positive integer")
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{cfg.dataset}:{n}: {e}") from None
            items.append(Item(prompt, max_tokens))
            if len(items) == cfg.num_prompts:
                break
    if not items:
        raise ValueError(f"{cfg.dataset}: no prompts")
    return items


ITEMS: dict[str, Callable[[BenchConfig], list[Item]]] = {
    "shared-prefix": shared_prefix_items,
    "multi-turn": multi_turn_items,
    "file": file_items,
}


# --- one request -------------------------------------------------------------------------
@dataclass
class Result:
    ok: bool
    worker: str = ""  # the worker a radixkv router sent it to (x-radixkv-worker)
    cache_key: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft: float = math.nan
    itl: list[float] = field(default_factory=list)
    e2e: float = math.nan
    text: str = ""
    error: str = ""


async def send(
    http: httpx.AsyncClient,
    cfg: BenchConfig,
    model: str,
    prompt: Any,
    max_tokens: int,
    cache_key: str | None = None,
) -> Result:
    chat = cfg.endpoint == "chat" or isinstance(prompt, list)
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        body["messages"] = (
            prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        )
    else:
        body["prompt"] = prompt
    if cache_key is not None:
        body["prompt_cache_key"] = cache_key
    path = "/v1/chat/completions" if chat else "/v1/completions"
    start = time.perf_counter()
    last = None
    res = Result(ok=False, cache_key=cache_key)
    parts = []
    done = False  # a stream is whole only when it ends with [DONE]
    try:
        async with http.stream("POST", cfg.url.rstrip("/") + path, json=body) as r:
            res.worker = r.headers.get("x-radixkv-worker", "")
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if data.get("error"):  # an error event (a router's: the worker broke off)
                    res.error = f"error event: {data['error'].get('message', data['error'])}"
                    return res
                now = time.perf_counter()
                if data.get("usage"):
                    u = data["usage"]
                    res.prompt_tokens = u["prompt_tokens"]
                    res.output_tokens = u["completion_tokens"]
                    res.cached_tokens = (u.get("prompt_tokens_details") or {}).get(
                        "cached_tokens", 0
                    )
                for choice in data.get("choices", []):
                    if chat:
                        text = choice.get("delta", {}).get("content") or ""
                    else:
                        text = choice.get("text") or ""
                    parts.append(text)
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        if not done:
            res.error = "the stream ended without [DONE]"
            return res
        res.e2e = time.perf_counter() - start
        res.text, res.ok = "".join(parts), True
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


# --- the run -----------------------------------------------------------------------------
def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"radixkv:(prefix_cache_(?:queries|hits)_total)\{[^}]*\} ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def percentiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(x for x in xs if not math.isnan(x))
    if not xs:
        return {"p50": math.nan, "p90": math.nan, "p99": math.nan, "mean": math.nan}

    def q(p: float) -> float:
        return xs[min(len(xs) - 1, max(0, math.ceil(p * len(xs)) - 1))]

    return {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "mean": statistics.fmean(xs)}


async def run_bench(
    cfg: BenchConfig, progress: Callable[[int, int], None] | None = None
) -> dict[str, Any]:
    """Run the benchmark; returns the report (see `format_report`)."""
    rng = random.Random(cfg.seed + 1)
    limits = httpx.Limits(max_connections=cfg.max_concurrency or 1000)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(cfg.time_limit), limits=limits, headers=headers
    ) as http:
        listed = await http.get(cfg.url.rstrip("/") + "/v1/models")
        if listed.status_code != 200:
            raise ValueError(f"GET /v1/models: HTTP {listed.status_code} {listed.text[:200]}")
        card = listed.json()["data"][0]
        model = cfg.model or card["id"]
        if card.get("max_model_len") and cfg.workload in SIZE_FIELDS:
            cfg = fit_to_server(cfg, card["max_model_len"], await tokens_per_word(http, cfg, model))
        items = ITEMS[cfg.workload](cfg)
        before = parse_metrics((await http.get(cfg.url.rstrip("/") + "/metrics")).text)
        gate = asyncio.Semaphore(cfg.max_concurrency or len(items))
        histories: dict[int, list[dict]] = {}
        system = shared_system(cfg)
        turn_done: dict[tuple[int, int], asyncio.Event] = {}
        results: list[Result | None] = [None] * len(items)
        done = 0

        async def one(i: int, item: Item) -> None:
            nonlocal done
            prompt: Any = item.prompt
            if item.conversation >= 0:  # wait for the conversation's previous turn
                if item.turn:
                    await turn_done[(item.conversation, item.turn - 1)].wait()
                history = histories.setdefault(item.conversation, system)
                prompt = [*history, {"role": "user", "content": item.prompt}]
            async with gate:
                res = await send(http, cfg, model, prompt, item.max_tokens, item.cache_key)
            results[i] = res
            if item.conversation >= 0:
                histories[item.conversation] = [*prompt, {"role": "assistant", "content": res.text}]
                turn_done[(item.conversation, item.turn)].set()
            done += 1
            if progress:
                progress(done, len(items))

        for it in items:
            if it.conversation >= 0:
                turn_done[(it.conversation, it.turn)] = asyncio.Event()
        start = time.perf_counter()
        tasks = []

        async def issue() -> None:
            for i, item in enumerate(items):
                tasks.append(asyncio.ensure_future(one(i, item)))
                if cfg.request_rate != math.inf:
                    await asyncio.sleep(rng.expovariate(cfg.request_rate))

        issuer = asyncio.ensure_future(issue())
        try:
            await asyncio.wait_for(asyncio.shield(issuer), cfg.time_limit)
            remaining = cfg.time_limit - (time.perf_counter() - start)
            if tasks:
                await asyncio.wait(tasks, timeout=max(remaining, 0.001))
        except TimeoutError:
            pass
        finally:
            issuer.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(issuer, *tasks, return_exceptions=True)
        duration = time.perf_counter() - start
        after = parse_metrics((await http.get(cfg.url.rstrip("/") + "/metrics")).text)
    return report(
        cfg, model, [r for r in results if r is not None], len(items), duration, before, after
    )


def report(
    cfg: BenchConfig,
    model: str,
    results: list[Result],
    planned: int,
    duration: float,
    before: dict[str, float],
    after: dict[str, float],
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    queries = after.get("prefix_cache_queries_total", 0) - before.get(
        "prefix_cache_queries_total", 0
    )
    hits = after.get("prefix_cache_hits_total", 0) - before.get("prefix_cache_hits_total", 0)
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    return {
        "config": {k: (None if v == math.inf else v) for k, v in asdict(cfg).items()},
        "model": model,
        "requests": {
            "planned": planned,
            "completed": len(ok),
            "failed": len(results) - len(ok),
            "not_finished": planned - len(results),
        },
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": output / duration if duration else 0.0,
        "total_token_throughput": (prompt + output) / duration if duration else 0.0,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "server_hit_rate": hits / queries if queries else math.nan,
        "ttft_s": percentiles([r.ttft for r in ok]),
        "itl_s": percentiles([x for r in ok for x in r.itl]),
        "e2e_s": percentiles([r.e2e for r in ok]),
        "outputs": [r.text for r in results],
        # per prompt_cache_key: the workers its requests went to (a radixkv router's)
        "key_workers": {
            k: sorted({r.worker for r in ok if r.cache_key == k and r.worker})
            for k in sorted({r.cache_key for r in ok if r.cache_key is not None})
        },
    }


def format_report(rep: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    req = rep["requests"]
    table = Table(title=f"bench-serve: {rep['config']['workload']} on {rep['model']}")
    table.add_column("metric", overflow="fold")
    table.add_column("value", justify="right", overflow="fold")
    rows = [
        ("requests completed / failed / unfinished",
         f"{req['completed']} / {req['failed']} / {req['not_finished']}"),
        ("duration", f"{rep['duration_s']:.2f} s"),
        ("request throughput", f"{rep['request_throughput']:.2f} req/s"),
        ("output token throughput", f"{rep['output_throughput']:.1f} tok/s"),
        ("total token throughput", f"{rep['total_token_throughput']:.1f} tok/s"),
        ("prompt tokens (cached)", f"{rep['prompt_tokens']:,} ({rep['cached_tokens']:,})"),
        ("prefix-cache hit rate (server)", _num(rep["server_hit_rate"], "{:.3f}")),
    ]  # fmt: skip
    for key, name in (("ttft_s", "time to first token"), ("itl_s", "inter-token latency"),
                      ("e2e_s", "end-to-end latency")):  # fmt: skip
        p = rep[key]
        ms = " / ".join(_num(p[q] * 1e3, "{:.1f}") for q in ("p50", "p90", "p99"))
        rows.append((f"{name} p50 / p90 / p99", f"{ms} ms"))
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    for err in rep["errors"]:
        console.print(f"error: {err}", markup=False)


def _num(x: float, fmt: str) -> str:
    """A number, or a dash where there is none (no request completed)."""
    return "-" if not math.isfinite(x) else fmt.format(x)


def write_json(rep: dict[str, Any], path: str) -> None:
    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    Path(path).write_text(json.dumps(clean(rep), indent=2))
