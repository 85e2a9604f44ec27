"""Request traces for the simulator, as sequences of prefix-identifying *unit ids*.

A unit is one block (page) of tokens: 512 for Mooncake traces, ``block_size`` for token
traces. A unit id stands for the whole prefix up to and including its block, so two
requests share KV for exactly their common leading ids — the contract of Mooncake's
``hash_ids``. Token sequences are turned into ids by *interning* ``(parent id, block
tokens)``: exact (no hash collisions) and deterministic. A trailing partial block is not a
unit (engines cache whole pages only), except in Mooncake traces, which give it an id.

Owns: trace formats, their validation, and the generators. Must not touch: replaying.
"""

from __future__ import annotations

import json
import math
import random
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from radixkv.units import div_ceil

MOONCAKE_BLOCK = 512


@dataclass
class SimRequest:
    """One request of a trace.

    Attributes:
        units: unit ids of the prompt, then of the output (when known).
        num_prompt_units: leading units that lie in the prompt (what a lookup may hit).
        prompt_tokens: prompt length in tokens.
        timestamp: arrival time (ms), if the trace has one.
        output_tokens: output length in tokens.
        boundaries: unit counts where the prompt's template has a boundary a server
            knows (the end of the system message): hybrid caches checkpoint there.
        prompt_ids, output_ids: a token trace's token ids (``output_ids``: ``None``
            when it gives only their count), for the serve replay
            (`radixkv.sim.serve_replay`); ``None`` in a Mooncake trace.
        token_boundaries, extra_key: the boundaries in tokens, the cache namespace.
        session, stop, duration_ms: an agentic trace's session, why the answer stopped,
            and how long it took (`radixkv.sim.agentic`; read by `radixkv.sim.sessions`
            only once the answer has ended).
    """

    units: list[int]
    num_prompt_units: int
    prompt_tokens: int
    timestamp: float = 0.0
    output_tokens: int = 0
    boundaries: tuple[int, ...] = ()
    prompt_ids: array | None = field(default=None, repr=False)  # 8 bytes a token
    output_ids: array | None = field(default=None, repr=False)
    token_boundaries: tuple[int, ...] = ()
    extra_key: Any = None
    session: Any = None  # an agentic trace's session (conversation or sub-agent)
    stop: str = ""  # why its answer stopped: tool_use, end_turn or "" (known at its end)
    duration_ms: float = 0.0  # how long its answer took (its api_time)


@dataclass
class Trace:
    """Requests in arrival order, all with the same unit size in tokens."""

    name: str
    block_size: int
    requests: list[SimRequest] = field(default_factory=list)

    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.requests)

    def carries_outputs(self) -> bool:
        """Whether any request knows its output's tokens (a Marconi trace, a generated
        workload; a Mooncake trace gives only their count)."""
        return any(len(r.units) > r.num_prompt_units for r in self.requests)

    def cached_units(self, req: SimRequest, outputs: bool) -> int:
        """Units a request leaves cached in an engine: its prompt's, or with its output
        those of every token but the last, whose KV no engine computes (it is sampled,
        never fed back: SGLang, vLLM and radixkv's engine cache ``prompt + output - 1``
        tokens)."""
        if not outputs or not req.output_tokens:
            return req.num_prompt_units
        computed = (req.prompt_tokens + req.output_tokens - 1) // self.block_size
        return max(req.num_prompt_units, min(len(req.units), computed))

    def hit_tokens(self, req: SimRequest, hit_units: int) -> int:
        """Tokens served by ``hit_units`` leading cached units (a partial last block
        counts its own size)."""
        return min(hit_units * self.block_size, req.prompt_tokens)


class Interner:
    """Maps ``(parent id, block tokens)`` to a fresh id, the same id every time."""

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {}

    def units(self, tokens: list[int], block: int, namespace: Any = None) -> list[int]:
        """Ids of the whole blocks of ``tokens``."""
        ids = self._ids
        parent: Any = ("ns", namespace)
        out = []
        for i in range(0, len(tokens) - block + 1, block):
            k = (parent, tuple(tokens[i : i + block]))
            uid = ids.get(k)
            if uid is None:
                uid = ids[k] = len(ids)
            out.append(uid)
            parent = uid
        return out


# --- loaders -----------------------------------------------------------------------------
INT63 = 2**63  # ids and tokens are int64; ids must be >= 0 so they never meet fresh outputs
# One request's output may claim at most this many tokens (a typo such as 1e12 would
# otherwise build a list of 10^12 fresh ids).
MAX_OUTPUT_TOKENS = 1 << 20
# A prompt given as a count (Marconi's format) may claim at most this many: two million,
# beyond any model's context (one 88-byte line of 1e8 ran for 67 s and took 7.8 GB).
MAX_PROMPT_TOKENS = 1 << 21
MAX_LINE_BYTES = 256 << 20  # one JSONL record: a line read whole
# what one token of a trace costs in memory while it loads (its int, the list slot, the
# interner's tuple of its block): the trace's total is checked against the machine's
TOKEN_BYTES = 100


class TraceError(ValueError):
    """A trace that cannot be replayed; the message starts with ``FILE:LINE:``."""


def json_int(value: Any, what: str, lo: int = 0, hi: int = INT63) -> int:
    """A JSON integer in ``[lo, hi)``: never a bool, a float (``1.7`` or ``1e308``) or a
    string, which ``int()`` would truncate or parse."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an integer, got {json.dumps(value)[:40]}")
    if not lo <= value < hi:
        raise ValueError(f"{what} must be in [{lo}, {hi}), got {value}")
    return value


def json_ints(value: Any, what: str) -> list[int]:
    if not isinstance(value, list):
        raise ValueError(f"{what} must be a list of integers, got {json.dumps(value)[:40]}")
    return [json_int(v, f"{what}[{i}]") for i, v in enumerate(value)]


def _timestamp(rec: dict) -> float:
    t = rec.get("timestamp", 0)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        raise ValueError(f"timestamp must be a finite number, got {json.dumps(t)[:40]}")
    return float(t)


class Tally:
    """The tokens a trace materialises as it loads, against half of what this machine
    has available: a trace whose sizes claim more is refused at the line that crosses
    it, before that line's lists are built where their sizes are counts."""

    def __init__(self) -> None:
        from radixkv.engine.machine import available_bytes

        self.tokens, self.have = 0, available_bytes("cpu")

    def add(self, n: int) -> None:
        """Count ``n`` more tokens.

        Raises:
            ValueError: the total would take more than half the memory available.
        """
        self.tokens += n
        if self.have is not None and self.tokens * TOKEN_BYTES > self.have // 2:
            raise ValueError(f"the trace holds {self.tokens:,} tokens by this line, about "
                             f"{self.tokens * TOKEN_BYTES / 2**30:,.1f} GiB loaded, more than "
                             f"half of the {self.have / 2**30:,.1f} GiB this machine has "
                             "available")  # fmt: skip


def _lines(f: Any) -> Iterator[str]:
    """The file's lines, each read up to `MAX_LINE_BYTES` (a longer one is refused)."""
    while True:
        line = f.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        if len(line) > MAX_LINE_BYTES:
            raise ValueError(f"a line over {MAX_LINE_BYTES:,} characters")
        yield line


def json_object(text: str | bytes, where: str) -> dict:
    """``text`` parsed as one JSON object.

    Raises:
        TraceError: ``WHERE: what is wrong`` (not JSON, nested too deeply, not an object).
    """
    try:
        rec = json.loads(text)
    except RecursionError:
        raise TraceError(f"{where}: JSON nested too deeply") from None
    except ValueError as e:
        raise TraceError(f"{where}: not JSON ({e})") from None
    if not isinstance(rec, dict):
        shown = text[:40] if isinstance(text, str) else text[:40].decode(errors="replace")
        raise TraceError(f"{where}: expected a JSON object, got {shown.strip()}")
    return rec


def read_records(path: str | Path) -> Iterator[tuple[int, dict]]:
    """(line number, JSON object) for every non-blank line; a ``TraceError`` naming the
    file and line for anything else, and for a trace with no request at all."""
    seen = False
    with open(path, encoding="utf-8") as f:
        n = 0
        lines = _lines(f)
        while True:
            n += 1
            try:
                line = next(lines, None)
            except ValueError as e:
                raise TraceError(f"{path}:{n}: {e}") from None
            if line is None:
                break
            if not line.strip():
                continue
            rec = json_object(line, f"{path}:{n}")
            seen = True
            yield n, rec
    if not seen:
        raise TraceError(f"{path}: the trace has no requests")


def load_mooncake(path: str | Path) -> Trace:
    """A Mooncake JSONL trace: ``timestamp``, ``input_length``, ``output_length``,
    ``hash_ids`` (one id per 512-token block of the input, the last one partial).

    Raises:
        TraceError: ``FILE:LINE: what is wrong`` for the first bad record.
    """
    trace = Trace(Path(path).stem, MOONCAKE_BLOCK)
    tally = Tally()
    for n, rec in read_records(path):
        try:
            if "hash_ids" not in rec or "input_length" not in rec:
                raise ValueError("a Mooncake record needs hash_ids and input_length")
            ids = json_ints(rec["hash_ids"], "hash_ids")
            length = json_int(rec["input_length"], "input_length", 1)
            if len(ids) != div_ceil(length, MOONCAKE_BLOCK):
                raise ValueError(
                    f"input_length {length} needs {div_ceil(length, MOONCAKE_BLOCK)} hash_ids "
                    f"(one per {MOONCAKE_BLOCK} tokens), got {len(ids)}"
                )
            output = 0
            if "output_length" in rec:
                output = json_int(rec["output_length"], "output_length", 0, MAX_OUTPUT_TOKENS + 1)
            stamp = _timestamp(rec)
            tally.add(len(ids))
        except ValueError as e:
            raise TraceError(f"{path}:{n}: {e}") from None
        trace.requests.append(SimRequest(ids, len(ids), length, stamp, output))
    return trace


def split_blocks(trace: Trace, block_size: int) -> Trace:
    """A Mooncake trace with its 512-token blocks cut into pages of ``block_size`` tokens
    (a divisor of 512): hybrid caches hit and checkpoint at page granularity, finer than
    Mooncake's blocks. Page ``j`` of the block with id ``h`` gets id ``h * k + j`` (``k``
    pages a block), which again stands for the whole prefix up to its end; a partial last
    block gets as many pages as it has tokens for (the last one partial, as Mooncake's).

    Raises:
        ValueError: ``block_size`` does not divide the trace's block.
    """
    if trace.block_size % block_size:
        raise ValueError(f"block_size: {block_size} does not divide {trace.block_size}")
    k = trace.block_size // block_size
    from radixkv.engine.machine import available_bytes

    units, have = sum(len(r.units) for r in trace.requests) * k, available_bytes("cpu")
    if have is not None and units * TOKEN_BYTES > have:
        raise ValueError(f"block_size: {block_size}-token pages make {units:,} units of this "
                         f"trace, about {units * TOKEN_BYTES / 2**30:,.1f} GiB, more than "
                         f"the {have / 2**30:,.1f} GiB available")  # fmt: skip
    out = Trace(trace.name, block_size)
    for r in trace.requests:
        last = r.prompt_tokens - (len(r.units) - 1) * trace.block_size
        units = [h * k + j for h in r.units[:-1] for j in range(k)]
        if r.units:
            units += [r.units[-1] * k + j for j in range(div_ceil(last, block_size))]
        out.requests.append(
            SimRequest(
                units,
                len(units),
                r.prompt_tokens,
                r.timestamp,
                r.output_tokens,
                tuple(b * k for b in r.boundaries),
            )
        )
    return out


def load_token_jsonl(path: str | Path, block_size: int, tokenizer: Any = None) -> Trace:
    """One request per line: ``token_ids`` (or ``text`` with a ``tokenizer`` that has
    ``encode``), optional ``output_ids`` or ``output_length``, ``extra_key``,
    ``timestamp``, ``boundaries`` (token positions in the prompt a template marks: the
    end of the system message). Unknown outputs become fresh tokens (they match nothing).

    Raises:
        TraceError: ``FILE:LINE: what is wrong`` for the first bad record.
    """
    records = []
    tally = Tally()
    for n, rec in read_records(path):
        try:
            if "token_ids" in rec:
                prompt = json_ints(rec["token_ids"], "token_ids")
            elif "text" in rec:
                if not isinstance(rec["text"], str):
                    raise ValueError("text must be a string")
                if tokenizer is None:
                    raise ValueError("a text record needs --tokenizer (byte, smollm2 or a file)")
                prompt = list(tokenizer.encode(rec["text"]))
            else:
                raise ValueError("needs token_ids (or text and a tokenizer)")
            if not prompt:
                raise ValueError("the prompt is empty")
            out = dict(rec)
            if rec.get("output_ids") is not None:
                out["output_ids"] = json_ints(rec["output_ids"], "output_ids")
            elif "output_length" in rec:
                json_int(rec["output_length"], "output_length", 0, MAX_OUTPUT_TOKENS + 1)
            if "boundaries" in rec:
                out["boundaries"] = json_ints(rec["boundaries"], "boundaries")
                if any(b > len(prompt) for b in out["boundaries"]):
                    raise ValueError("boundaries must lie within the prompt")
            ns = rec.get("extra_key")
            if ns is not None and not isinstance(ns, (str, int)):
                raise ValueError(f"extra_key must be a string or integer, got {json.dumps(ns)}")
            out["timestamp"] = _timestamp(rec)
            outputs = out.get("output_ids")
            tally.add(len(prompt) + (len(outputs) if outputs is not None
                                     else int(out.get("output_length", 0))))  # fmt: skip
        except ValueError as e:
            raise TraceError(f"{path}:{n}: {e}") from None
        records.append((prompt, out))
    return from_tokens(Path(path).stem, records, block_size)


def load_marconi(path: str | Path, block_size: int) -> Trace:
    """A token-level multi-turn trace in the format Marconi (MLSys 2025) published: one
    turn per line, ``session_id``, ``turn_id``, ``ts`` (seconds), ``input_tokens`` and
    ``output_tokens``, each a list of token ids or a count. A count stands for a
    conversation's history: turn ``k``'s prompt is the session's previous prompt, its
    output, then fresh tokens up to the count (a first turn is all fresh); an output
    count is fresh tokens. Turns are replayed in ``ts`` order (then ``turn_id``).

    Raises:
        TraceError: ``FILE:LINE: what is wrong`` for the first bad record (a count
            shorter than the session's history, turns of a session out of order).
    """
    rows = []
    history: dict[Any, tuple[int, list[int]]] = {}  # session -> (turn, prompt + output)
    fresh = -1
    tally = Tally()
    for n, rec in read_records(path):
        try:
            for k in ("session_id", "turn_id", "ts", "input_tokens", "output_tokens"):
                if k not in rec:
                    raise ValueError(f"a Marconi record needs {k}")
            sid = rec["session_id"]
            if not isinstance(sid, (str, int)) or isinstance(sid, bool):
                raise ValueError("session_id must be a string or integer")
            turn = json_int(rec["turn_id"], "turn_id")
            ts = _timestamp({"timestamp": rec["ts"]})
            prev_turn, past = history.get(sid, (-1, []))
            if turn <= prev_turn:
                raise ValueError(f"session {sid!r}: turn {turn} after turn {prev_turn}")
            inp = rec["input_tokens"]
            if isinstance(inp, list):
                prompt = json_ints(inp, "input_tokens")
            else:
                count = json_int(inp, "input_tokens", 1, MAX_PROMPT_TOKENS + 1)
                if count < len(past):
                    raise ValueError(
                        f"input_tokens {count} is shorter than session {sid!r}'s history "
                        f"({len(past)} tokens)"
                    )
                tally.add(2 * count)  # before it is built: the turn and the history
                prompt = past + list(range(fresh, fresh - (count - len(past)), -1))
                fresh -= count - len(past)
            if not prompt:
                raise ValueError("the prompt is empty")
            outp = rec["output_tokens"]
            if isinstance(outp, list):
                output = json_ints(outp, "output_tokens")
            else:
                count = json_int(outp, "output_tokens", 0, MAX_OUTPUT_TOKENS + 1)
                tally.add(2 * count)
                output = list(range(fresh, fresh - count, -1))
                fresh -= count
            listed = (len(prompt) if isinstance(inp, list) else 0) + (
                len(output) if isinstance(outp, list) else 0
            )
            tally.add(2 * listed)  # ids the line lists: counted once built
        except ValueError as e:
            raise TraceError(f"{path}:{n}: {e}") from None
        history[sid] = (turn, prompt + output)
        rows.append((ts, turn, n, prompt, {"output_ids": output, "timestamp": ts * 1000}))
    rows.sort(key=lambda r: r[:3])
    return from_tokens(Path(path).stem, [(r[3], r[4]) for r in rows], block_size)


def guess_format(path: str | Path) -> str:
    """``mooncake`` when the first record carries ``hash_ids``, ``marconi`` when it
    carries ``session_id``, else ``tokens``."""
    with open(path, encoding="utf-8") as f:
        first = next((line for line in f if line.strip()), "")
    if "hash_ids" in first:
        return "mooncake"
    return "marconi" if "session_id" in first else "tokens"


def load_trace(
    path: str | Path, fmt: str | None = None, block_size: int | None = None, tokenizer: Any = None
) -> Trace:
    """A trace file in either format (``None``: guessed from the first line); token traces
    cut into pages of ``block_size`` tokens (16 by default).

    Raises:
        TraceError: a bad record. ValueError: ``block_size: ...`` for a Mooncake trace
            given another block size; FolderError (a ValueError): not a regular file.
            OSError, UnicodeDecodeError: an unreadable file.
    """
    from radixkv.checkpoint.files import regular_file

    regular_file(Path(path))  # a FIFO would block the open; a device never ends
    fmt = fmt or guess_format(path)
    if fmt == "mooncake":
        if block_size not in (None, MOONCAKE_BLOCK):
            raise ValueError(
                f"block_size: Mooncake traces have {MOONCAKE_BLOCK}-token blocks (their "
                f"hash_ids fix it), got {block_size}"
            )
        return load_mooncake(path)
    if fmt == "marconi":
        return load_marconi(path, block_size or 16)
    return load_token_jsonl(path, block_size or 16, tokenizer)


def from_tokens(name: str, records: list[tuple[list[int], dict]], block: int) -> Trace:
    interner, trace = Interner(), Trace(name, block)
    fresh = -1  # output tokens nobody else has: negative ids never collide with prompts
    for prompt, rec in records:
        known = rec.get("output_ids")
        output = known
        if output is None:
            output = list(range(fresh, fresh - int(rec.get("output_length", 0)), -1))
            fresh -= len(output)
        ns = rec.get("extra_key")
        units = interner.units(prompt + list(output), block, ns)
        n_prompt = len(prompt) // block
        tokens = tuple(sorted(set(rec.get("boundaries", ()))))
        marks = tuple(sorted({b // block for b in tokens if b >= block}))
        trace.requests.append(
            SimRequest(
                units, n_prompt, len(prompt), float(rec.get("timestamp", 0)), len(output), marks,
                prompt_ids=array("q", prompt), token_boundaries=tokens, extra_key=ns,
                output_ids=None if known is None else array("q", known),
            )
        )  # fmt: skip
    return trace


# --- generators --------------------------------------------------------------------------
VOCAB = 32_000


def _toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def gen_shared_prefix(
    groups: int = 64,
    prompts_per_group: int = 16,
    system_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
    block_size: int = 16,
    seed: int = 0,
) -> Trace:
    """SGLang's generated-shared-prefix workload: ``groups`` system prompts, each shared
    by ``prompts_per_group`` questions (the system prompt's end a template boundary);
    requests arrive in a seeded random order."""
    rng = random.Random(seed)
    records = []
    for _ in range(groups):
        system = _toks(rng, system_len)
        for _ in range(prompts_per_group):
            rec = {"output_length": output_len, "boundaries": [system_len]}
            records.append((system + _toks(rng, question_len), rec))
    rng.shuffle(records)
    return from_tokens("shared-prefix", records, block_size)


def _interleave(queues: list[list], rng: random.Random) -> list:
    """Pop from the front of a random queue until all are empty: conversations whose
    turns arrive interleaved, each in its own order. Each record's ``timestamp`` (ms) is
    its wave: requests with one timestamp arrive together (`radixkv.sim.serve_replay`,
    ``--schedule lpm``), so a turn never shares a wave with its conversation's previous
    turn, whose answer it carries (the earliest wave after it, in the queues' order)."""
    records = []
    wave, last = 0, {}  # the wave now; each conversation's last wave
    while queues:
        q = queues[rng.randrange(len(queues))]
        wave = max(wave, last.get(id(q), -1) + 1)
        last[id(q)] = wave
        prompt, rec = q.pop(0)
        records.append((prompt, {**rec, "timestamp": wave}))
        if not q:
            queues.remove(q)
    return records


def gen_multi_turn(
    conversations: int = 128,
    turns: int = 6,
    first_len: int = 512,
    message_len: int = 128,
    output_len: int = 256,
    block_size: int = 16,
    seed: int = 0,
) -> Trace:
    """Chats: each turn's prompt is the whole history (earlier prompts and answers) plus
    a new message; turns of different conversations interleave at random."""
    rng = random.Random(seed)
    queues = []
    for _ in range(conversations):
        history, turns_out = _toks(rng, first_len), []
        for _ in range(turns):
            answer = _toks(rng, output_len)
            turns_out.append((list(history), {"output_ids": answer}))
            history = history + answer + _toks(rng, message_len)
        queues.append(turns_out)
    records = _interleave(queues, rng)
    return from_tokens("multi-turn", records, block_size)


def gen_few_shot(
    requests: int = 1000,
    pool: int = 32,
    shots: int = 4,
    example_len: int = 256,
    question_len: int = 64,
    output_len: int = 64,
    block_size: int = 16,
    seed: int = 0,
) -> Trace:
    """Few-shot prompts: an instruction, ``shots`` examples drawn from a pool (order
    matters: only a shared *leading* run of examples is a shared prefix), a question."""
    rng = random.Random(seed)
    instruction = _toks(rng, 64)
    examples = [_toks(rng, example_len) for _ in range(pool)]
    records = []
    for _ in range(requests):
        picks = sorted(rng.sample(range(pool), shots))
        prompt = instruction + [t for i in picks for t in examples[i]] + _toks(rng, question_len)
        records.append((prompt, {"output_length": output_len}))
    return from_tokens("few-shot", records, block_size)


def gen_chat(
    conversations: int = 128,
    turns: int = 6,
    systems: int = 4,
    system_len: int = 1024,
    message_len: int = 192,
    output_len: int = 256,
    block_size: int = 16,
    seed: int = 0,
) -> Trace:
    """Multi-turn chat behind a few system prompts: each conversation starts with one of
    ``systems`` system messages (``system_len`` tokens, its end a template boundary),
    then user messages and answers; every turn's prompt is the whole history plus a new
    message; turns of different conversations interleave at random."""
    rng = random.Random(seed)
    prompts = [_toks(rng, system_len) for _ in range(systems)]
    queues = []
    for _ in range(conversations):
        history = prompts[rng.randrange(systems)] + _toks(rng, message_len)
        turns_out = []
        for _ in range(turns):
            answer = _toks(rng, output_len)
            rec = {"output_ids": answer, "boundaries": [system_len]}
            turns_out.append((list(history), rec))
            history = history + answer + _toks(rng, message_len)
        queues.append(turns_out)
    records = _interleave(queues, rng)
    return from_tokens("chat", records, block_size)


GENERATORS = {
    "shared-prefix": gen_shared_prefix,
    "multi-turn": gen_multi_turn,
    "few-shot": gen_few_shot,
    "chat": gen_chat,
}
