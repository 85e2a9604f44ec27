"""The hybrid simulator: model specs, the Marconi trace format, Mooncake pages, the
policies side by side on the same requests, and ``radixkv simulate --model-spec``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.traces import marconi_chats

from radixkv.sim import traces
from radixkv.sim.hybrid import (
    PRESETS,
    UNBOUNDED,
    ModelSpec,
    model_spec,
    simulate_hybrid,
    sweep_hybrid,
    window_bytes_per_token,
)


def test_presets_and_vllm_block():
    # vLLM's align mode: the attention block grows until one layer's page holds a state
    assert PRESETS["qwen3.5-4b"].vllm_block() == 528
    assert PRESETS["nemotron-h"].vllm_block() == 1040
    assert PRESETS["gemma-3"].vllm_block() == 16
    q = PRESETS["qwen3.5-4b"]
    assert q.checkpoint == 24 * 528 * 4096 and q.full_kv == 8 * 4096


def test_model_spec_from_json(tmp_path):
    good = tmp_path / "tiny.json"
    good.write_text(json.dumps({"full_layers": 2, "kv_bytes": 512, "recurrent_layers": 6,
                                "state_bytes": 65536}))  # fmt: skip
    spec = model_spec(str(good))
    assert spec.name == "tiny" and spec.checkpoint == 6 * 65536
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"full_layers": 2, "kv_bytes": 512, "sliding": 4}))
    with pytest.raises(ValueError, match="unknown fields \\['sliding'\\]"):
        model_spec(str(bad))
    with pytest.raises(ValueError, match="window_layers and window"):
        ModelSpec("x", 1, 1, window_layers=3)
    with pytest.raises(ValueError, match="kv_bytes must be an int"):
        ModelSpec("x", 1, 1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a preset"):
        model_spec("qwen9")


def chat(**kw):
    return traces.gen_chat(conversations=24, turns=4, **kw)


def rates(trace, spec, cap):
    return {p: simulate_hybrid(trace, spec, cap, p).token_hit_rate
            for p in ("radixkv", "marconi", "sglang", "vllm")}  # fmt: skip


@pytest.mark.parametrize("name", ["qwen3.5-4b", "nemotron-h"])
def test_radixkv_leads_on_chat_at_equal_bytes(name):
    spec = PRESETS[name]
    trace = chat()
    total = sum(r.prompt_tokens + r.output_tokens for r in trace.requests) * spec.full_kv
    for frac in (0.05, 0.25):
        r = rates(trace, spec, int(frac * total))
        assert r["radixkv"] >= max(r["marconi"], r["sglang"]), (frac, r)
        # (Qwen3.5-like: 2.9x at 5%, 1.9x at 25%; Nemotron-H-like: 4.5x, 2.3x)
        assert r["radixkv"] >= 1.8 * r["vllm"], (frac, r)
    # unbounded: radixkv's boundaries add the second conversation behind each system
    # prompt; Marconi's simulator caches a turn's whole output, SGLang (as every engine)
    # all but its last token, whose KV is never computed, so its next turn starts a
    # little earlier; vLLM's grid loses up to a block
    r = rates(trace, spec, UNBOUNDED)
    assert r["radixkv"] > r["marconi"] > r["sglang"] > r["vllm"]


def test_a_shared_prefix_shorter_than_vllms_block_hits():
    """A 256-token system prompt: below Qwen3.5's 528-token block, vLLM align never
    hits it; radixkv does from the second request (a boundary) on."""
    spec = PRESETS["qwen3.5-4b"]
    trace = traces.gen_chat(conversations=16, turns=1, systems=1, system_len=256)
    res = {p: simulate_hybrid(trace, spec, UNBOUNDED, p, cache_outputs=False)
           for p in ("radixkv", "vllm")}  # fmt: skip
    assert res["vllm"].hit_tokens == 0
    assert res["radixkv"].hit_tokens == 15 * 256


def test_gemma_window_freeing_bytes_per_token():
    """Window KV only where a match can end: at 16k-token prefixes a cached token costs
    under a quarter of what it costs with every window layer's KV kept."""
    spec = PRESETS["gemma-3"]
    trace = traces.gen_shared_prefix(groups=2, prompts_per_group=3, system_len=16384,
                                     question_len=128, output_len=0)  # fmt: skip
    ends = window_bytes_per_token(trace, spec, "ends")
    assert window_bytes_per_token(trace, spec, "all") == spec.full_kv + spec.window_kv
    assert ends <= 0.25 * (spec.full_kv + spec.window_kv)
    # and the hit rate is the same
    a = simulate_hybrid(trace, spec, UNBOUNDED, "radixkv", cache_outputs=False)
    b = simulate_hybrid(trace, spec, UNBOUNDED, "vllm", cache_outputs=False)
    assert a.hit_tokens == b.hit_tokens > 0


def test_sweep_rejects_unknown_policy():
    with pytest.raises(ValueError, match="unknown 'lfu'"):
        sweep_hybrid(chat(), PRESETS["gemma-3"], [1 << 30], ["lfu"])


# --- traces ------------------------------------------------------------------------------
def write(tmp_path, rows):
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_marconi_trace_counts_and_lists(tmp_path):
    rows = [
        {"session_id": "a", "turn_id": 0, "ts": 0.0, "input_tokens": 40, "output_tokens": 8},
        {"session_id": "b", "turn_id": 0, "ts": 0.5, "input_tokens": list(range(32)),
         "output_tokens": [1, 2]},
        {"session_id": "a", "turn_id": 1, "ts": 1.0, "input_tokens": 64, "output_tokens": 8},
    ]  # fmt: skip
    path = write(tmp_path, rows)
    assert traces.guess_format(path) == "marconi"
    t = traces.load_trace(path, block_size=8)
    assert [r.prompt_tokens for r in t.requests] == [40, 32, 64]
    a0, a1 = t.requests[0], t.requests[2]
    # turn 1 of session a is turn 0's prompt and output, then fresh tokens
    assert a1.units[: len(a0.units)] == a0.units and len(a0.units) == 6
    assert t.requests[0].timestamp == 0.0 and t.requests[2].timestamp == 1000.0


def test_a_trace_that_carries_outputs_caches_them_by_default(tmp_path):
    """Marconi's traces carry each turn's output and Marconi caches it: simulate's
    default does too (it left them out unless told, and fell behind Marconi's own
    results); Mooncake's carry none."""
    rows = [{"session_id": s, "turn_id": t, "ts": float(t), "input_tokens": 64 * (t + 1),
             "output_tokens": 32} for t in range(4) for s in "abc"]  # fmt: skip
    path = write(tmp_path, rows)
    assert traces.load_trace(path, block_size=16).carries_outputs()
    rates = {}
    for flag in ([], ["--cache-outputs"], ["--no-cache-outputs"]):
        out = tmp_path / "r.json"
        r = cli("--trace", str(path), "--model-spec", "qwen3.5-4b", "--capacity", "inf",
                "--policy", "radixkv", "--json", str(out), *flag)  # fmt: skip
        assert r.returncode == 0, r.stderr
        rates[tuple(flag)] = json.loads(out.read_text())["results"][0]["token_hit_rate"]
    assert rates[()] == rates[("--cache-outputs",)] > rates[("--no-cache-outputs",)]


@pytest.mark.parametrize(
    "rows, msg",
    [
        ([{"session_id": "a", "turn_id": 0, "ts": 0, "input_tokens": 4}], "needs output_tokens"),
        ([{"session_id": "a", "turn_id": 0, "ts": 0, "input_tokens": 40, "output_tokens": 8},
          {"session_id": "a", "turn_id": 1, "ts": 1, "input_tokens": 20, "output_tokens": 8}],
         "shorter than session 'a'"),
        ([{"session_id": "a", "turn_id": 1, "ts": 0, "input_tokens": 4, "output_tokens": 1},
          {"session_id": "a", "turn_id": 1, "ts": 1, "input_tokens": 9, "output_tokens": 1}],
         "turn 1 after turn 1"),
        ([{"session_id": [1], "turn_id": 0, "ts": 0, "input_tokens": 4, "output_tokens": 1}],
         "session_id must be"),
    ],
)  # fmt: skip
def test_marconi_trace_errors_name_the_line(tmp_path, rows, msg):
    path = write(tmp_path, rows)
    with pytest.raises(traces.TraceError, match=msg) as e:
        traces.load_trace(path, "marconi")
    assert str(e.value).startswith(f"{path}:")


def test_mooncake_blocks_split_into_pages(tmp_path):
    path = write(tmp_path, [{"timestamp": 0, "input_length": 700, "output_length": 5,
                             "hash_ids": [3, 9]}])  # fmt: skip
    t = traces.split_blocks(traces.load_trace(path), 64)
    (r,) = t.requests
    assert t.block_size == 64 and r.prompt_tokens == 700
    assert r.units == [3 * 8 + j for j in range(8)] + [9 * 8 + j for j in range(3)]
    assert not t.carries_outputs()  # (an output's length, not its blocks: none cached)
    with pytest.raises(ValueError, match="does not divide"):
        traces.split_blocks(traces.load_trace(path), 48)


def test_token_trace_boundaries(tmp_path):
    rows = [{"token_ids": list(range(40)), "boundaries": [17, 32]}]
    t = traces.load_trace(write(tmp_path, rows), block_size=16)
    assert t.requests[0].boundaries == (1, 2)
    with pytest.raises(traces.TraceError, match="within the prompt"):
        traces.load_trace(write(tmp_path, [{"token_ids": [1, 2], "boundaries": [5]}]))


# --- the command line --------------------------------------------------------------------
def cli(*args):
    return subprocess.run([sys.executable, "-m", "radixkv.cli", "simulate", *args],
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_cli_model_spec(tmp_path):
    out = tmp_path / "r.json"
    r = cli("--model-spec", "qwen3.5-4b", "--workload", "chat", "--requests", "60",
            "--capacity", "1GiB,inf", "--json", str(out))  # fmt: skip
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["model"]["name"] == "qwen3.5-4b-like"
    got = {(x["policy"], x["capacity_bytes"]): x for x in data["results"]}
    assert len(got) == 12 and got[("vllm", UNBOUNDED)]["block_tokens"] == 528
    assert got[("vllm+", UNBOUNDED)]["block_tokens"] == 32  # Marconi's vLLM+ grid
    assert got[("radixkv", 1 << 30)]["token_hit_rate"] > got[("vllm", 1 << 30)]["token_hit_rate"]


@pytest.mark.parametrize("family", ["qwen3.5", "gemma3", "mistral"])
def test_model_spec_from_a_folder_counts_the_bytes_the_engine_holds(tmp_path, family):
    """--model-spec FOLDER: the spec read from config.json alone costs a token, a window
    token and a checkpoint what the engine serving that folder holds for them."""
    from radixkv.cli import main
    from radixkv.engine.engine import Engine

    folder = tmp_path / family
    assert main(["make-model", family, str(folder)]) == 0
    if family == "mistral":  # every layer slides: no full KV for the budget to count
        with pytest.raises(ValueError, match="no full-attention layer"):
            model_spec(str(folder))
        assert cli("--model-spec", str(folder), "--workload", "chat").returncode == 2
        return
    spec = model_spec(str(folder))
    engine = Engine(str(folder), kv_tokens=1024, page_size=16, max_context_len=512)
    assert spec.name == family and spec.full_kv == engine.kv.bytes_per_token()
    assert spec.params == sum(p.numel() for p in engine.model.parameters())
    if family == "gemma3":
        assert (spec.window_layers, spec.window) == (5, 64) and not spec.recurrent_layers
        assert spec.window_kv == engine.kv.window_bytes_per_token() > 0
    else:
        assert (spec.full_layers, spec.recurrent_layers, spec.window) == (1, 3, 0)
        assert spec.checkpoint == engine.recurrent.row_size > 0
    r = cli("--model-spec", str(folder), "--workload", "chat", "--requests", "40",
            "--capacity", "2MiB,inf", "--policy", "radixkv")  # fmt: skip
    assert r.returncode == 0 and family in r.stdout, r.stderr


@pytest.mark.parametrize(
    "args, msg",
    [
        (["--model-spec", "qwen3.5-4b", "--tiers"], "--tiers: not with --model-spec"),
        (["--model-spec", "qwen3.5-4b", "--policy", "lru"], "--policy: unknown 'lru'"),
        (["--model-spec", "nope"], "--model-spec: "),
        (["--model-spec", "gemma-3", "--capacity", "3b"], "--capacity: "),
        (["--checkpoint-every", "64"], "--checkpoint-every: only with --model-spec"),
        (
            ["--model-spec", "qwen3.5-4b", "--policy", "vllm", "--checkpoint-every", "64"],
            "--checkpoint-every: only for the radixkv policy",
        ),
        (
            ["--model-spec", "qwen3.5-4b", "--policy", "radixkv", "--checkpoint-every", "24"],
            "--checkpoint-every must be a multiple of the trace's block size (16)",
        ),
        (
            ["--model-spec", "gemma-3", "--policy", "radixkv", "--checkpoint-every", "64"],
            "--checkpoint-every: gemma-3-like has no recurrent layers",
        ),
    ],
)
def test_cli_model_spec_errors(args, msg):
    r = cli(*args, "--workload", "chat", "--requests", "5")
    assert r.returncode == 2 and r.stderr.startswith(f"error: {msg}"), r.stderr


def test_a_prompt_cached_alone_is_checkpointed_on_its_whole_pages(tmp_path):
    """Without outputs, a Mooncake prompt's trailing partial block is cached KV but no
    checkpoint lies past its whole pages (one engine-planned checkpoint: its end)."""
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 600, "output_length": 4,
                                "hash_ids": [1, 2]}) + "\n")  # fmt: skip
    trace = traces.load_trace(path)
    r = simulate_hybrid(trace, PRESETS["qwen3.5-4b"], UNBOUNDED, "radixkv", cache_outputs=False)
    assert r.checkpoints == 1


def test_vllm_pads_a_state_to_its_page_in_every_layer():
    """vLLM's align mode keeps one layer's state in a page of the attention block's size:
    Marconi's 7B hybrid (80-token blocks: 1,310,720-byte pages for 1,116,160-byte
    states) pays the page, as vLLM's own block pool does."""
    spec = ModelSpec("m7b", 4, 16384, recurrent_layers=24, state_bytes=1116160)
    assert spec.vllm_block() == 80
    assert spec.vllm_checkpoint() == 24 * 80 * 16384 > spec.checkpoint
    exact = ModelSpec("q", 8, 4096, recurrent_layers=24, state_bytes=528 * 4096)
    assert exact.vllm_checkpoint() == exact.checkpoint  # a state that fills its page


def test_sglang_drops_a_leaf_whose_state_it_evicts(monkeypatch):
    """SGLang's state pool, full, evicts its least recently used state, and a leaf goes
    with its state (its KV past the last state is dead to the recurrent layers); the
    full pool meanwhile has room. radixkv's own policies keep such KV (a later state can
    still use it)."""
    from radixkv.sim.hybrid import _Sim  # (a test may reach inside the simulator)
    from radixkv.sim.traces import SimRequest, Trace

    spec = PRESETS["qwen3.5-4b"]
    a = SimRequest(list(range(100, 200)), 100, 100)
    b = SimRequest(list(range(500, 600)), 100, 100)
    cap = int(1.5 * spec.checkpoint * 1.9 / 0.9)  # one state; KV for ~2,500 tokens
    sim = _Sim(Trace("two", 1, [a, b]), spec, cap, "sglang")
    assert sim.state.max_states == 1
    sim.serve(a, False)
    (leaf_a,) = [n for n in sim.cache.iter_nodes() if not n.children]
    sim.serve(b, False)  # b's state evicts a's, and a's leaf with it
    assert leaf_a.parent is None and sim.cache.total_size() == 100
    sim.cache.check_integrity()
    monkeypatch.setattr(_Sim, "_drop_stateless_leaves", lambda self, gone: None)
    kept = _Sim(Trace("two", 1, [a, b]), spec, cap, "sglang")  # the rule off: a's KV stays
    kept.serve(a, False)
    kept.serve(b, False)
    assert kept.cache.total_size() == 200


def test_sglang_frees_whole_leaves():
    """SGLang's ``evict(num_tokens)`` removes whole leaves (it may overshoot by a leaf);
    the row does not trim a tail as radixkv's precise mode does."""
    from radixkv.sim.hybrid import _Sim
    from radixkv.sim.traces import SimRequest, Trace

    spec = ModelSpec("tiny-states", 8, 4096, recurrent_layers=1, state_bytes=4096)
    a = SimRequest(list(range(100, 200)), 100, 100)
    b = SimRequest(list(range(500, 600)), 100, 100)
    cap = int(150 * spec.full_kv * 1.9)  # the full pool holds 150 tokens; states aplenty
    sim = _Sim(Trace("two", 1, [a, b]), spec, cap, "sglang")
    sim.serve(a, False)
    sim.serve(b, False)  # 50 tokens over: a's whole leaf goes, not its last 50
    assert sim.cache.total_size() == 100 and sim.cache.match_len([*range(100, 200)]) == 0


def test_the_kv_reported_counts_what_the_tree_holds_without_a_state_there():
    """Two prompts share 64 tokens; the first has no checkpoint there (the branch point is
    not one yet), so the second hits nothing, but the tree held those 64 tokens' KV, and
    ``on_request`` says so (what --by-request calls "KV held, no state")."""
    from radixkv.sim.traces import SimRequest, Trace

    spec = ModelSpec("tiny-states", 8, 4096, recurrent_layers=1, state_bytes=4096)
    shared = list(range(1000, 1064))
    a = SimRequest([*shared, *range(1, 37)], 100, 100)
    b = SimRequest([*shared, *range(2001, 2037)], 100, 100)
    seen: list[tuple[int, int | None]] = []
    simulate_hybrid(Trace("two", 1, [a, b]), spec, 10**9, "radixkv", False,
                    on_request=lambda _r, hit, kv: seen.append((hit, kv)))  # fmt: skip
    assert seen == [(0, 0), (0, 64)]


def test_checkpoint_every_lets_a_prefix_hit_the_first_time_it_is_shared():
    """As the engine's ``checkpoint_every``: two prompts share 64 tokens, inside the
    first's node; on a 32-token grid the second resumes from 64, without one from 0."""
    from radixkv.sim.traces import SimRequest, Trace

    spec = ModelSpec("tiny-states", 8, 4096, recurrent_layers=1, state_bytes=4096)
    shared = list(range(1000, 1064))
    a = SimRequest([*shared, *range(1, 37)], 100, 100)
    b = SimRequest([*shared, *range(2001, 2037)], 100, 100)
    trace = Trace("two", 1, [a, b])
    hits = {}
    for every in (0, 32):
        seen: list[int] = []
        simulate_hybrid(trace, spec, 10**9, "radixkv", False, checkpoint_every=every,
                        on_request=lambda _r, hit, _kv, seen=seen: seen.append(hit))  # fmt: skip
        hits[every] = seen
    assert hits == {0: [0, 0], 32: [0, 64]}


@pytest.mark.parametrize(
    ("every", "policy", "spec", "match"),
    [
        (-1, "radixkv", "qwen3.5-4b", "non-negative int"),
        (True, "radixkv", "qwen3.5-4b", "non-negative int"),
        (32, "vllm", "qwen3.5-4b", "the radixkv policy's"),
        (32, "radixkv", "gemma-3", "no recurrent layers"),
        (24, "radixkv", "qwen3.5-4b", "multiple of the trace's block size"),
    ],
)
def test_checkpoint_every_refuses_what_the_engine_would(every, policy, spec, match):
    from radixkv.sim.hybrid import PRESETS
    from radixkv.sim.traces import gen_chat

    trace = gen_chat(conversations=2, turns=1, systems=1, system_len=32, message_len=16,
                     output_len=8)  # fmt: skip
    with pytest.raises(ValueError, match=match):
        simulate_hybrid(trace, PRESETS[spec], 10**9, policy, checkpoint_every=every)


def test_each_requests_hit_and_the_kv_the_tree_found_are_reported(tmp_path):
    """``simulate_hybrid(on_request=...)``: the hits add up to the row's, and a tree row's
    KV found is at least its hit (bench_marconi --by-request reads both)."""
    chats = marconi_chats(tmp_path / "chats.jsonl", sessions=8)
    trace = traces.load_trace(str(chats), "marconi", 1)
    spec = ModelSpec("small", full_layers=4, kv_bytes=16384, recurrent_layers=24,
                     state_bytes=1116160)  # fmt: skip
    for policy, tree in (("radixkv", True), ("marconi", False), ("vllm", False)):
        seen: list[tuple[int, int | None]] = []

        def note(_req, hit, kv, seen=seen):  # type: ignore[no-untyped-def]
            seen.append((hit, kv))

        row = simulate_hybrid(trace, spec, 10**9, policy, on_request=note)
        assert len(seen) == len(trace.requests) and sum(h for h, _ in seen) == row.hit_tokens
        assert all((kv is not None and kv >= hit) if tree else kv is None for hit, kv in seen)
        assert any(hit for hit, _ in seen)


def _agent(units: range, at_s: float, session: str, stop: str) -> traces.SimRequest:
    req = traces.SimRequest(list(units), len(units), len(units), at_s * 1000.0)
    req.session, req.stop, req.duration_ms = session, stop, 1000.0
    return req


@pytest.mark.parametrize("policy", ["session", "radixkv"])
def test_the_hybrid_session_order_keeps_the_agent_back_from_a_tool_over_the_person_who_left(
    policy,
):
    """radixkv's budget in the stamped session order (``--policy session`` with a model
    spec): A stopped on a tool call, B (later) ended its turn, C then needs room. The
    session order drops B's checkpoint and KV; the budget's own order (recency and
    worth) drops A's, the older. Stop reasons are read only once each answer ended
    (B's at 21 s, before C arrives at 30 s)."""
    from radixkv.sim.hybrid import _Sim  # (a test may reach inside the simulator)

    Trace = traces.Trace
    spec = ModelSpec("q", 8, 4096, recurrent_layers=24, state_bytes=1 << 16)
    a = _agent(range(1000, 1400), 0.0, "A", "tool_use")
    b = _agent(range(2000, 2400), 20.0, "B", "end_turn")
    c = _agent(range(3000, 3500), 30.0, "C", "end_turn")
    cap = 920 * spec.full_kv + 4 * spec.arena_checkpoint(1)  # A, B and C do not fit together
    sim = _Sim(Trace("agents", 1, [a, b, c]), spec, cap, policy)
    for req in (a, b, c):
        sim.serve(req, False)
    kept = {k: sim.cached_prefix(r) for k, r in (("A", a), ("B", b))}
    keeper, victim = ("A", "B") if policy == "session" else ("B", "A")
    assert kept[keeper] >= 399 and kept[victim] == 0, kept
    assert simulate_hybrid(Trace("agents", 1, [a, b, c]), spec, cap, policy).policy == policy
