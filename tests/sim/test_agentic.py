"""Agentic traces (`radixkv.sim.agentic`, ``simulate --format agentic``): kv-cache-tester's
recorded Claude Code sessions read into a trace: sessions and sub-agents, the file's
hash-id scope, closed-loop time, the warm prefix, the draw; and every bad record one line
naming the file and the field, exit 2, in bounded memory."""

from __future__ import annotations

import gzip
import json

import pytest

from radixkv.cli import main
from radixkv.sim.agentic import MAX_DEPTH, MAX_SESSIONS, load_agentic
from radixkv.sim.traces import TraceError


def call(t: float, n_in: int, ids: list[int], api: float = 1.0, think: float = 0.0,
         stop: str = "tool_use") -> dict:  # fmt: skip
    return {"t": t, "type": "s", "in": n_in, "out": 10, "hash_ids": ids, "stop": stop,
            "api_time": api, "think_time": think}  # fmt: skip


def conversation(requests: list, tool: int = 128, system: int = 64) -> dict:
    return {"id": "x", "block_size": 64, "hash_id_scope": "local", "tool_tokens": tool,
            "system_tokens": system, "requests": requests}  # fmt: skip


def write(path, doc: dict, gz: bool = False) -> str:
    data = json.dumps(doc).encode()
    if gz:
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return str(path)


def test_sessions_scopes_and_closed_loop_time(tmp_path):
    """A conversation's calls start at the first one's t, then each think_time after the
    previous answer (its api_time) ends; a sub-agent is a session of its own sharing its
    file's ids; two files never share a unit."""
    a = conversation([
        call(0.0, 200, [1, 2, 3], api=2.0),
        {"type": "subagent", "t": 5.0, "requests": [call(5.0, 130, [1, 2], api=1.0),
                                                    call(9.0, 200, [1, 2, 7], think=0.5)]},
        call(50.0, 260, [1, 2, 3, 4], api=1.0, think=3.0),  # closed loop: 0 + 2 + 3 = 5 s
    ])  # fmt: skip
    b = conversation([call(1.0, 192, [1, 2, 3])])
    write(tmp_path / "a.json", a)
    write(tmp_path / "b.json.gz", b, gz=True)
    trace = load_agentic(tmp_path)
    assert trace.block_size == 64 and len(trace.requests) == 5
    got = sorted((r.timestamp, r.prompt_tokens, tuple(r.units)) for r in trace.requests)
    ua = {h: u for _, _, us in got[:1] for h, u in zip([1, 2, 3], us, strict=True)}
    assert [g[0] for g in got] == [0.0, 1000.0, 5000.0, 5000.0, 6500.0]
    assert got[0][2] == (ua[1], ua[2], ua[3])
    b_units = next(us for ts, n, us in got if ts == 1000.0)
    assert not set(b_units) & set(ua.values())  # another file: no unit in common
    sub = [us for ts, n, us in got if n == 130]
    assert sub == [(ua[1], ua[2])]  # the sub-agent shares its file's ids
    # the warm prefix: (128 + 64) x 0.5 = 96 tokens = 1 whole block, shared by every file
    warm = load_agentic(tmp_path, warm_prefix=0.5)
    firsts = {r.units[0] for r in warm.requests}
    assert len(firsts) == 1


def test_the_draw_is_seeded_and_spans_its_window(tmp_path):
    for i in range(6):
        write(tmp_path / f"t{i}.json", conversation([call(0.0, 128, [1, 2])]))
    one = load_agentic(tmp_path, sessions=3, seed=7, span=100.0)
    two = load_agentic(tmp_path, sessions=3, seed=7, span=100.0)
    assert [r.timestamp for r in one.requests] == [r.timestamp for r in two.requests]
    assert len(one.requests) == 3 and all(0 <= r.timestamp <= 100_000 for r in one.requests)
    other = load_agentic(tmp_path, sessions=3, seed=8, span=100.0)
    assert [r.timestamp for r in other.requests] != [r.timestamp for r in one.requests]
    with pytest.raises(ValueError, match="sessions: 7 of 6"):
        load_agentic(tmp_path, sessions=7)


def test_a_context_limit_draws_what_fits_and_ends_each_session_before_it(tmp_path):
    """kv-cache-tester's --max-context: a conversation whose first call is over the
    limit is never drawn; a session (a sub-agent's too) ends before its first call over
    it, and nothing after that call is read."""
    write(tmp_path / "fits.json", conversation([
        call(0.0, 128, [1, 2]),
        {"type": "subagent", "t": 1.0,
         "requests": [call(1.0, 64, [1]), call(2.0, 640, list(range(10)))]},
        call(3.0, 192, [1, 2, 3]),
        call(4.0, 256, [1, 2, 3, 4]),  # over 200: the session ends here
        call(5.0, 64, [1]),
    ]))  # fmt: skip
    write(tmp_path / "big.json", conversation([call(0.0, 320, [1, 2, 3, 4, 5])]))
    trace = load_agentic(tmp_path, max_context=200)
    assert sorted(r.prompt_tokens for r in trace.requests) == [64, 128, 192]
    assert len(load_agentic(tmp_path).requests) == 7  # (without the limit: every call)
    with pytest.raises(ValueError, match="sessions: 2 of 1 traces whose first call fits"):
        load_agentic(tmp_path, sessions=2, max_context=200)
    with pytest.raises(ValueError, match="max_context: no trace"):
        load_agentic(tmp_path, max_context=100)
    with pytest.raises(ValueError, match="max_context must be an int >= 1"):
        load_agentic(tmp_path, max_context=0)


def test_recycled_draws_are_sessions_of_their_own(tmp_path):
    """kv-cache-tester's --recycle replays a trace with new text: drawn with replacement,
    two draws of one file share no unit (but the warm prefix)."""
    write(tmp_path / "only.json", conversation([call(0.0, 128, [1, 2]), call(1.0, 192, [1, 2, 3])]))
    trace = load_agentic(tmp_path, sessions=5, seed=3, span=10.0, recycle=True, warm_prefix=0.5)
    assert len(trace.requests) == 10 and len({r.session for r in trace.requests}) == 5
    firsts = [r for r in trace.requests if r.prompt_tokens == 128]
    assert len({r.units[0] for r in firsts}) == 1  # the warm prefix: 1 block, shared
    assert len({r.units[1] for r in firsts}) == 5  # the rest: each draw its own
    with pytest.raises(ValueError, match="recycle: needs sessions"):
        load_agentic(tmp_path, recycle=True)
    # a draw with replacement is bounded before anything is drawn
    with pytest.raises(ValueError, match=f"sessions: at most {MAX_SESSIONS:,}"):
        load_agentic(tmp_path, sessions=10**12, recycle=True)


def test_the_client_flags_are_refused_but_for_agentic_traces(capsys):
    assert main(["simulate", "--workload", "chat", "--recycle"]) == 2
    assert "--recycle: only with --format agentic" in capsys.readouterr().err
    assert main(["simulate", "--workload", "chat", "--max-context", "100"]) == 2
    assert "--max-context: only with --format agentic" in capsys.readouterr().err


def nested(depth: int) -> dict:
    inner: dict = {"type": "subagent", "t": 0.0, "requests": [call(0.0, 64, [1])]}
    for _ in range(depth):
        inner = {"type": "subagent", "t": 0.0, "requests": [inner]}
    return inner


BAD = [
    (conversation([call(-1.0, 64, [1])]), r"requests\[0\]: t must be a number of seconds"),
    (conversation([call(0.0, 64, [1], think=float("nan"))]), "think_time must be"),
    (conversation([call(0.0, 64, [1], api=-2)]), "api_time must be"),
    (conversation([{**call(0.0, 64, [1]), "surprise": 1}]), "field .*'surprise'"),
    ({**conversation([]), "extra": 1}, "the trace has a field .*'extra'"),
    (conversation([call(0.0, 64 * 10**7, list(range(10)))]), "in must be"),
    (conversation([call(0.0, 640, [1, 2])]), "needs 10 hash_ids"),
    (conversation([call(0.0, 64, ["1"])]), r"hash_ids\[0\]"),
    (conversation([call(0.0, 64, [1], stop="maybe")]), "stop must be one of"),
    (conversation([nested(MAX_DEPTH + 2)]), f"nested over {MAX_DEPTH} deep"),
    ({**conversation([]), "block_size": 0}, "block_size"),
    ({**conversation([]), "hash_id_scope": "global"}, "hash_id_scope must be 'local'"),
    ([1, 2], "expected a JSON object"),
]  # fmt: skip


@pytest.mark.parametrize(("doc", "match"), BAD, ids=[m[:24] for _, m in BAD])
def test_a_bad_record_is_one_line_naming_the_file_and_the_field(tmp_path, capsys, doc, match):
    import re

    path = write(tmp_path / "bad.json", doc)
    assert main(["simulate", "--trace", path, "--format", "agentic", "--capacity", "1k"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: "), lines
    assert re.search(match, lines[0]), lines[0]


def test_a_huge_file_is_refused_without_being_read_whole(tmp_path, capsys):
    """2 GB of JSON behind a few MB of gzip: the read stops at the bound."""
    import zlib

    comp = zlib.compressobj(wbits=31)  # a gzip stream, written a chunk at a time
    with open(tmp_path / "huge.json.gz", "wb") as f:
        f.write(comp.compress(b'{"requests": ['))
        chunk = b" " * (64 << 20)
        for _ in range(32):
            f.write(comp.compress(chunk))
        f.write(comp.compress(b"]}") + comp.flush())
    with pytest.raises(TraceError, match="over 64 MiB"):
        load_agentic(tmp_path / "huge.json.gz")


def test_simulate_reads_agentic_traces_and_writes_rows(tmp_path, capsys):
    for i in range(3):
        write(tmp_path / f"t{i}.json", conversation([call(0.0, 128 + 64 * t, list(range(2 + t)))
                                                     for t in range(4)]))  # fmt: skip
    out = tmp_path / "r.json"
    argv = ["simulate", "--trace", str(tmp_path), "--sessions", "2", "--seed", "1",
            "--capacity", "8blocks,inf", "--policy", "lru,belady", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(out.read_text())["results"]
    assert {(r["policy"], r["capacity_tokens"] is None) for r in rows} >= {("lru", False)}
    assert all(0 <= r["token_hit_rate"] <= 1 for r in rows)
    assert main(["simulate", "--workload", "chat", "--sessions", "2"]) == 2
    assert "--sessions: only with --format agentic" in capsys.readouterr().err


def test_the_session_order_keeps_the_agent_coming_back_over_the_person_who_left(tmp_path):
    """Room for one session's prefix: A's person left (its answer stopped on end_turn);
    B, an agent, is running a tool. A third session C arrives and forces one out. LRU
    evicts B (used before A's last call); the session order evicts A, and B's next call
    hits. It reads a stop reason only once that answer has ended."""
    from radixkv.sim.replay import simulate
    from radixkv.sim.sessions import SessionOrder

    a = conversation([call(0.0, 640, list(range(10)), api=1.0, stop="end_turn"),
                      call(500.0, 704, list(range(11)), api=1.0)])  # fmt: skip
    b = conversation([call(0.0, 640, list(range(10)), api=0.5),
                      call(2.2, 704, list(range(11)), api=0.5, think=1.7)])  # fmt: skip
    c = conversation([call(1.5, 640, list(range(10)), api=0.5)])
    for name, doc in (("a", a), ("b", b), ("c", c)):
        write(tmp_path / f"{name}.json", doc)
    # (a starts after b: its last call, at 1 s, is more recent than b's first, at 0)
    a["requests"][0]["t"] = 0.4
    write(tmp_path / "a.json", a)
    trace = load_agentic(tmp_path)
    lru = simulate(trace, 21, "lru")
    session = simulate(trace, 21, "session")
    assert session.hit_tokens > lru.hit_tokens, (session, lru)

    order = SessionOrder()
    first = trace.requests[0]
    order.arrive(first)  # running: predicted back soon, whatever its stop will be
    assert order.predicted(first.session) == first.timestamp + 10_000.0
    order.now = first.timestamp + first.duration_ms + 1  # ended: now its stop counts
    expect = 600_000.0 if first.stop == "end_turn" else 10_000.0
    assert order.predicted(first.session) == first.timestamp + first.duration_ms + expect


def test_the_session_order_is_named_not_in_all(tmp_path):
    from radixkv.sim.sweep import policy_list

    assert "session" not in policy_list("all", "tree")
    assert policy_list("lru,session", "tree") == ["lru", "session"]
    with pytest.raises(ValueError, match="unknown 'session'"):
        policy_list("session", "block")
