"""The engine: reused KV gives the logits of a full recompute, the model equals Hugging
Face's LlamaForCausalLM, memory stays exact under eviction and preemption, and LPM
scheduling reaches the best hit rate on grouped prompts. All on tiny random models."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from radixkv import RadixCache
from radixkv.engine.engine import Engine
from radixkv.engine.models.llama import ForwardBatch, ModelConfig
from radixkv.engine.weights import random_model
from radixkv.kvcache.lifecycle import CacheManager, Req
from radixkv.kvcache.memory import KVPool, TokenToKVPoolAllocator
from radixkv.kvcache.req_table import ReqToTokenPool

CFG = ModelConfig(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def setup(page: int, size: int = 1024):
    model = random_model(CFG, seed=1)
    alloc = TokenToKVPoolAllocator(size, page)
    mgr = CacheManager(RadixCache(page, allocator=alloc), alloc, ReqToTokenPool(8, 512))
    pool = KVPool(CFG.num_hidden_layers, CFG.num_key_value_heads, CFG.head_dim, alloc.size)
    return model, mgr, pool


def forward(model, mgr, pool, work: list[tuple[Req, int]]) -> torch.Tensor:
    """Allocate and compute the next n tokens of each request in one ragged batch; return
    the logits of every computed token."""
    ids, pos, out, lens, kv = [], [], [], [], []
    for req, n in work:
        start = req.kv_len
        slots = mgr.allocate(req, n)
        ids += req.all_ids[start : start + n]
        pos += range(start, start + n)
        out.append(slots)
        kv.append(mgr.req_pool.read(req.row, 0, req.kv_len))
        lens.append(n)
    batch = ForwardBatch(torch.tensor(ids), torch.tensor(pos), torch.cat(out), lens, kv)
    return model(batch, pool, all_logits=True)


def scratch_logits(model, tokens: list[int]) -> torch.Tensor:
    pool = KVPool(CFG.num_hidden_layers, CFG.num_key_value_heads, CFG.head_dim, len(tokens))
    n = len(tokens)
    batch = ForwardBatch(
        torch.tensor(tokens), torch.arange(n), torch.arange(n), [n], [torch.arange(n)]
    )
    return model(batch, pool, all_logits=True)


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("chunk", [None, 7])
def test_cached_prefix_gives_the_logits_of_a_full_recompute(page, chunk):
    rng = random.Random(page * 100 + (chunk or 0))
    prefix = [rng.randrange(256) for _ in range(70)]
    first = prefix + [rng.randrange(256) for _ in range(20)]
    second = prefix + [rng.randrange(256) for _ in range(25)]
    bystander = [rng.randrange(256) for _ in range(30)]
    model, mgr, pool = setup(page)

    a = Req("a", first)
    mgr.admit(a)
    forward(model, mgr, pool, [(a, len(first))])
    mgr.cache_finished_req(a)

    b, c = Req("b", second), Req("c", bystander)
    mgr.admit(b)
    mgr.admit(c)
    assert b.cached_len == 70 // page * page > 0
    computed = []
    while b.kv_len < len(second):  # b's suffix, batched alongside c's prefill
        n = min(chunk or len(second), len(second) - b.kv_len)
        work = [(b, n)] + (
            [(c, min(n, len(bystander) - c.kv_len))] if c.kv_len < len(bystander) else []
        )
        computed.append(forward(model, mgr, pool, work)[:n])
        mgr.cache_unfinished_req(b)
        mgr.check_memory()
    ours = torch.cat(computed)
    ref = scratch_logits(model, second)[b.cached_len :]
    assert (ours - ref).abs().max().item() <= 1e-4


def test_model_equals_transformers_llama():
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(
        vocab_size=CFG.vocab_size,
        hidden_size=CFG.hidden_size,
        intermediate_size=CFG.intermediate_size,
        num_hidden_layers=CFG.num_hidden_layers,
        num_attention_heads=CFG.num_attention_heads,
        num_key_value_heads=CFG.num_key_value_heads,
        rms_norm_eps=CFG.rms_norm_eps,
        rope_theta=CFG.rope_theta,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    ours = random_model(CFG)
    missing, unexpected = ours.load_state_dict(hf.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    tokens = [random.Random(3).randrange(CFG.vocab_size) for _ in range(48)]
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    assert (scratch_logits(ours, tokens) - ref).abs().max().item() <= 1e-4
    # cached prefix + suffix: the prefix's KV comes from the pool, only the suffix is run
    pool = KVPool(CFG.num_hidden_layers, CFG.num_key_value_heads, CFG.head_dim, 64)
    p = 30
    ours(
        ForwardBatch(
            torch.tensor(tokens[:p]), torch.arange(p), torch.arange(p), [p], [torch.arange(p)]
        ),
        pool,
    )
    suffix = ours(
        ForwardBatch(
            torch.tensor(tokens[p:]),
            torch.arange(p, 48),
            torch.arange(p, 48),
            [48 - p],
            [torch.arange(48)],
        ),
        pool,
        all_logits=True,
    )
    assert (suffix - ref[p:]).abs().max().item() <= 1e-4


def random_prompts(rng: random.Random, n: int) -> list[list[int]]:
    stems = [[rng.randrange(256) for _ in range(rng.randrange(20, 60))] for _ in range(3)]
    return [
        rng.choice(stems + [[]]) + [rng.randrange(256) for _ in range(rng.randrange(1, 30))]
        for _ in range(n)
    ]


@pytest.mark.parametrize("seed", range(3))
def test_memory_stays_exact_under_eviction_and_preemption(seed):
    rng = random.Random(seed)
    prompts = random_prompts(rng, 14)
    tight = Engine(
        CFG,
        page_size=4,
        kv_tokens=160,
        chunk_size=rng.choice([8, 24, 64]),
        max_running=6,
        check_memory=True,
        schedule_policy=rng.choice(["fcfs", "lpm"]),
    )
    evicted = []
    original_evict = tight.cache.evict
    tight.cache.evict = lambda n: evicted.append(original_evict(n)) or evicted[-1]
    got = tight.generate(prompts, max_new_tokens=12, ignore_eos=True)
    roomy = Engine(CFG, prefix_cache=False, kv_tokens=4096, max_running=16)
    want = roomy.generate(prompts, max_new_tokens=12, ignore_eos=True)
    assert got.stats.preemptions > 0 and sum(evicted) > 0  # the pool really was too small
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]
    assert tight.mgr.allocator.available_size() + tight.cache.total_size() == 160


def test_check_memory_names_a_lock_that_no_request_or_pin_holds():
    """The engine's lock ledger: running requests, retention pins and a load ahead's
    hold account for every lock in the tree. A lock leaked (taken and never released)
    makes the next step's check name its node, where without the ledger it showed only
    as an engine that could not make room."""
    from radixkv import RadixKey
    from radixkv.engine.request import CacheSpec, SamplingParams

    engine = Engine(CFG, page_size=4, kv_tokens=160, check_memory=True)
    ids = list(range(3, 43))
    engine.add_request(ids, SamplingParams(2, ignore_eos=True), chat=False,
                       cache=CacheSpec(retain=((20, 60.0),)))  # fmt: skip
    while engine.has_unfinished():
        engine.step()
    assert engine.retention.locks()  # (a pin's lock, accounted for)
    rid = engine.add_request(list(range(50, 90)), SamplingParams(8, ignore_eos=True), chat=False)
    engine.step()  # (a running request's lock, accounted for)
    leaked = engine.cache.match_prefix(RadixKey(ids[:8])).last_node
    engine.cache.inc_lock_ref(leaked)
    with pytest.raises(AssertionError, match=f"node {leaked.id}: lock_ref .*a lock leaked"):
        engine.step()
    engine.cache.dec_lock_ref(leaked)
    while engine.has_unfinished():
        engine.step()
    assert rid not in engine.requests


def test_lpm_reaches_the_best_hit_rate_on_grouped_prompts():
    rng = random.Random(0)
    groups, per_group, shared, unique = 4, 6, 96, 8
    prompts = []
    for _ in range(groups):
        stem = [rng.randrange(256) for _ in range(shared)]
        prompts += [stem + [rng.randrange(256) for _ in range(unique)] for _ in range(per_group)]
    rng.shuffle(prompts)
    engine = Engine(CFG, schedule_policy="lpm", max_running=16, kv_tokens=4096)
    stats = engine.generate(prompts, max_new_tokens=2, ignore_eos=True).stats
    best = groups * (per_group - 1) * shared  # each group's prefix computed once
    assert stats.cached_tokens >= 0.95 * best
    fcfs = Engine(CFG, schedule_policy="fcfs", max_running=16, kv_tokens=4096)
    assert fcfs.generate(prompts, max_new_tokens=2, ignore_eos=True).stats.cached_tokens < best


def test_sampling_is_seeded_and_bad_arguments_are_refused():
    engine = Engine(CFG)
    a = engine.generate(["hello there"], max_new_tokens=6, temperature=0.8, top_p=0.9, seed=5)
    b = engine.generate(["hello there"], max_new_tokens=6, temperature=0.8, top_p=0.9, seed=5)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert b.outputs[0].cached_tokens > 0  # the second run hit the first one's prompt
    with pytest.raises(ValueError, match="schedule_policy"):
        Engine(CFG, schedule_policy="random")
    with pytest.raises(ValueError, match="max_context_len"):
        Engine(CFG, max_context_len=16).generate(["x" * 40], max_new_tokens=4)
    with pytest.raises(ValueError, match="token ids"):
        engine.generate([[10_000]])


@pytest.mark.parametrize(
    "ids", [[5, True], [5, 2.0], [5, "6"], [5, None], [-1, 5], [5, CFG.vocab_size], [2**70]]
)
def test_bad_token_ids_are_refused_and_change_nothing(ids):
    engine = Engine(CFG)
    engine.generate([[1, 2, 3, 4]], max_new_tokens=1)
    before = engine.cache.total_size()
    with pytest.raises(ValueError, match="token ids"):
        engine.generate([[1, 2, 3, 4, 5], ids], max_new_tokens=1)
    assert engine.cache.total_size() == before
    assert engine.encode([0, CFG.vocab_size - 1]) == [0, CFG.vocab_size - 1]  # both ends in
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]])


def test_a_hugging_face_checkpoint_folder_round_trips(tmp_path):
    import json

    from safetensors.torch import save_file

    from radixkv.engine.weights import load_hf_folder

    cfg = dataclasses.replace(CFG, tie_word_embeddings=False)
    model = random_model(cfg, seed=7)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        str(tmp_path / "model.safetensors"),
    )
    loaded = load_hf_folder(tmp_path)
    assert not loaded.config.tie_word_embeddings
    tokens = list(range(20))
    assert torch.equal(scratch_logits(loaded, tokens), scratch_logits(model, tokens))
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError):
        load_hf_folder(tmp_path)
