"""A server's own log replayed (`radixkv.engine.served_log`, `radixkv.sim.served`,
``radixkv serve --served-log``, ``radixkv simulate --trace LOG``): requests arriving at
irregular steps, 8 running at once, under memory pressure (evictions, preemptions), some
aborted, some in groups of choices, are replayed through the engine without the model,
and each request's cached prompt tokens equal what the server cached. A live server
process under the official ``openai`` client, on Qwen3.5-, Gemma-3- and Mistral-like
folders; the log's file, format and bad input."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
from pathlib import Path

import openai
import pytest

from radixkv.cli import main
from radixkv.engine.config import EngineConfig
from radixkv.engine.engine import Engine
from radixkv.engine.request import CacheSpec, MarkedIds, SamplingParams
from radixkv.engine.served_log import ServedLog
from radixkv.sim.served import load_served, replay_served
from radixkv.sim.traces import TraceError
from radixkv.web.process import ServerProcess

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    out = {}
    for family in ("qwen3.5", "gemma3", "mistral"):
        path = tmp_path_factory.mktemp("m") / family
        assert main(["make-model", family, str(path)]) == 0
        out[family] = str(path)
    return out


def serve_irregularly(engine: Engine, seed: int = 1) -> int:
    """12 chats x 3 turns behind 2 system prompts, 0-2 arriving before each step while
    8 run; every 9th request aborted a few steps in, every 7th two choices of one group,
    every 5th with a cache spec. Returns how many requests were queued."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 300) for _ in range(40)] for _ in range(2)]
    history = [list(systems[i % 2]) for i in range(12)]
    todo, busy, owner, queued, aborts = [*range(12)] * 3, set(), {}, 0, {}
    while todo or engine.has_unfinished():
        for _ in range(rng.randrange(0, 3)):
            ready = [i for i in todo if i not in busy]
            if not ready:
                break
            i = ready[0]
            todo.remove(i)
            busy.add(i)
            history[i].extend(rng.randrange(3, 300) for _ in range(12))
            n = 2 if queued % 7 == 6 else 1
            spec = CacheSpec(limit=len(history[i]) - 4) if queued % 5 == 4 else None
            rids = [f"r{queued}-{k}" for k in range(n)]
            for rid in rids:
                sampling = SamplingParams(rng.randrange(1, 8), temperature=1.0, seed=queued)
                group = rids[0] if n > 1 else None
                engine.add_request(MarkedIds(list(history[i]), (40,)), sampling, rid,
                                   f"ns{i % 2}", False, group, spec)  # fmt: skip
                owner[rid] = i
            if queued % 9 == 8:
                aborts[rids[0]] = engine.counters.steps + rng.randrange(0, 4)
            queued += n
        for rid, at in list(aborts.items()):
            if engine.counters.steps >= at:
                engine.abort(rid)
                del aborts[rid]
        if engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    busy.discard(owner[out.rid])
    return queued


@pytest.mark.parametrize(("family", "budget"), [("qwen3.5", 30_000), ("gemma3", 300_000)])
def test_an_engine_at_concurrency_8_is_replayed_request_for_request(
    tmp_path, folders, family, budget
):
    log = tmp_path / "served.jsonl"
    cfg = EngineConfig(page_size=4, cache_bytes=budget, max_running=8, chunk_size=32,
                       max_context_len=1024, served_log=str(log))  # fmt: skip
    engine = Engine(folders[family], cfg)
    queued = serve_irregularly(engine)
    evicted = sum(engine.cache_bytes_evicted().values())
    assert evicted > 0  # under pressure
    served = load_served(log)
    assert len(served.trace.requests) == queued
    finishes = [json.loads(x).get("finish") for x in log.read_text().splitlines()[1:]]
    assert "abort" in finishes
    rep = replay_served(served, folders[family])
    assert rep.cached == served.server_cached  # request for request
    assert rep.steps == engine.counters.steps  # one token a step, as the server stepped
    assert rep.agree == queued and rep.hit_tokens > 0
    if family == "qwen3.5":
        assert rep.preemptions > 0
    # the steps are what makes it exact: all arriving at once, the replay differs
    early = [dataclasses.replace(a, step=0, left_step=None) for a in served.arrivals]
    wrong = replay_served(dataclasses.replace(served, arrivals=early), folders[family])
    assert wrong.agree < queued


def test_a_logs_replay_steps_one_token_a_step_as_the_server_did(tmp_path, folders):
    """A replay of a trace decodes runs of tokens in one step (`Scheduler.steady_run`),
    but a served log times its arrivals in the server's steps, one token each: its replay
    steps as the server did (with runs it took fewer steps, the arrivals later)."""
    log = tmp_path / "served.jsonl"
    cfg = EngineConfig(page_size=4, cache_bytes=60_000, max_running=1, chunk_size=32,
                       max_context_len=1024, served_log=str(log))  # fmt: skip
    engine = Engine(folders["qwen3.5"], cfg)
    for i in range(6):  # each arrives while the one before decodes
        engine.add_request([*range(3, 40), *[i + 3] * 5], SamplingParams(24, ignore_eos=True),
                           f"r{i}", chat=False)  # fmt: skip
        for _ in range(7):
            engine.step()
    while engine.has_unfinished():
        engine.step()
    served = load_served(log)
    rep = replay_served(served, folders["qwen3.5"])
    assert rep.cached == served.server_cached and rep.hit_tokens > 0
    assert rep.steps == engine.counters.steps


async def _chats(port: int, model: str, chats: int = 12, turns: int = 3) -> list[tuple[int, int]]:
    """Multi-turn chats, each turn after a random pause: (prompt tokens, cached tokens)."""
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                max_retries=0)  # fmt: skip
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "paper"]
    out: list[tuple[int, int]] = []

    async def chat(i: int) -> None:
        rng = random.Random(i)
        system = f"You are agent {i % 3}. " + " ".join(rng.choice(words) for _ in range(12))
        msgs = [{"role": "system", "content": system}]
        for t in range(turns):
            user = " ".join(rng.choice(words) for _ in range(rng.randrange(3, 7)))
            msgs.append({"role": "user", "content": user})
            await asyncio.sleep(rng.random() * 0.3)
            r = await client.chat.completions.create(
                model=model, messages=msgs, max_tokens=rng.randrange(2, 10), temperature=1.0,
                seed=i * 10 + t)  # fmt: skip
            details = r.usage.prompt_tokens_details
            out.append((r.usage.prompt_tokens, details.cached_tokens if details else 0))
            msgs.append({"role": "assistant", "content": r.choices[0].message.content})

    await asyncio.gather(*(chat(i) for i in range(chats)))
    await client.close()
    return out


LIVE = [("qwen3.5", 90_000), ("gemma3", 330_000), ("mistral", 120_000)]


@pytest.mark.parametrize(("family", "budget"), LIVE)
def test_a_live_server_at_concurrency_8_is_replayed_request_for_request(
    tmp_path, folders, family, budget
):
    """`radixkv serve --served-log` under 12 concurrent chats (8 running, arrivals as
    the client's pauses fall), then ``radixkv simulate --trace LOG``: every request's
    cached tokens equal the server's, which equal what the client was told."""
    log, report = tmp_path / "served.jsonl", tmp_path / "replay.json"
    args = ["--model", folders[family], "--page-size", "4", "--cache-bytes", str(budget),
            "--chunk-size", "32", "--max-running", "8", "--max-context-len", "2048",
            "--served-log", str(log)]  # fmt: skip
    with ServerProcess(*args, timeout=120) as srv:
        told = asyncio.run(_chats(srv.port, family))
        from helpers import metric

        evicted = sum(metric(srv.url, f"radixkv:{m}") for m in (
            "evicted_tokens_total", "window_kv_evicted_tokens_total"))  # fmt: skip
    assert evicted > 0  # under pressure
    assert oct(os.stat(log).st_mode & 0o777) == "0o600"
    assert main(["simulate", "--trace", str(log), "--model-spec", folders[family],
                 "--json", str(report)]) == 0  # fmt: skip
    rows = json.loads(report.read_text())["requests"]
    assert len(rows) == len(told) == 36
    assert [r["cached"] for r in rows] == [r["server_cached"] for r in rows]
    assert sorted((r["prompt_tokens"], r["cached"]) for r in rows) == sorted(told)
    assert sum(c for _, c in told) > 0


def test_the_log_file_is_the_owners_never_a_link_and_capped(tmp_path, folders):
    target = tmp_path / "elsewhere"
    target.write_text("")
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(ValueError, match="served_log: cannot write"):
        Engine(folders["qwen3.5"], EngineConfig(served_log=str(tmp_path / "link")))
    assert target.read_text() == ""
    with pytest.raises(ValueError, match="served_log must be a file path"):
        EngineConfig(served_log="")
    log = ServedLog(str(tmp_path / "small.jsonl"), EngineConfig(), limit=600)
    header = log.written
    assert 0 < header < 600 and oct(os.stat(tmp_path / "small.jsonl").st_mode & 0o777) == "0o600"
    engine = Engine(folders["qwen3.5"], EngineConfig(max_context_len=1024))
    engine.served_log = log
    engine.generate([[5] * 200, [6] * 10], max_new_tokens=2)
    text = (tmp_path / "small.jsonl").read_text()
    assert log.full and len(text) <= 600  # the 200-token request did not fit
    assert all(json.loads(line) for line in text.splitlines())


def _write(path: Path, lines: list) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


HEADER = {"radixkv_served_log": 1, "config": {"page_size": 4}}
REC = {"order": 0, "step": 0, "token_ids": [5, 6, 7], "output_ids": [8], "boundaries": [],
       "extra_key": None, "group": None, "cache_limit": None, "cache_read": True,
       "retain": [], "finish": "length", "left_step": None, "cached": 0}  # fmt: skip


@pytest.mark.parametrize(("lines", "message"), [
    ([REC], ":1: not a served log"),
    ([HEADER, {**REC, "colour": 1}], ":2: unknown field 'colour'"),
    ([HEADER, {k: v for k, v in REC.items() if k != "step"}], ":2: missing 'step'"),
    ([HEADER, REC, HEADER], ":3: a second header"),
    ([HEADER, REC, REC], ":3: order 0 twice"),
    ([HEADER, {**REC, "retain": [[9, 1.0]]}], ":2: retain position must be in"),
    ([HEADER, {**REC, "left_step": -1}], ":2: left_step must be in"),
    ([HEADER, {**REC, "cached": 4}], ":2: cached must be in"),
    ([{**HEADER, "config": {"colour": 1}}, REC], ":1: config: unknown knob 'colour'"),
    ([{**HEADER, "config": {"page_size": 0}}, REC], ":1: config: page_size"),
    ([HEADER], "a served log with no requests"),
])  # fmt: skip
def test_a_bad_log_is_one_error_naming_the_line(tmp_path, lines, message):
    path = _write(tmp_path / "log.jsonl", lines)
    with pytest.raises(TraceError, match=message):
        load_served(path)


def test_the_cli_refuses_what_the_log_decides(tmp_path, folders, capsys):
    path = _write(tmp_path / "log.jsonl", [HEADER, REC])
    for extra, flag in ((["--capacity", "1MiB"], "--capacity"),
                        (["--concurrency", "4"], "--concurrency"),
                        (["--policy", "radixkv"], "--policy"),
                        (["--block-size", "8"], "--block-size")):  # fmt: skip
        assert main(["simulate", "--trace", str(path), "--model-spec", folders["qwen3.5"],
                     *extra]) == 2  # fmt: skip
        assert capsys.readouterr().err.startswith(f"error: {flag}:")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # (an open would block for ever: refused before it)
    assert main(["simulate", "--trace", str(fifo), "--format", "served", "--model-spec",
                 folders["qwen3.5"]]) == 2  # fmt: skip
    assert "not a regular file" in capsys.readouterr().err
    # a header claiming a petabyte: even the indices of an index-only replay would not fit
    huge = _write(tmp_path / "huge.jsonl", [{**HEADER, "config": {"page_size": 4,
                                                                 "cache_bytes": 1 << 50}}, REC])
    assert main(["simulate", "--trace", str(huge), "--model-spec", folders["qwen3.5"]]) == 2
    assert "its indices" in capsys.readouterr().err
    rows = _write(tmp_path / "rows.jsonl", [{**HEADER, "config": {
        "page_size": 4, "max_running": 100_000, "max_context_len": 10_000_000}}, REC])
    assert main(["simulate", "--trace", str(rows), "--model-spec", folders["qwen3.5"]]) == 2
    assert "max_running=100000 x max_context_len=10,000,000" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(path), "--model-spec", "qwen3.5-4b"]) == 2
    assert "--model-spec: a served log needs the model's folder" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(path), "--format", "served", "--model-spec",
                 folders["qwen3.5"]]) == 0  # fmt: skip
    assert "cached what the server cached: 1 of 1 requests" in capsys.readouterr().out



def test_a_replay_holds_no_kv_bytes_so_any_budget_replays(folders):
    """The replay's engine is index-only: KV and checkpoints on the meta device, so a
    budget past what this machine could hold beside its tests replays (its indices
    only are real)."""
    from radixkv.sim import traces
    from radixkv.sim.serve_replay import replay_engine, replay_serve

    trace = traces.from_tokens("t", [([5, 6, 7, 8] * 8, {"output_ids": [9, 9]})] * 2, 4)
    engine, _ = replay_engine(trace, folders["qwen3.5"], EngineConfig(cache_bytes=4 << 30))
    assert engine.arena.data.device.type == "meta" and engine.arena.data.shape[0] >= 1 << 22
    assert engine.mgr.allocator.device.type == "cpu"
    assert all(t.device.type == "meta" for t in engine.recurrent.pool.tensors)
    # the same 32-token prompt again: all but its last page (the last token is computed)
    assert replay_serve(trace, folders["qwen3.5"], 1 << 30).cached == [0, 28]
