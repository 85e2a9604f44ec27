"""Fidelity: what the engine caches, replayed without the model
(`radixkv.sim.serve_replay`, ``radixkv simulate --policy serve``), and the budget
simulator's ``radixkv`` policy against the engine.

A Qwen3.5-like and a Gemma-3-like tiny model serve multi-turn chats behind shared system
prompts (boundaries marked, two cache namespaces) from one byte budget tight enough to
evict every kind; the trace of what they served (prompts, real outputs, rounds) is
replayed. At concurrency 1 and 8 the replay's cached tokens equal the engine's request for
request. With room to spare and requests served in order, the budget simulator's
admission equals the engine's too (same hits per request); under pressure it is a model
(``benchmarks/bench_fidelity.py`` measures how close).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from array import array
from pathlib import Path

import pytest
import torch

from radixkv.cli import main
from radixkv.engine.config import EngineConfig
from radixkv.engine.engine import Engine
from radixkv.engine.request import MarkedIds, SamplingParams
from radixkv.sim import traces
from radixkv.sim.hybrid import ModelSpec, simulate_hybrid
from radixkv.sim.serve_replay import (
    add_replayed,
    in_units,
    replay_engine,
    replay_serve,
    serve_result,
    tightest_budget,
)
from radixkv.sim.spec_model import DTYPE as SPEC_DTYPE
from radixkv.sim.spec_model import SpecModel

PAGE = 4
# a few requests wide: full KV, windows and checkpoints are all evicted
BUDGETS = {"qwen3.5": 48_000, "gemma3": 40_000}
RUN_BUDGETS = {"qwen3.5": 72_000, "gemma3": 80_000}  # (longer prompts, for answers of 40)


def serve_chats(engine: Engine, chats: int = 8, turns: int = 3) -> list[dict]:
    """Multi-turn chats behind 2 system prompts (their ends marked as boundaries), in two
    namespaces; each round sends every chat's next turn at once. Returns the token trace
    of what was served, with the engine's cached tokens per request."""
    g = torch.Generator().manual_seed(5)
    systems = [torch.randint(3, 384, (40,), generator=g).tolist() for _ in range(2)]
    history = [list(systems[i % 2]) for i in range(chats)]
    records = []
    for turn in range(turns):
        rids = []
        for i, h in enumerate(history):
            h.extend(torch.randint(3, 384, (12,), generator=g).tolist())
            prompt = MarkedIds(h, (40,))
            rids.append(engine.add_request(prompt, SamplingParams(6, ignore_eos=True),
                                           extra_key=f"ns{i % 2}", chat=False))  # fmt: skip
        reqs = [engine.requests[r] for r in rids]
        while engine.has_unfinished():
            engine.step()
        for i, (h, r) in enumerate(zip(history, reqs, strict=True)):
            records.append({"token_ids": list(h), "output_ids": list(r.output_ids),
                            "boundaries": [40], "extra_key": f"ns{i % 2}",
                            "timestamp": turn, "cached": r.prompt_cached})  # fmt: skip
            h.extend(r.output_ids)
    return records


def write_trace(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return traces.load_trace(path, "tokens", PAGE)


def config(concurrency: int, **kw) -> EngineConfig:
    return EngineConfig(page_size=PAGE, chunk_size=16, max_running=concurrency,
                        max_context_len=512, **kw)  # fmt: skip


@pytest.mark.parametrize("name", ["qwen3.5", "gemma3"])
@pytest.mark.parametrize("concurrency", [1, 8])
def test_the_replay_caches_what_the_engine_cached_request_for_request(
    tmp_path, hybrid_models, name, concurrency
):
    cfg = config(concurrency, cache_bytes=BUDGETS[name], check_memory=True)
    engine = Engine(hybrid_models[name], cfg)
    records = serve_chats(engine)
    served = [r["cached"] for r in records]
    assert sum(served) > 0  # hits, and
    gone = engine.cache_bytes_evicted()  # pressure on the full KV and the other kind
    assert gone["full"] > 0 and (gone["states"] if name == "qwen3.5" else gone["window"]) > 0
    trace = write_trace(tmp_path / "served.jsonl", records)
    replay = replay_serve(trace, hybrid_models[name], BUDGETS[name], cfg, concurrency=concurrency)
    assert replay.cached == served
    assert replay.prompt_tokens == sum(len(r["token_ids"]) for r in records)
    # another budget changes the answer: the replay is not reading the records' hits
    roomy = replay_serve(
        trace, hybrid_models[name], 8 * BUDGETS[name], cfg, concurrency=concurrency
    )
    assert roomy.hit_tokens > replay.hit_tokens


def _long_answers(vocab: int, page: int, timestamps: bool) -> traces.Trace:
    """24 chats x 3 turns behind shared prompts, answers of 21-47 tokens (runs of
    decode steps a page long and short of one), in rounds or all at once."""
    g = torch.Generator().manual_seed(11)
    trace = traces.gen_multi_turn(conversations=24, turns=3, first_len=24, message_len=8,
                                  output_len=40, block_size=page, seed=3)  # fmt: skip
    for i, r in enumerate(trace.requests):
        r.prompt_ids = [t % vocab for t in r.prompt_ids]
        n = int(torch.randint(21, 48, (1,), generator=g))
        r.output_ids = [t % vocab for t in (r.output_ids or ())][:n]
        r.output_tokens = len(r.output_ids)
        r.timestamp = r.timestamp if timestamps else i // 24
    return trace


@pytest.mark.parametrize("name", ["qwen3.5", "gemma3"])
@pytest.mark.parametrize("concurrency", [1, 8])
@pytest.mark.parametrize("page", [1, 4, 8])
def test_decoding_a_run_at_once_caches_what_one_token_a_step_does(
    hybrid_models, name, concurrency, page
):
    """A replay decodes the runs of tokens that decide nothing in one step each
    (`Scheduler.steady_run`: within a page; with recurrent layers across pages, ending
    on a page boundary, in free memory); under pressure (every kind evicted, requests
    preempted at 8 running), with arrivals in rounds, each request caches exactly what
    it does one token a step, and the engine holds the same bytes after each round, in
    far fewer steps alone (at page 1 a window's trim at every page keeps one token a
    step)."""
    trace = _long_answers(384, page, timestamps=concurrency == 1)
    budget = RUN_BUDGETS[name] * max(page, PAGE) // PAGE  # (page 1: page 4's)
    cfg = EngineConfig(page_size=page, chunk_size=16, max_context_len=512, check_memory=True)
    one = replay_serve(trace, hybrid_models[name], budget, cfg, concurrency=concurrency,
                       runs=False)  # fmt: skip
    run = replay_serve(trace, hybrid_models[name], budget, cfg, concurrency=concurrency)
    assert 0 < one.hit_tokens < one.prompt_tokens and not one.refused
    assert run.cached == one.cached
    assert (run.preemptions, run.checkpoints, run.mean_bytes) == (
        one.preemptions, one.checkpoints, one.mean_bytes)  # fmt: skip
    assert (one.preemptions > 0) == (concurrency > 1)
    if page == 1 and name == "gemma3":
        assert run.steps == one.steps
        return
    assert run.steps < one.steps
    roomy = replay_serve(trace, hybrid_models[name], 8 * budget, cfg, concurrency=concurrency)
    assert roomy.hit_tokens > one.hit_tokens  # (the budget evicts)
    if concurrency == 1:  # a page's decodes in about two steps
        assert run.steps < one.steps * 0.6


@pytest.mark.parametrize("name", ["qwen3.5", "gemma3"])
@pytest.mark.parametrize("schedule", ["fcfs", "lpm"])
def test_the_budget_simulator_admits_as_the_engine_does(tmp_path, hybrid_models, name, schedule):
    """With room to spare, one request at a time, in arrival order or the engine's
    ``lpm`` order (`radixkv.sim.hybrid.lpm_order`), the budget simulator's ``radixkv``
    policy hits exactly where the engine did: the same checkpoints (prompt end, resend
    point, boundaries, branch points, the last page a decode step reached), all but the
    last output token cached, a window wherever a match ends."""
    cfg = config(1, cache_bytes=2**22, schedule_policy=schedule)
    records = serve_chats(Engine(hybrid_models[name], cfg))
    trace = write_trace(tmp_path / "served.jsonl", records)
    spec = ModelSpec.from_folder(hybrid_models[name])
    sim = simulate_hybrid(trace, spec, 2**22, "radixkv", schedule=schedule)
    assert sim.hit_tokens == sum(r["cached"] for r in records) > 0


@pytest.mark.parametrize("every", [0, 8])
def test_the_budget_simulator_takes_the_engines_checkpoint_grid(tmp_path, hybrid_models, every):
    """``checkpoint_every`` in the engine and in the simulator: two prompts share 40
    tokens inside the first's node (no branch point yet); on an 8-token grid both resume
    the second from 40, without it both compute it whole."""
    cfg = config(1, cache_bytes=2**22, checkpoint_every=every)
    engine = Engine(hybrid_models["qwen3.5"], cfg)
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 384, (40,), generator=g).tolist()
    records = []
    for _ in range(2):
        prompt = shared + torch.randint(3, 384, (20,), generator=g).tolist()
        req = engine.requests[engine.add_request(prompt, SamplingParams(4, ignore_eos=True),
                                                 chat=False)]  # fmt: skip
        while engine.has_unfinished():
            engine.step()
        records.append({"token_ids": prompt, "output_ids": list(req.output_ids),
                        "cached": req.prompt_cached})  # fmt: skip
    assert [r["cached"] for r in records] == [0, 40 if every else 0]
    trace = write_trace(tmp_path / "served.jsonl", records)
    spec = ModelSpec.from_folder(hybrid_models["qwen3.5"])
    sim = simulate_hybrid(trace, spec, 2**22, "radixkv", checkpoint_every=every)
    assert sim.hit_tokens == records[1]["cached"]


@pytest.mark.parametrize("name", ["qwen3.5", "gemma3"])
def test_under_pressure_the_budget_simulator_follows_the_lpm_schedule(
    tmp_path, hybrid_models, name
):
    """One request at a time under a budget that evicts: the engine's ``lpm`` schedule
    serves the chats behind the cached system prompt first. The budget simulator in
    that order is within 0.03 of the engine's hit rate (0.51 against 0.51 here); in the
    trace's order it is not (0.17 and 0)."""
    cfg = config(1, cache_bytes=BUDGETS[name])
    records = serve_chats(Engine(hybrid_models[name], cfg))
    trace = write_trace(tmp_path / "served.jsonl", records)
    engine = sum(r["cached"] for r in records) / sum(len(r["token_ids"]) for r in records)
    spec = ModelSpec.from_folder(hybrid_models[name])
    lpm = simulate_hybrid(trace, spec, BUDGETS[name], "radixkv", schedule="lpm")
    fcfs = simulate_hybrid(trace, spec, BUDGETS[name], "radixkv", schedule="fcfs")
    assert abs(lpm.token_hit_rate - engine) <= 0.03 < abs(fcfs.token_hit_rate - engine)


def test_simulate_policy_serve_from_the_command_line(tmp_path, hybrid_models):
    """``--policy serve`` is the engine with one budget, ``serve-sglang`` the engine with
    SGLang's split of the same bytes (``cache_split="sglang"``): each row equals its
    engine's cached tokens on the same requests."""
    q, budget = hybrid_models["qwen3.5"], 2 * BUDGETS["qwen3.5"]  # (a split fits a turn)
    records = serve_chats(Engine(q, config(8, cache_bytes=budget)))
    split = serve_chats(Engine(q, config(8, cache_bytes=budget, cache_split="sglang")))
    assert [r["token_ids"] for r in split] == [r["token_ids"] for r in records]
    path = tmp_path / "served.jsonl"
    write_trace(path, records)
    cmd = [sys.executable, "-m", "radixkv.cli", "simulate", "--trace", str(path),
           "--model-spec", q, "--capacity", f"{budget}B", "--policy",
           "serve,serve-sglang,radixkv", "--concurrency", "8", "--chunk-size", "16",
           "--block-size", str(PAGE), "--json", "-"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = {r["policy"]: r for r in json.loads(out.stdout)["results"]}
    assert rows["serve"]["hit_tokens"] == sum(r["cached"] for r in records)
    assert rows["serve-sglang"]["hit_tokens"] == sum(r["cached"] for r in split)
    assert rows["serve"]["hit_tokens"] != rows["serve-sglang"]["hit_tokens"]
    assert rows["serve"]["capacity_bytes"] == budget


def test_the_serve_policy_refuses_what_it_cannot_replay(tmp_path, hybrid_models, capsys):
    def refused(*args):
        assert main(["simulate", *args]) == 2
        return capsys.readouterr().err.strip().splitlines()[-1]

    q = hybrid_models["qwen3.5"]
    big = tmp_path / "big.jsonl"
    big.write_text(json.dumps({"token_ids": [5, 999_999], "output_ids": [1]}) + "\n")
    assert refused("--trace", str(big), "--model-spec", q, "--capacity", "1MiB", "--policy",
                   "serve") == ("error: --policy serve: trace request 0: token ids must lie "
                                "in [0, 384)")  # fmt: skip
    ok = tmp_path / "ok.jsonl"
    ok.write_text(json.dumps({"token_ids": [5, 6, 7], "output_ids": [1]}) + "\n")
    assert refused(
        "--trace", str(ok), "--model-spec", q, "--capacity", "4KiB", "--policy", "serve"
    ).startswith("error: --capacity: 4,096 bytes is too small")
    # a preset has no folder: its engine is its spec's (radixkv.sim.spec_model)
    assert main(["simulate", "--trace", str(ok), "--model-spec", "qwen3.5-4b", "--capacity",
                 "1GiB", "--policy", "serve"]) == 0  # fmt: skip
    assert refused(
        "--trace", str(ok), "--model-spec", q, "--capacity", "inf", "--policy", "serve"
    ).startswith("error: --capacity: the serve policy")
    assert refused("--trace", str(ok), "--model-spec", q, "--capacity", "1MiB",
                   "--concurrency", "2").startswith("error: --concurrency: only with --policy "
                                                    "serve")  # fmt: skip
    assert refused("--trace", str(ok), "--concurrency", "2") == (
        "error: --concurrency: only with --model-spec (the hybrid replay)"
    )


def test_a_request_the_engine_refuses_is_counted_not_fatal(tmp_path, hybrid_models, capsys):
    """A request longer than the pool holds alone: the engine refuses it (``radixkv
    serve`` answers 400) and the replay goes on, counting it refused and a miss, the
    table saying so; the others are served as without it. `tightest_budget` finds the
    least budget that serves the longest one."""
    q = hybrid_models["qwen3.5"]
    short = {"token_ids": list(range(10, 50)), "output_ids": [7, 8], "timestamp": 0}
    again = {"token_ids": list(range(10, 50)) + [7, 9], "output_ids": [5], "timestamp": 2}
    long = {"token_ids": list(range(10, 330)), "output_ids": [1], "timestamp": 1}
    budget = tightest_budget(write_trace(tmp_path / "s.jsonl", [short, again]), q, 1 << 20)
    trace = write_trace(tmp_path / "t.jsonl", [short, long, again])
    rep = replay_serve(trace, q, budget, config(1))
    alone = replay_serve(write_trace(tmp_path / "u.jsonl", [short, again]), q, budget, config(1))
    assert rep.refused == 1 and alone.refused == 0
    assert rep.cached == [alone.cached[0], 0, alone.cached[1]] and alone.cached[1] > 0
    assert rep.prompt_tokens == 40 + 320 + 42
    assert tightest_budget(trace, q, 1 << 20) > budget  # the long one needs more
    with pytest.raises(ValueError, match="do not serve the trace's longest request"):
        tightest_budget(trace, q, budget)
    assert main(["simulate", "--trace", str(tmp_path / "t.jsonl"), "--model-spec", q,
                 "--capacity", f"{budget}B", "--policy", "serve", "--block-size", str(PAGE),
                 "--chunk-size", "16"]) == 0  # fmt: skip
    out = " ".join(capsys.readouterr().out.split())
    assert "refused (prompt + output over what the pool holds alone; each a miss): serve at" in out
    assert out.endswith(": 1")


def test_the_replay_builds_a_model_of_any_size_without_its_memory(tmp_path, hybrid_models):
    """A Qwen3.5-4B-sized config (no weights): the replay's model takes a few bytes a
    tensor, counts its parameters, and serves a trace (only the arena and the state rows
    are real memory)."""
    from radixkv.checkpoint.files import read_json
    from radixkv.sim.serve_replay import empty_model

    big = tmp_path / "big"
    big.mkdir()
    cfg = read_json(Path(hybrid_models["qwen3.5"]) / "config.json")
    layers = ["linear_attention"] * 3 + ["full_attention"]
    cfg.update(hidden_size=2560, intermediate_size=9216, num_hidden_layers=32,
               layer_types=layers * 8, num_attention_heads=16, num_key_value_heads=4,
               head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128,
               linear_num_key_heads=16, linear_num_value_heads=32, vocab_size=248_320)  # fmt: skip
    (big / "config.json").write_text(json.dumps(cfg))
    model = empty_model(big)
    params = list(model.parameters())
    assert sum(p.numel() for p in params) > 3e9  # the weights of a 4B model, counted
    assert sum(p.untyped_storage().nbytes() for p in params) < 64 * len(params)  # not held
    trace = write_trace(tmp_path / "t.jsonl", [
        {"token_ids": list(range(100, 140)), "output_ids": [7, 8], "timestamp": 0},
        {"token_ids": list(range(100, 140)) + [7, 9, 9], "output_ids": [5], "timestamp": 1},
    ])  # fmt: skip
    rep = replay_serve(trace, big, 2**30, config(1))
    assert rep.cached == [0, 40]  # the second hits the first's prompt + answer, page-aligned


def _burst_trace(vocab: int) -> traces.Trace:
    """80 multi-turn requests (16 chats x 5 turns, the longest 352 tokens), every one
    arriving at once."""
    trace = traces.gen_multi_turn(conversations=16, turns=5, first_len=64, message_len=32,
                                  output_len=32, block_size=16, seed=1)  # fmt: skip
    for r in trace.requests:
        r.prompt_ids = [t % vocab for t in r.prompt_ids]
        r.output_ids = [t % vocab for t in r.output_ids or ()]
        r.timestamp = 0
    return trace


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3.5", "gemma3", "llama"])
def test_a_burst_at_the_tightest_budget_finishes(tmp_path, hybrid_models, family):
    """Every request at once, at the least budget that serves the longest alone, 8 and
    32 running: the engine's scheduler and memory make progress. A lone request whose
    own path held the checkpoints its KV needed once waited for ever (a prefill chunk)
    or raised (a decode); the scheduler now drops such checkpoints last of all."""
    import signal

    folder = hybrid_models.get(family)
    if folder is None:
        folder = str(tmp_path / family)
        assert main(["make-model", family, folder]) == 0
    trace = _burst_trace(256)
    budget = tightest_budget(trace, folder, 4 << 20)

    def stalled(*_: object) -> None:
        raise AssertionError(f"{family}: the burst did not finish in 120 s")

    old = signal.signal(signal.SIGALRM, stalled)
    signal.alarm(120)
    try:
        for concurrency in (8, 32):
            rep = replay_serve(trace, folder, budget, concurrency=concurrency)
            assert len(rep.cached) == len(trace.requests)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# --- hash-id traces, replayed in their units ----------------------------------------------
UNIT_SPECS = {
    "full": ModelSpec("full", 2, 64),
    "qwen": ModelSpec("qwen", 2, 64, recurrent_layers=6, state_bytes=64 * 24),
    "gemma": ModelSpec("gemma", 1, 64, window_layers=5, window=10),
}


def _hashed(trace: traces.Trace) -> traces.Trace:
    """``trace`` with its token ids dropped: its units (hash ids) alone, as Mooncake's."""
    out = traces.Trace(trace.name, trace.block_size)
    out.requests = [dataclasses.replace(r, prompt_ids=None, output_ids=None,
                                        token_boundaries=()) for r in trace.requests]  # fmt: skip
    return out


@pytest.mark.parametrize("name", list(UNIT_SPECS))
def test_a_hash_id_trace_replays_in_its_units_as_its_tokens_do(name):
    """The engine over a trace's hash ids (`in_units`: each unit one token, page 1, the
    spec scaled to a unit) caches what it does over the token ids at page 4, request for
    request, with room to spare: prompts and answers ending inside a page (21-token
    messages, 11-token answers), outputs cached, system-prompt boundaries, two system
    prompts, checkpoints where the engine takes them (the last page an answer reached, the
    resend point) and windows. Under pressure the unit replay holds an answer's partial
    last page one unit less: it stays within 0.03 of the token replay (0.028 for the
    window model at this budget, 0.002 for the others)."""
    trace = traces.gen_chat(conversations=12, turns=3, systems=2, system_len=64,
                            message_len=21, output_len=11, block_size=4, seed=1)  # fmt: skip
    spec = UNIT_SPECS[name]
    for cap, exact in ((1 << 24, True), (40_000, False)):
        tokens = serve_result(trace, None, spec, cap, chunk_size=16)
        units = serve_result(_hashed(trace), None, spec, cap, chunk_size=16)
        assert units.prompt_tokens == tokens.prompt_tokens
        if exact:
            assert units.cached == tokens.cached and units.hit_tokens > 0
        else:
            assert abs(units.token_hit_rate - tokens.token_hit_rate) <= 0.03


def test_a_mooncake_trace_replays_through_the_engine(tmp_path, capsys):
    """``simulate --policy serve`` on Mooncake's hash ids (cut into 16-token pages): the
    engine in units, beside the budget simulator's ``radixkv`` row, which it equals with
    room to spare. A prompt's partial last block is no hit for the next request sharing
    its id (an engine caches whole pages of the tokens it computed)."""
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (
        {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]},
        {"timestamp": 1, "input_length": 1100, "output_length": 4, "hash_ids": [1, 2, 3]},
        {"timestamp": 2, "input_length": 700, "output_length": 4, "hash_ids": [1, 4]},
    )))  # fmt: skip
    out = tmp_path / "rows.json"
    assert main(["simulate", "--trace", str(path), "--model-spec", "qwen3.5-4b", "--capacity",
                 "1GiB", "--policy", "serve,radixkv", "--json", str(out)]) == 0  # fmt: skip
    rows = {r["policy"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["serve"]["cached"] == rows["radixkv"]["cached"] == [0, 592, 0]
    # an answer's unlisted units are generated, never materialized: a million-token one
    # holds no ids (it would cost the replay memory, and no later prompt names them)
    huge = traces.Trace("h", 16, [traces.SimRequest([1, 2], 2, 20, output_tokens=1 << 20)])
    replayed, limits = in_units(huge)
    r = replayed.requests[0]
    assert (list(r.prompt_ids), len(r.output_ids), r.output_tokens, limits) == (
        [258, 259], 0, (20 + (1 << 20) - 1) // 16 - 2 + 1, [2])
    assert main(["simulate", "--trace", str(path), "--model-spec", "qwen3.5-4b", "--capacity",
                 "1GiB", "--policy", "serve", "--checkpoint-every", "24"]) == 2  # fmt: skip
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --policy serve: checkpoint_every must be a multiple of the trace's block "
        "size (16), got 24"
    )


def test_the_engine_keeps_the_agent_coming_back_on_the_traces_clock(tmp_path):
    """An agentic trace through the engine with ``--eviction-policy session``
    (``serve-session``): room for little more than one session's prefix. B, an agent,
    is running a tool; A's person left (end_turn; back in 10 minutes); C arrives and
    forces one out. The engine's default order evicts most of B (its next call hits 128
    of 640 tokens); the session order, told each request's session and stop by the
    replay on the trace's clock, evicts A, and B's next call hits whole. The budget
    simulator's ``session`` row (full attention: its stamps land on each request's
    path end) keeps B too, where its ``radixkv`` row does not."""
    from test_agentic import call, conversation, write

    from radixkv.sim.agentic import load_agentic

    a = conversation([call(0.4, 640, list(range(10)), api=1.0, stop="end_turn"),
                      call(0.0, 704, list(range(11)), api=1.0, think=600.0)])  # fmt: skip
    b = conversation([call(0.0, 640, list(range(10)), api=0.5),
                      call(2.2, 704, list(range(11)), api=0.5, think=1.7)])  # fmt: skip
    c = conversation([call(1.5, 640, list(range(10)), api=0.5)])
    for name, doc in (("a", a), ("b", b), ("c", c)):
        write(tmp_path / f"{name}.json", doc)
    trace = load_agentic(tmp_path)
    assert [r.session[0] for r in trace.requests] == [1, 0, 2, 1, 0]  # b a c b a
    spec, cap = ModelSpec("full", 1, 64), 22 * 64 * 64  # 22 blocks of 64 tokens
    lru = serve_result(trace, None, spec, cap, schedule="fcfs")
    session = serve_result(trace, None, spec, cap, schedule="fcfs", eviction="session")
    assert lru.cached == [0, 0, 0, 128, 64] and lru.policy == "serve"
    assert session.cached == [0, 0, 0, 640, 64] and session.policy == "serve-session"
    model = {p: simulate_hybrid(trace, spec, cap, p).cached for p in ("radixkv", "session")}
    assert model == {"radixkv": [0, 0, 0, 64, 0], "session": [0, 0, 0, 640, 0]}
    (tmp_path / "full.spec").write_text(json.dumps({"full_layers": 1, "kv_bytes": 64}))
    out = tmp_path / "rows.json"
    assert main(["simulate", "--trace", str(tmp_path), "--format", "agentic", "--model-spec",
                 str(tmp_path / "full.spec"), "--capacity", f"{cap}B", "--policy",
                 "serve,serve-session", "--schedule", "fcfs", "--json", str(out)]) == 0  # fmt: skip
    rows = {r["policy"]: r["cached"] for r in json.loads(out.read_text())["results"]}
    assert rows == {"serve": lru.cached, "serve-session": session.cached}


def test_a_replayed_session_stops_as_its_trace_says_at_the_traces_time():
    """`add_replayed` tags a request with its session and ends its answer on EOS where
    the trace gives a stop (the same tokens cached: the last one has no KV); the
    engine's session clock is the replay's `TraceClock`."""
    from radixkv.engine.config import EngineConfig as Config
    from radixkv.sim.serve_replay import TraceClock, add_replayed, replay_engine

    def req(stop: str) -> traces.SimRequest:
        return traces.SimRequest([], 0, 6, output_tokens=3, session=("s", stop), stop=stop,
                                 prompt_ids=array("q", [300, 301, 302, 303, 304, 305]))  # fmt: skip

    trace = traces.Trace("t", 1, [req("tool_use"), req("end_turn")])
    clock = TraceClock()
    cfg = Config(cache_bytes=1 << 20, eviction_policy="session", dtype=SPEC_DTYPE)
    engine, outputs = replay_engine(trace, SpecModel(ModelSpec("m", 1, 64), 400), cfg,
                                    clock=clock)  # fmt: skip
    for i, r in enumerate(trace.requests):
        clock.now = 7.0 + i
        add_replayed(engine, outputs, i, r)
        finished = []
        while engine.has_unfinished():
            finished += [o.finish_reason for o in engine.step() if o.finished]
        assert finished == ["stop"]
        s = engine.sessions.clock.sessions[repr(r.session)]
        assert (s.end, s.stop) == (7.0 + i, r.stop)
    assert engine.cache.total_size() == 6 + 3 - 1  # prompt and answer, but the EOS


def _agents(vocab: int, page: int, seed: int = 7) -> traces.Trace:
    """Six agent sessions behind one system prompt, five calls each: a call resends the
    session's last prompt and answer (at times cut short, as Claude Code drops an
    answer's thinking: the next prompt forks below the last path) and a tool's result,
    prompts 100-500 tokens (many chunks); stops drawn (``tool_use`` back in seconds,
    ``end_turn`` in minutes), so sessions' stamps come due and go stale."""
    import random

    g = random.Random(seed)
    system = [g.randrange(3, vocab) for _ in range(96)]
    reqs = []
    for s in range(6):
        t, history = g.uniform(0, 20), list(system)
        for _ in range(5):
            history += [g.randrange(3, vocab) for _ in range(g.randrange(20, 90))]
            out = [g.randrange(3, vocab) for _ in range(g.randrange(5, 30))]
            stop = g.choice(("tool_use", "tool_use", "end_turn"))
            reqs.append(traces.SimRequest(
                [], 0, len(history), timestamp=round(t * 1000), output_tokens=len(out),
                prompt_ids=array("q", history), output_ids=array("q", out),
                session=(s,), stop=stop, duration_ms=1000.0))  # fmt: skip
            if s < 2 and g.random() < 0.5:  # two sub-agents on the history so far
                task = [g.randrange(3, vocab) for _ in range(40)]
                for k in range(2):
                    own = history + task + [g.randrange(3, vocab) for _ in range(12)]
                    reqs.append(traces.SimRequest(
                        [], 0, len(own), timestamp=round(t * 1000) + 1, output_tokens=8,
                        prompt_ids=array("q", own), output_ids=array("q", own[:8]),
                        session=(s, len(reqs), k), stop="tool_use", duration_ms=500.0))  # fmt: skip
            t += 1 + (g.uniform(1, 5) if stop == "tool_use" else g.uniform(30, 120))
            history += out if g.random() < 0.5 else out[: len(out) // 2]
    reqs.sort(key=lambda r: r.timestamp)
    return traces.Trace("agents", page, reqs)


@pytest.mark.parametrize("spec", [ModelSpec("full", 2, 64),
                                  ModelSpec("rec", 2, 64, recurrent_layers=6, state_bytes=2560)])
@pytest.mark.parametrize("eviction", ["lru", "session"])
@pytest.mark.parametrize("concurrency", [1, 4])
def test_a_prompt_computed_in_one_step_caches_what_its_chunks_do(spec, eviction, concurrency):
    """A replay computes a run of a prompt's chunks in one step where they decide
    nothing (`Scheduler.prefill_run`: running alone, no waiting request it could let in,
    nothing of the run in the tree; with recurrent layers, up to where a snapshot is
    taken or passed, within free memory, inserted chunk by chunk: one budget's rounds
    read node ends); under pressure, with the default order and the session order (whose
    stale stamps must not depend on how a path is split into nodes), each request caches
    exactly what it does one chunk and one token a step, and the engine holds the same
    bytes, checkpoints included, in fewer steps."""
    trace = _agents(400, 4)
    model = SpecModel(spec, 400)
    cfg = EngineConfig(page_size=4, chunk_size=16, eviction_policy=eviction,
                       dtype=SPEC_DTYPE, check_memory=True)  # fmt: skip
    budget = (800 if spec.state_bytes == 0 else 1000) * 2 * 64  # (tokens x bytes a token)
    one = replay_serve(trace, model, budget, cfg, concurrency=concurrency, runs=False)
    run = replay_serve(trace, model, budget, cfg, concurrency=concurrency)
    assert 0 < one.hit_tokens < one.prompt_tokens and not one.refused
    assert run.cached == one.cached
    assert (run.preemptions, run.mean_bytes, run.checkpoints) == (
        one.preemptions, one.mean_bytes, one.checkpoints)  # fmt: skip
    roomy = replay_serve(trace, model, 8 * budget, cfg, concurrency=concurrency)
    assert roomy.hit_tokens > one.hit_tokens  # (the budget evicts)
    assert run.steps < one.steps * (0.6 if eviction == "lru" else 0.85)  # (a session's
    # answer stops on EOS, so it decodes a token a step: no decode runs there)


def test_a_prompt_run_under_one_budget_with_checkpoints_takes_free_memory_alone():
    """One budget over checkpoints evicts in rounds that read the leaves as a round
    starts (a dead parent a round uncovers waits for the next), so one ask for a run's
    slots may free other victims than its chunks' asks (seen on a real agentic trace:
    +512 tokens for one request): a run there takes free memory alone, evicting nothing
    (`CacheManager.run_room`); the full KV's own order takes what can be had."""
    trace = _agents(400, 4)
    hybrid = SpecModel(ModelSpec("rec", 2, 64, recurrent_layers=6, state_bytes=2560), 400)
    for model, rounds in ((hybrid, True), (SpecModel(ModelSpec("full", 2, 64), 400), False)):
        cfg = EngineConfig(page_size=4, chunk_size=16, dtype=SPEC_DTYPE, cache_bytes=1000 * 128)
        engine, outputs = replay_engine(trace, model, cfg)
        for i, req in enumerate(trace.requests[:12]):
            add_replayed(engine, outputs, i, req)
            while engine.has_unfinished():
                engine.step()
        mgr = engine.mgr
        assert mgr.allocator.available_size() < mgr.available_tokens()  # (some evictable)
        free = mgr.allocator.available_size()
        assert mgr.run_room() == (free if rounds else mgr.available_tokens())


def test_a_prompt_run_with_recurrent_layers_and_separate_pools_caches_what_its_chunks_do():
    """The same with a recurrent model's separate pools (SGLang's split of the bytes:
    the tree's own order and a checkpoint pool of its own): runs of free and evictable
    memory, inserted at once."""
    trace = _agents(400, 4)
    model = SpecModel(ModelSpec("rec", 2, 64, recurrent_layers=6, state_bytes=2560), 400)
    cfg = EngineConfig(page_size=4, chunk_size=16, dtype=SPEC_DTYPE, check_memory=True,
                       cache_bytes=1000 * 2 * 64, cache_split="sglang")  # fmt: skip
    one = replay_serve(trace, model, cfg.cache_bytes, cfg, concurrency=4, runs=False)
    run = replay_serve(trace, model, cfg.cache_bytes, cfg, concurrency=4)
    roomy = replay_serve(trace, model, 8 * cfg.cache_bytes, cfg, concurrency=4)
    assert 0 < one.hit_tokens < roomy.hit_tokens and run.steps < one.steps * 0.7
    assert (run.cached, run.preemptions, run.mean_bytes, run.checkpoints) == (
        one.cached, one.preemptions, one.mean_bytes, one.checkpoints)  # fmt: skip
