"""`plan_memory` (`radixkv.kvcache.plan`): every size of a cache from a model's layer
specs and the memory knobs, with no model, no tensor and no device. Checked as a
property over random models and knobs (a plan either names the knob that cannot size
the model, or holds the module's invariants), and against what an engine built from
it allocates."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from radixkv.engine.config import EngineConfig
from radixkv.engine.engine import Engine
from radixkv.kvcache.plan import CacheConfig, plan_memory
from radixkv.kvcache.spec import LayerSpecs, RecurrentSpec
from radixkv.kvcache.window.slots import window_peak

KNOBS = ("cache_bytes", "kv_tokens", "window_tokens", "checkpoint_every")


@st.composite
def specs(draw):
    """A model: full and sliding attention layers in any mix (at least one layer), and
    recurrent layers or none."""
    full = draw(st.integers(0, 6))
    sliding = draw(st.integers(0 if full else 1, 6))
    window = draw(st.integers(2, 300))
    windows = [0] * full + [window] * sliding
    recurrent = None
    if draw(st.booleans()):
        shape = (draw(st.integers(1, 8)), draw(st.integers(1, 64)))
        recurrent = RecurrentSpec(draw(st.integers(1, 4)), (shape,))
    return LayerSpecs.attention(windows, draw(st.integers(1, 4)), draw(st.sampled_from([4, 8])),
                                recurrent)  # fmt: skip


@st.composite
def configs(draw, spec: LayerSpecs):
    page = draw(st.sampled_from([1, 4, 16]))
    shape = draw(st.sampled_from(["pools", "arena", "auto", "sglang"]))
    knobs: dict = dict(page_size=page, chunk_size=draw(st.integers(1, 64)),
                       max_running=draw(st.integers(1, 8)),
                       max_context_len=draw(st.integers(16, 1024)))  # fmt: skip
    if shape == "pools":
        knobs["kv_tokens"] = draw(st.integers(2 * page, 5000))
        knobs["window_tokens"] = draw(st.one_of(st.none(), st.integers(0, 3000)))
        knobs["max_checkpoints"] = draw(st.one_of(st.none(), st.integers(1, 100)))
    else:
        knobs["cache_bytes"] = "auto" if shape == "auto" else draw(st.integers(1, 2_000_000))
        knobs["cache_split"] = "sglang" if shape == "sglang" else "one"
        if shape == "arena":
            knobs["kv_tokens"] = draw(st.one_of(st.none(), st.integers(2 * page, 5000)))
            knobs["window_tokens"] = draw(st.one_of(st.none(), st.integers(1, 3000)))
        if shape == "auto":
            knobs["kv_tokens"] = draw(st.integers(2 * page, 5000))
    if spec.recurrent is not None and draw(st.booleans()):
        knobs["checkpoint_every"] = page * draw(st.integers(1, 8))
    return CacheConfig(**knobs)


@given(st.data())
def test_a_plan_names_the_knob_it_cannot_take_or_holds_its_invariants(data):
    spec = data.draw(specs())
    cfg = data.draw(configs(spec))
    try:
        plan = plan_memory(spec, cfg, "toy")
    except ValueError as e:
        assert str(e).split(" ", 1)[0].rstrip(":").split(",")[0] in KNOBS, str(e)
        return
    c, p = plan.config, cfg.page_size
    per_layer = spec.layer_token_bytes(cfg.dtype)
    assert c.cache_bytes != "auto" and c.cache_split == "one"  # resolved
    sliding = spec.window_limited(cfg.max_context_len) if cfg.window_tokens != 0 else None
    if plan.window.layers:  # a window pool or window pages: one request's window and chunk
        assert sliding is not None and plan.window.layers == sliding.layers
        assert plan.window.tokens % p == 0
        assert plan.window.tokens >= window_peak(sliding.window, p, cfg.chunk_size)
    if plan.arena is not None:
        a = plan.arena
        assert a.unit_bytes % (p * per_layer) == 0 and a.nbytes <= c.cache_bytes
        least = 2 * a.full_columns + a.state_units
        if a.window_columns:
            least += window_peak(a.window, p, cfg.chunk_size) // p * a.window_columns
        assert a.units >= least and a.reserve == least - 2 * a.full_columns
        full_layers = spec.kv_layers - len(plan.window.layers)
        assert a.full_columns * a.group == full_layers
        assert a.window_columns * a.group == len(plan.window.layers)
        if spec.recurrent is not None:
            assert a.state_units * a.unit_bytes >= spec.recurrent.state_bytes
            assert plan.checkpoints >= 1
        assert plan.full_capacity % p == 0 and plan.full_capacity <= plan.full_slots
        assert plan.sized_by == "cache_bytes"
    else:
        assert plan.full_slots == c.pool_tokens and plan.full_capacity == c.pool_tokens // p * p
        if cfg.cache_split == "sglang":  # the split never spends more than the budget
            pools = sum(n for what, n in plan.needs.items() if not what.startswith("max_run"))
            if spec.recurrent is not None:  # (less the running and pending rows, outside
                # SGLang's split, which keeps a checkpoint at least)
                pools -= 2 * cfg.max_running * spec.recurrent.state_bytes
                floor = plan.checkpoints == 1
            else:
                floor = False
            assert pools <= cfg.cache_bytes or c.kv_tokens == 2 * p or floor
    if spec.recurrent is None:
        assert plan.checkpoints is None and plan.state_rows == 0
    else:
        assert plan.state_rows >= cfg.max_running


def test_the_plan_is_what_the_engine_allocates(hybrid_models):
    """The pools' tensors and the state rows are the bytes `MemoryPlan.needs` names,
    and an arena's units the plan's: the engine asks the plan, it does not re-derive."""
    for name, knobs in (("qwen3.5", dict(kv_tokens=512, max_checkpoints=5)),
                        ("gemma3", dict(kv_tokens=512)),
                        ("qwen3.5", dict(cache_bytes=2**20)),
                        ("gemma3", dict(cache_bytes=2**20, cache_split="sglang"))):  # fmt: skip
        eng = Engine(hybrid_models[name], page_size=4, max_running=4, max_context_len=256,
                     **knobs)  # fmt: skip
        plan = eng.memory.plan
        needs = dict(plan.needs)
        table = needs.pop(next(k for k in needs if k.startswith("max_running")))
        assert table == 8 * 4 * 256
        key = next((k for k in needs if "recurrent states" in k), None)
        states = needs.pop(key) if key is not None else 0
        if eng.recurrent is not None:
            pool = eng.recurrent.pool
            assert states == (pool.first + pool.spare) * eng.recurrent.row_size
        if plan.arena is None:
            kv = eng.kv
            held = sum(t.numel() * t.element_size() for t in (*kv.k, *kv.v))
            assert held == sum(needs.values())
        else:
            assert eng.arena.num_units == plan.arena.units
            assert eng.arena.nbytes <= knobs["cache_bytes"] == sum(needs.values())


def test_a_plan_allocates_nothing():
    """A petabyte budget is planned (and named in ``needs``) without touching memory:
    the engine, not the plan, checks it against the machine."""
    spec = LayerSpecs.attention([0] * 32, 8, 128, RecurrentSpec(24, ((16, 128, 128),)))
    plan = plan_memory(spec, CacheConfig(cache_bytes=2**50, page_size=16))
    assert plan.arena is not None and plan.arena.nbytes <= 2**50
    assert plan.needs[f"cache_bytes={2**50:,}"] == 2**50


def test_a_budget_the_machine_cannot_hold_names_its_knob_and_allocates_nothing():
    with pytest.raises(ValueError, match=r"^cache_bytes: needs [\d,.]+ GiB"):
        Engine("random", cache_bytes=2**50)
    with pytest.raises(ValueError, match=r"^needs [\d,.]+ GiB \(kv_tokens="):
        Engine("random", kv_tokens=2**40)


def test_the_engine_config_hands_its_memory_knobs_over_validated():
    cfg = EngineConfig(kv_tokens=4096, page_size=16, cache_bytes=2**20, max_checkpoints=3)
    cc = cfg.cache_config
    assert (cc.kv_tokens, cc.page_size, cc.cache_bytes, cc.max_checkpoints) == (
        4096, 16, 2**20, 3)  # fmt: skip
    assert cfg.one_arena and cc.checkpoint_cap == 3
    for bad, match in ((dict(kv_tokens=0), "kv_tokens must be a positive int"),
                       (dict(cache_split="x", cache_bytes=1), "cache_split must be one of"),
                       (dict(dtype="float32"), "dtype must be a torch.dtype")):  # fmt: skip
        with pytest.raises((ValueError, TypeError), match=match):
            CacheConfig(**bad)
        with pytest.raises((ValueError, TypeError), match=match):
            EngineConfig(**bad)
    assert CacheConfig(dtype=torch.float16).dtype == torch.float16
