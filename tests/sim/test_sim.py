"""The simulator: independent ceilings, Belady as an upper bound, policy orderings on
crafted traces, loaders, capacity parsing and the command line."""

from __future__ import annotations

import json

import pytest
from support.traces import random_trace

from radixkv.cli import main
from radixkv.sim.replay import reuse_ceiling, simulate
from radixkv.sim.sweep import MODELS, parse_capacity, sweep
from radixkv.sim.traces import (
    GENERATORS,
    SimRequest,
    Trace,
    load_mooncake,
    load_token_jsonl,
)
from radixkv.tree.policy import POLICIES


def cyclic_trace(prompts: int, rounds: int) -> Trace:
    """Prompts 0..k-1 of 1 unit each, requested in a loop."""
    trace = Trace("cyclic", 1)
    for _ in range(rounds):
        for p in range(prompts):
            trace.requests.append(SimRequest([p], 1, 1))
    return trace


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_unbounded_replay_equals_the_independent_ceiling(name):
    small = {
        "shared-prefix": dict(groups=6, prompts_per_group=5, system_len=256),
        "multi-turn": dict(conversations=8, turns=4),
        "few-shot": dict(requests=60),
        "chat": dict(conversations=8, turns=3),
    }[name]
    trace = GENERATORS[name](**small)
    for outputs in (False, True):
        r = simulate(trace, None, "lru", cache_outputs=outputs)
        assert r.token_hit_rate == pytest.approx(reuse_ceiling(trace, outputs))
        assert r.evicted_units == 0


@pytest.mark.parametrize("name", ["multi-turn", "chat"])
def test_a_turn_never_arrives_with_the_turn_it_follows(name):
    """Generated chats carry arrival waves: requests of one timestamp arrive together
    (the serve replay, ``--schedule lpm``), and a turn, whose prompt holds the previous
    turn's prompt and answer, comes in a later wave than it; the waves never go back."""
    trace = GENERATORS[name](conversations=12, turns=4)
    reqs = trace.requests
    stamps = [r.timestamp for r in reqs]
    assert stamps == sorted(stamps) and len(set(stamps)) > 4
    follows = 0
    for i, a in enumerate(reqs):
        seen = list(a.units[: a.num_prompt_units])
        for b in reqs[i + 1 :]:
            if list(b.units[: len(seen)]) == seen and b.num_prompt_units > len(seen):
                assert b.timestamp > a.timestamp
                follows += 1
    assert follows >= 12 * 3  # every turn after the first follows one


def test_shared_prefix_ceiling_is_what_the_workload_implies():
    trace = GENERATORS["shared-prefix"](
        groups=4, prompts_per_group=8, system_len=320, question_len=64, output_len=16, block_size=16
    )
    # each group's 320-token prompt is computed once and hit by the other 7 requests
    expected = 4 * 7 * 320 / (32 * 384)
    assert reuse_ceiling(trace) == pytest.approx(expected)


@pytest.mark.parametrize("seed", range(6))
def test_belady_is_an_upper_bound_for_every_policy(seed):
    trace = random_trace(seed)
    for cap in (2, 4, 8, 16):
        best = simulate(trace, cap, "belady", check_every=7).hit_tokens
        for policy in POLICIES:
            assert simulate(trace, cap, policy, check_every=7).hit_tokens <= best, (policy, cap)


def test_policies_order_as_expected_on_crafted_traces():
    # A loop over 3 prompts with room for 2: LRU always evicts the next one needed.
    loop = cyclic_trace(3, 20)
    assert simulate(loop, 2, "lru").hit_tokens == 0
    assert simulate(loop, 2, "mru").hit_tokens > 0
    assert simulate(loop, 2, "belady").hit_tokens >= simulate(loop, 2, "mru").hit_tokens
    # A hot prompt (asked twice in a row) among one-off ones: LFU keeps it, FIFO does not.
    trace = Trace("hot", 1)
    for i in range(60):
        trace.requests.append(SimRequest([0], 1, 1))
        trace.requests.append(SimRequest([0], 1, 1))
        trace.requests.append(SimRequest([1000 + i], 1, 1))
        trace.requests.append(SimRequest([2000 + i], 1, 1))
    assert simulate(trace, 2, "lfu").hit_tokens > simulate(trace, 2, "fifo").hit_tokens


def test_more_capacity_never_hurts_lru_and_warmup_is_excluded():
    trace = GENERATORS["multi-turn"](conversations=10, turns=4)
    rates = [
        simulate(trace, c, "lru", cache_outputs=True).token_hit_rate
        for c in (50, 100, 200, 400, None)
    ]
    assert rates == sorted(rates)
    warm = simulate(trace, None, "lru", warmup=0.5)
    assert warm.requests == len(trace.requests) - len(trace.requests) // 2


def test_sweep_matches_single_runs_in_parallel():
    trace = random_trace(1)
    results = sweep(trace, [3, None], ["lru", "fifo"], workers=2)
    assert [(r.policy, r.capacity_units) for r in results] == [
        ("lru", 3),
        ("lru", None),
        ("fifo", 3),
        ("fifo", None),
    ]
    for r in results:
        assert r == simulate(trace, r.capacity_units, r.policy)


def test_mooncake_loader_and_block_hits(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 5, "input_length": 700, "output_length": 5, "hash_ids": [1, 9]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    trace = load_mooncake(path)
    assert trace.block_size == 512 and trace.requests[0].prompt_tokens == 1100
    r = simulate(trace, None, "lru")
    assert r.hit_tokens == 512 and r.block_hit_rate == pytest.approx(1 / 5)
    path.write_text('{"input_length": 3}\n')
    with pytest.raises(ValueError, match="Mooncake"):
        load_mooncake(path)


def test_token_loader_interns_prefixes_and_namespaces(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [
        {"token_ids": list(range(40)), "output_length": 3},
        {"token_ids": list(range(36)) + [7, 7, 7, 7]},
        {"token_ids": list(range(40)), "extra_key": "other"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    trace = load_token_jsonl(path, block_size=16)
    a, b, c = trace.requests
    assert a.units[:2] == b.units[:2] and a.num_prompt_units == 2
    assert not set(c.units) & set(a.units)  # another namespace shares nothing
    assert simulate(trace, None, "lru").hit_tokens == 32


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1M", 1_000_000 // 16),
        ("512k", 32_000),
        ("2000blocks", 2000),
        ("8GB", 8 * 10**9 // MODELS["llama-3-8b"] // 16),
        ("inf", None),
        ("1GiB", 2**30 // MODELS["llama-3-8b"] // 16),
    ],
)
def test_parse_capacity(text, expected):
    assert parse_capacity(text, 16, MODELS["llama-3-8b"]) == expected


@pytest.mark.parametrize("bad", ["lots", "1Q", "-5", "2000b", "8"])
def test_parse_capacity_rejects_nonsense(bad):
    with pytest.raises(ValueError, match="capacity"):
        parse_capacity(bad, 16)
    with pytest.raises(ValueError, match="--model"):
        parse_capacity("8GiB", 16)


def test_simulate_command_writes_table_json_csv_and_plot(tmp_path, capsys):
    out = tmp_path / "r.json"
    plot = tmp_path / "hit.png"
    code = main(
        [
            "simulate",
            "--workload",
            "shared-prefix",
            "--requests",
            "200",
            "--capacity",
            "8k,32k,inf",
            "--policy",
            "lru,belady",
            "--json",
            str(out),
            "--csv",
            str(tmp_path / "r.csv"),
            "--plot",
            str(plot),
            "--workers",
            "1",
        ]
    )
    assert code == 0
    data = json.loads(out.read_text())
    assert len(data["results"]) == 6 and 0 < data["reuse_ceiling"] <= 1
    assert plot.stat().st_size > 1000
    assert "belady" in capsys.readouterr().out
    assert (tmp_path / "r.csv").read_text().startswith("trace,policy")


def test_simulate_command_reports_bad_arguments(capsys):
    assert main(["simulate", "--workload", "few-shot", "--policy", "random"]) == 2
    assert main(["simulate", "--trace", "/nonexistent.jsonl"]) == 2
    assert main(["simulate", "--capacity", "8GiB"]) == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize("seed", range(4))
def test_block_scope_lru_equals_tree_lru(seed):
    """Two independent replays (the radix tree, a flat ordered set refreshed tail first)
    agree exactly for LRU: evicting a leaf's tail is evicting the least recent blocks."""
    trace = random_trace(seed, requests=200)
    for cap in (2, 5, 9, None):
        assert (
            simulate(trace, cap, "lru", scope="block").hit_tokens
            == simulate(trace, cap, "lru").hit_tokens
        )


def test_block_scope_fifo_can_evict_a_shared_head():
    trace = Trace("head", 1)
    for i in range(1, 5):  # one shared head block, then a block of its own each
        trace.requests.append(SimRequest([0, i], 2, 2))
    # block FIFO evicts the shared head first (the oldest block); a tree evicts leaves
    assert simulate(trace, 3, "fifo", scope="block").hit_tokens == 2
    assert simulate(trace, 3, "fifo").hit_tokens == 3
    with pytest.raises(ValueError, match="block scope"):
        simulate(trace, 3, "belady", scope="block")


def test_text_traces_are_tokenized_with_the_named_tokenizer(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    rows = [
        {"text": "You are a helpful assistant. Question one?"},
        {"text": "You are a helpful assistant. Question two?"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "r.json"
    assert (
        main(
            [
                "simulate",
                "--trace",
                str(path),
                "--tokenizer",
                "byte",
                "--block-size",
                "4",
                "--capacity",
                "inf",
                "--policy",
                "lru",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())["results"][0]
    assert result["hit_tokens"] == 36  # "You are a helpful assistant. Questi" in whole blocks
    assert main(["simulate", "--trace", str(path)]) == 2  # text without a tokenizer
