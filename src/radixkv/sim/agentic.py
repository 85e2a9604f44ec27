"""Agentic traces: kv-cache-tester's recorded Claude Code sessions (github
callanjfox/kv-cache-tester) as a `Trace`, for `radixkv simulate --format agentic`.

A trace file is one conversation, JSON (plain or gzipped): ``block_size`` (64),
``hash_id_scope`` (``local``: ids compare only within the file, sub-agents sharing the
parent's), ``tool_tokens`` and ``system_tokens`` (the prefix every call opens with),
``requests``: each a model call (``t`` seconds since the conversation started, ``in`` and
``out`` tokens, ``hash_ids`` one per whole ``block_size`` tokens of the input (a partial
last block is taken too), each naming the whole prefix up to its block, ``api_time``,
``think_time``, ``stop``: ``tool_use`` or ``end_turn``) or ``{"type": "subagent",
"requests": [...]}``, a sub-agent that runs its own calls while the parent waits.

How a folder of them becomes one trace:

* **sessions**: every conversation, and every sub-agent in it, is a session of its own;
  a call's units are its ``hash_ids`` scoped to its file (two files never share a
  unit; a parent and its sub-agents do, as the file scopes them);
* **drawn** (``sessions``, ``seed``, ``span``): that many conversations, without
  replacement, each starting at a uniform random time within ``span`` seconds;
* **closed loop**: a session's first call starts at its ``t``; each later one
  ``think_time`` after the previous answer ends, which takes its ``api_time`` (a
  sub-agent starts at its first call's ``t``, from its conversation's start);
* **warm prefix** (``warm_prefix`` P in [0, 1]): the first P of ``tool_tokens +
  system_tokens`` (whole blocks) is one prefix every session shares, as the
  kv-cache-tester client models a fleet's warm system prompt;
* **a context limit** (``max_context`` N tokens, as the client's ``--max-context``):
  only conversations whose first call fits are drawn, and each session (a sub-agent's
  too) ends before its first call over N;
* **recycled** (``recycle``, as the client's ``--recycle``): the draw is with
  replacement, each draw a session of its own (the client replays a trace with new text
  behind the warm prefix: no unit in common with another draw of the same file).

Records are checked, not trusted (`radixkv.sim.traces.TraceError`, naming the file and
the field): times finite and >= 0, sizes ints in range, ``hash_ids`` one per block of
``in`` (at most `MAX_BLOCKS`), sub-agents nested at most `MAX_DEPTH` deep, a file at most
`MAX_FILE_BYTES` once decompressed, and fields the format does not define refused by name.

Owns: reading agentic traces into a `Trace`. Must not touch: the replay (`radixkv.sim`'s
sweeps read the trace as any other).
"""

from __future__ import annotations

import gzip
import json
import math
import random
from pathlib import Path

from radixkv.sim.traces import SimRequest, Tally, Trace, TraceError, json_int, json_object
from radixkv.units import div_ceil

MAX_FILE_BYTES = 64 << 20  # a conversation file, decompressed (the largest shared: 4 MB)
MAX_BLOCKS = 1 << 16  # hash ids of one call: 4M tokens of 64-token blocks
MAX_DEPTH = 8  # sub-agents within sub-agents
MAX_SESSIONS = 1 << 20  # drawn (with --recycle, more than the files): bounded up front
MAX_SECONDS = 1e9  # any time, in seconds (about 30 years)
TOP = {"id", "models", "block_size", "hash_id_scope", "tool_tokens", "system_tokens",
       "requests", "totals"}  # fmt: skip
CALL = {"t", "type", "model", "in", "out", "hash_ids", "input_types", "output_types",
        "stop", "think_time", "api_time", "ttft"}  # fmt: skip
SUBAGENT = {"t", "type", "agent_id", "subagent_type", "duration_ms", "total_tokens",
            "tool_use_count", "status", "requests", "models", "tool_tokens",
            "system_tokens"}  # fmt: skip
STOPS = ("tool_use", "end_turn", "")
WARM = -1  # the namespace of the warm prefix's units


def looks_agentic(path: str | Path) -> bool:
    """A folder, a ``.json.gz`` file, or a ``.json`` file whose first 4 KiB name an
    agentic trace's keys (a JSONL trace may be called ``.json`` too)."""
    p = Path(path)
    if p.is_dir() or p.name.endswith(".json.gz"):
        return True
    if not p.name.endswith(".json") or not p.is_file():
        return False
    try:
        with open(p, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return b'"hash_id_scope"' in head or b'"requests"' in head


def trace_files(path: str | Path) -> list[Path]:
    """The trace files a path names: the file, or a folder's ``*.json`` and ``*.json.gz``
    (sorted).

    Raises:
        TraceError: a folder with none, or a path that is neither.
    """
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.name.endswith((".json", ".json.gz")))
        if not files:
            raise TraceError(f"{p}: no agentic trace (*.json, *.json.gz) in the folder")
        return files
    if p.is_file():
        return [p]
    raise TraceError(f"{p}: not a file or a folder")


def read_conversation(path: Path) -> dict:
    """One trace file's JSON object, read within `MAX_FILE_BYTES`.

    Raises:
        TraceError: too large, not JSON, nested too deeply, not an object.
    """
    from radixkv.checkpoint.files import regular_file

    regular_file(path)
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except (OSError, EOFError) as e:
        raise TraceError(f"{path}: cannot read it ({e})") from None
    if len(data) > MAX_FILE_BYTES:
        raise TraceError(f"{path}: over {MAX_FILE_BYTES >> 20} MiB of JSON")
    return json_object(data, str(path))


def _seconds(rec: dict, name: str, default: float | None = None) -> float:
    value = rec.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and 0 <= value <= MAX_SECONDS):  # fmt: skip
        raise ValueError(f"{name} must be a number of seconds in [0, {MAX_SECONDS:g}], got "
                         f"{json.dumps(value)[:40]}")  # fmt: skip
    return float(value)


def _unknown(rec: dict, known: set[str], what: str) -> None:
    extra = sorted(set(rec) - known)
    if extra:
        raise ValueError(f"{what} has a field the format does not define: {extra[0]!r}")


class _Reader:
    """Turns conversations into sessions of calls (see the module docstring)."""

    def __init__(self, warm_prefix: float, max_context: int | None = None) -> None:
        self.warm_prefix, self.max_context = warm_prefix, max_context
        self.units: dict[tuple[int, int], int] = {}  # (file, hash id) -> unit
        self.tally = Tally()
        self.block: int | None = None  # the first file's; every other must agree

    def unit(self, scope: int, hash_id: int) -> int:
        return self.units.setdefault((scope, hash_id), len(self.units))

    def conversation(self, scope: int, path: Path, doc: dict, start: float) -> list[SimRequest]:
        """Every call of one conversation (its sub-agents as sessions of their own),
        timed from ``start`` seconds."""
        try:
            _unknown(doc, TOP, "the trace")
            block = json_int(doc.get("block_size"), "block_size", 1, 1 << 20)
            if doc.get("hash_id_scope", "local") != "local":
                raise ValueError("hash_id_scope must be 'local' (ids compare within a file)")
            prefix = sum(json_int(doc.get(k, 0), k, 0, 1 << 30)
                         for k in ("tool_tokens", "system_tokens"))  # fmt: skip
            if not isinstance(doc.get("requests"), list):
                raise ValueError("requests must be a list")
        except ValueError as e:
            raise TraceError(f"{path}: {e}") from None
        if self.block is None:
            self.block = block
        if block != self.block:
            raise TraceError(f"{path}: block_size {block}, but the traces before it have "
                             f"{self.block} (one simulation, one block size)")  # fmt: skip
        warm = int(self.warm_prefix * prefix) // block
        out: list[SimRequest] = []
        self._session(scope, path, doc["requests"], start, warm, out, "requests", 0)
        return out

    def _session(
        self, scope: int, path: Path, calls: list, start: float, warm: int,
        out: list[SimRequest], where: str, depth: int,
    ) -> None:  # fmt: skip
        if depth > MAX_DEPTH:
            raise TraceError(f"{path}: {where}: sub-agents nested over {MAX_DEPTH} deep")
        clock: float | None = None  # when the previous answer ended
        for i, rec in enumerate(calls):
            at = f"{where}[{i}]"
            try:
                if not isinstance(rec, dict):
                    raise ValueError("expected an object")
                if rec.get("type") == "subagent":
                    _unknown(rec, SUBAGENT, "a sub-agent")
                    if not isinstance(rec.get("requests"), list):
                        raise ValueError("a sub-agent's requests must be a list")
                    _seconds(rec, "t", 0.0)  # (its calls carry their own t)
                else:
                    over = self.max_context is not None and _tokens_in(rec) > self.max_context
                    if over:  # the session ends here (kv-cache-tester's --max-context)
                        return
                    req, clock = self._call(scope, rec, start, clock, warm)
                    req.session = (scope, where)
                    out.append(req)
                    continue
            except ValueError as e:
                raise TraceError(f"{path}: {at}: {e}") from None
            self._session(scope, path, rec["requests"], start, warm, out,
                          f"{at}.requests", depth + 1)  # fmt: skip

    def _call(
        self, scope: int, rec: dict, start: float, clock: float | None, warm: int
    ) -> tuple[SimRequest, float]:
        _unknown(rec, CALL, "a call")
        n_in = json_int(rec.get("in"), "in", 1, MAX_BLOCKS * self.block + 1)
        n_out = json_int(rec.get("out", 0), "out", 0, 1 << 24)
        ids = rec.get("hash_ids")
        if not isinstance(ids, list):
            raise ValueError("hash_ids must be a list of integers")
        if len(ids) not in (n_in // self.block, div_ceil(n_in, self.block)):  # whole blocks
            # (the shared files), or a partial last one too (their README's wording)
            raise ValueError(f"in {n_in} needs {n_in // self.block} hash_ids (one per whole "
                             f"{self.block}-token block), got {len(ids)}")  # fmt: skip
        if rec.get("stop", "") not in STOPS:
            raise ValueError(f"stop must be one of {STOPS}, got {json.dumps(rec['stop'])[:40]}")
        api, think = _seconds(rec, "api_time", 0.0), _seconds(rec, "think_time", 0.0)
        # closed loop: the first call at its t, each next one think_time after the answer
        begin = start + _seconds(rec, "t") if clock is None else clock + think
        self.tally.add(len(ids))
        units = [self.unit(WARM if j < warm else scope, json_int(h, f"hash_ids[{j}]"))
                 for j, h in enumerate(ids)]  # fmt: skip
        req = SimRequest(units, len(units), n_in, begin * 1000.0, n_out)
        req.stop, req.duration_ms = rec.get("stop", ""), api * 1000.0
        return req, begin + api


def _tokens_in(rec: dict) -> int:
    """A call's input tokens, as the context limit reads them (checked by `_call`)."""
    n = rec.get("in")
    return n if isinstance(n, int) and not isinstance(n, bool) else 0


def _first_in(path: Path, doc: dict) -> int:
    """The input tokens of a conversation's first call (its first record that is not
    a sub-agent), as kv-cache-tester filters traces by ``--max-context``."""
    calls = doc.get("requests")
    first = next((r for r in calls if isinstance(r, dict) and r.get("type") != "subagent"),
                 None) if isinstance(calls, list) else None  # fmt: skip
    if first is None:
        raise TraceError(f"{path}: requests: no call to read the first input size of")
    return _tokens_in(first)


def load_agentic(
    path: str | Path, sessions: int | None = None, seed: int = 0, span: float = 3600.0,
    warm_prefix: float = 0.0, max_context: int | None = None, recycle: bool = False,
) -> Trace:  # fmt: skip
    """The conversations ``path`` names (a file or a folder) as one trace in arrival
    order (see the module docstring); ``sessions``: draw that many (all: None), with
    replacement when ``recycle``; ``max_context``: the client's context limit.

    Raises:
        TraceError: a bad file or record, naming the file and the field. ValueError:
            ``sessions``, ``span``, ``warm_prefix`` or ``max_context`` out of range, or
            ``recycle`` without ``sessions``.
    """
    if max_context is not None and (isinstance(max_context, bool) or not isinstance(
            max_context, int) or max_context < 1):  # fmt: skip
        raise ValueError(f"max_context must be an int >= 1, got {max_context!r}")
    files = trace_files(path)
    if max_context is not None:  # (read once here, again if drawn: memory stays one file's)
        files = [f for f in files if _first_in(f, read_conversation(f)) <= max_context]
        if not files:
            raise ValueError(f"max_context: no trace in {path} has a first call within "
                             f"{max_context:,} tokens")  # fmt: skip
    if recycle and sessions is None:
        raise ValueError("recycle: needs sessions (how many to draw)")
    if sessions is not None and sessions > MAX_SESSIONS:
        raise ValueError(f"sessions: at most {MAX_SESSIONS:,}, got {sessions:,}")
    if sessions is not None and not (sessions >= 1 and (recycle or sessions <= len(files))):
        fit = f" whose first call fits in {max_context:,} tokens" if max_context else ""
        raise ValueError(f"sessions: {sessions} of {len(files)} traces{fit} in {path}")
    if not (math.isfinite(span) and span >= 0):
        raise ValueError(f"span must be seconds >= 0, got {span}")
    if not 0.0 <= warm_prefix <= 1.0:
        raise ValueError(f"warm_prefix must be a fraction in [0, 1], got {warm_prefix}")
    rng = random.Random(seed)
    if sessions is None:
        chosen = files
    else:
        chosen = rng.choices(files, k=sessions) if recycle else sorted(rng.sample(files, sessions))
    starts = [rng.uniform(0, span) if sessions is not None else 0.0 for _ in chosen]
    reader = _Reader(warm_prefix, max_context)
    requests: list[SimRequest] = []
    draws: dict[Path, list[int]] = {}  # each file read once, however often drawn
    for scope, f in enumerate(chosen):
        draws.setdefault(f, []).append(scope)
    for f, scopes in draws.items():
        doc = read_conversation(f)
        for scope in scopes:
            requests += reader.conversation(scope, f, doc, starts[scope])
    if not requests:
        raise TraceError(f"{path}: the traces hold no call")
    requests.sort(key=lambda r: r.timestamp)
    name = Path(path).name.removesuffix(".gz").removesuffix(".json")
    return Trace(f"{name} ({len(chosen)} sessions)", reader.block or 64, requests)


__all__ = ["MAX_BLOCKS", "MAX_DEPTH", "MAX_FILE_BYTES", "MAX_SESSIONS", "load_agentic",
           "looks_agentic", "trace_files"]  # fmt: skip
