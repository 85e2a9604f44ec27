"""Qwen3.5 (Gated DeltaNet + gated attention) against transformers' own
``Qwen3_5ForCausalLM`` on tiny random folders written by ``save_pretrained``, and its
prefix cache: recurrent-state checkpoints at prompt ends, output ends and branch points
(`radixkv.kvcache.recurrent`), a hit copying a checkpoint's state, outputs identical with
the cache on and off through chunked prefill, preemption and sampling."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import cached_chats, engine_process, qwen3_5_folder, routed_conversations
from support.models import greedy

from radixkv.engine.engine import Engine


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    def tweak(model) -> None:
        with torch.no_grad():  # random norms and gates, so a dropped one shows
            for name, p in model.named_parameters():
                if "norm" in name or "dt_bias" in name or "A_log" in name:
                    p.add_(torch.randn_like(p) * 0.3)
                # slow decay: the state remembers hundreds of tokens, so a wrong state shows
                if "A_log" in name:
                    p.sub_(6.0)

    return Path(qwen3_5_folder(tmp_path_factory.mktemp("qwen3_5"), tweak))


@pytest.fixture(scope="module")
def reference(folder):
    import transformers

    return transformers.Qwen3_5ForCausalLM.from_pretrained(folder).eval()


def with_states(model, rows: int) -> None:
    """``rows`` state rows for a model run by hand (the engine builds its own pool)."""
    from radixkv.kvcache.recurrent.pool import StatePool

    model.use_states(StatePool(model.config.state_spec(), rows, 0))


def rand(n: int, seed: int) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_logits_equal_transformers_chunked_and_token_by_token(folder, reference):
    """Every position's logits to 1e-4: the prompt in one pass (over two of the chunked
    form's 64-token chunks), in two chunks, and with single-token (recurrent) steps."""
    from radixkv.engine.models.base import ForwardBatch
    from radixkv.engine.weights import load_hf_folder
    from radixkv.kvcache.memory import KVPool

    ours = load_hf_folder(folder)
    with_states(ours, 2)
    c = ours.config
    assert c.layer_types.count("linear_attention") == 3 and c.kv_layers == 1
    ids = torch.tensor(rand(150, 2))
    with torch.no_grad():
        want = reference(ids[None]).logits[0]
    for cuts in ([150], [37, 150], [37, 38, 39, 40, 150]):
        pool = KVPool(c.kv_layers, c.num_key_value_heads, c.head_dim, 256, torch.float32,
                      torch.device("cpu"))  # fmt: skip
        slots, got, a = torch.randperm(256)[:150], [], 0
        for b in cuts:
            batch = ForwardBatch(ids[a:b], torch.arange(a, b), slots[a:b], [b - a], [slots[:b]],
                                 [1])  # fmt: skip
            got.append(ours(batch, pool, all_logits=True))
            a = b
        torch.testing.assert_close(torch.cat(got), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("n", "cuts"),
    [(1, []), (1, [1]), (24, []), (24, [16]), (24, [0, 8, 24]), (150, [64, 128]),
     (150, [37, 100]), (150, [3, 4, 149]), (7, [2, 5])],
)  # fmt: skip
def test_the_delta_rule_gives_the_state_at_every_cut(n, cuts):
    """One chunked pass when the cuts lie on its chunk grid, segments when not: outputs
    and the state after each cut equal the recurrence token by token."""
    from radixkv.engine.models.qwen3_5 import GatedDeltaNet, _recurrent

    g = torch.Generator().manual_seed(n + len(cuts))
    q, k, v = (torch.randn(4, n, 8, generator=g) for _ in range(3))
    k = k / k.norm(dim=-1, keepdim=True)
    decay, beta = -torch.rand(4, n, generator=g) * 0.1, torch.rand(4, n, generator=g)
    state = torch.randn(4, 8, 8, generator=g)
    at = dict(GatedDeltaNet._delta_rule(q, k, v, decay, beta, state.clone(),
                                        [(b, -1) for b in cuts]))  # fmt: skip
    want, s = [], state
    states = {0: state}
    for t in range(n):
        o, s = _recurrent(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1],
                          decay[:, t : t + 1], beta[:, t : t + 1], s)  # fmt: skip
        want.append(o)
        states[t + 1] = s
    torch.testing.assert_close(at.pop(-1), torch.cat(want, dim=1), atol=1e-4, rtol=1e-4)
    assert sorted(at) == sorted({0, n, *cuts})
    for b, got in at.items():
        torch.testing.assert_close(got, states[b], atol=1e-4, rtol=1e-4)


def test_logits_equal_transformers_when_sequences_decode_as_one_batch(folder, reference):
    """Three sequences prefilled apart, then steps of one token each in one batch (the
    DeltaNet layers' batched decode), a one-token prompt starting in such a batch, and
    a five-token prefill chunk mixed in with them: every sequence's logits equal
    transformers' on it alone, to 1e-4."""
    from radixkv.engine.models.base import ForwardBatch
    from radixkv.engine.weights import load_hf_folder
    from radixkv.kvcache.memory import KVPool

    ours = load_hf_folder(folder)
    with_states(ours, 5)
    c = ours.config
    pool = KVPool(c.kv_layers, c.num_key_value_heads, c.head_dim, 512, torch.float32,
                  torch.device("cpu"))  # fmt: skip
    seqs = [torch.tensor(rand(n, 50 + n)) for n in (40, 70, 9)]
    seqs += [torch.tensor([23]), torch.tensor(rand(8, 77))]
    slots = torch.randperm(512)[: sum(map(len, seqs))].split([len(x) for x in seqs])
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    done = [0] * len(seqs)

    def step(plan: dict[int, int]) -> None:  # sequence -> new tokens this step
        live = list(plan)
        pos = [torch.arange(done[i], done[i] + plan[i]) for i in live]
        batch = ForwardBatch(
            torch.cat([seqs[i][p] for i, p in zip(live, pos, strict=True)]), torch.cat(pos),
            torch.cat([slots[i][p] for i, p in zip(live, pos, strict=True)]),
            [plan[i] for i in live], [slots[i][: done[i] + plan[i]] for i in live], live,
        )  # fmt: skip
        out = ours(batch, pool, all_logits=True)
        at = 0
        for i in live:
            got[i].append(out[at : at + plan[i]])
            at += plan[i]
            done[i] += plan[i]

    for i in range(3):  # prefill the first three, each alone
        step({i: len(seqs[i]) - 4})
    step({0: 1, 1: 1, 2: 1, 3: 1})  # decodes, and a one-token prompt
    step({0: 1, 1: 1, 4: 5, 2: 1})  # decodes with a prefill chunk among them
    step({0: 1, 1: 1, 2: 1, 4: 1})
    step({0: 1, 1: 1, 2: 1, 4: 1})
    step({4: 1})
    with torch.no_grad():
        for i, x in enumerate(seqs):
            assert done[i] == len(x)
            want = reference(x[None]).logits[0]
            torch.testing.assert_close(torch.cat(got[i]), want, atol=1e-4, rtol=1e-4)


def test_prompts_prefilled_in_one_batch_equal_each_alone(folder, reference):
    """Prefill chunks of several prompts in one step go through the DeltaNet layers as
    one padded batch (fresh ones and continued ones, with snapshots on the chunk grid;
    one with a snapshot off it runs alone beside them): every position's logits equal
    transformers' on each prompt alone, and every snapshot's state and conv inputs equal
    those of the prompt prefilled alone."""
    from radixkv.engine.models.base import ForwardBatch
    from radixkv.engine.models.qwen3_5 import _prefill_groups
    from radixkv.engine.weights import load_hf_folder
    from radixkv.kvcache.memory import KVPool

    seqs = [torch.tensor(rand(n, 90 + n)) for n in (40, 70, 33, 64)]
    slots = torch.randperm(512)[: sum(map(len, seqs))].split([len(x) for x in seqs])
    plans = [  # per step: sequence -> (new tokens, [(offset, snapshot row)])
        {0: (24, [(16, 4)]), 1: (48, [(40, 5), (48, 6)]), 2: (33, [(13, 7)]), 3: (40, [])},
        {0: (16, [(8, 8)]), 1: (22, []), 3: (24, [(16, 9)])},
    ]
    assert _prefill_groups([0, 1, 2, 3], [24, 48, 33, 40], {2: [(13, 7)]}) == [[0, 1, 3], [2]]

    def run(steps):
        ours = load_hf_folder(folder)
        with_states(ours, 10)
        c = ours.config
        pool = KVPool(c.kv_layers, c.num_key_value_heads, c.head_dim, 512, torch.float32,
                      torch.device("cpu"))  # fmt: skip
        got: list[list[torch.Tensor]] = [[] for _ in seqs]
        done = [0] * len(seqs)
        for plan in steps:
            live = list(plan)
            pos = [torch.arange(done[i], done[i] + plan[i][0]) for i in live]
            batch = ForwardBatch(
                torch.cat([seqs[i][p] for i, p in zip(live, pos, strict=True)]), torch.cat(pos),
                torch.cat([slots[i][p] for i, p in zip(live, pos, strict=True)]),
                [plan[i][0] for i in live], [slots[i][: done[i] + plan[i][0]] for i in live],
                live, [(j, off, row) for j, i in enumerate(live) for off, row in plan[i][1]],
            )  # fmt: skip
            with torch.no_grad():
                out = ours(batch, pool, all_logits=True)
            at = 0
            for i in live:
                got[i].append(out[at : at + plan[i][0]])
                at += plan[i][0]
                done[i] += plan[i][0]
        return [torch.cat(x) for x in got], ours.states

    together, states = run(plans)
    alone, lone = run([{i: p} for plan in plans for i, p in plan.items()])
    with torch.no_grad():
        for i, x in enumerate(seqs):
            want = reference(x[None]).logits[0]
            torch.testing.assert_close(together[i], want, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(alone[i], want, atol=1e-4, rtol=1e-4)
    for row in range(4, 10):
        torch.testing.assert_close(states.ssm[:, row], lone.ssm[:, row], atol=1e-7, rtol=1e-4)
        torch.testing.assert_close(states.conv[:, row], lone.conv[:, row])
    assert states.ssm[:, 4:10].abs().sum(dim=(0, 2, 3, 4)).min() > 0  # every row written


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_weights_run_every_path(folder, reference, dtype):
    """Weights in bfloat16 or float16 (``EngineConfig.dtype``), the recurrent states in
    float32: two prompts prefilled together, then decoded together, give transformers'
    float32 logits to half precision (1e-2: they are ~0.12 std, bfloat16 is off 0.004);
    the engine serves a shared prefix from the cache."""
    from radixkv.engine.models.base import ForwardBatch
    from radixkv.engine.weights import load_hf_folder
    from radixkv.kvcache.memory import KVPool

    ours = load_hf_folder(folder, dtype)
    with_states(ours, 2)
    c = ours.config
    pool = KVPool(c.kv_layers, c.num_key_value_heads, c.head_dim, 128, dtype,
                  torch.device("cpu"))  # fmt: skip
    seqs = [torch.tensor(rand(n, 30 + n)) for n in (40, 33)]
    slots = torch.randperm(128)[:73].split([40, 33])
    heads = [len(x) - 1 for x in seqs]  # prefilled together, then one decode step each
    with torch.no_grad():
        pre = ours(ForwardBatch(
            torch.cat([x[:n] for x, n in zip(seqs, heads, strict=True)]),
            torch.cat([torch.arange(n) for n in heads]),
            torch.cat([s[:n] for s, n in zip(slots, heads, strict=True)]),
            heads, [s[:n] for s, n in zip(slots, heads, strict=True)], [0, 1],
        ), pool, all_logits=True)  # fmt: skip
        dec = ours(ForwardBatch(
            torch.stack([x[n] for x, n in zip(seqs, heads, strict=True)]), torch.tensor(heads),
            torch.stack([s[n] for s, n in zip(slots, heads, strict=True)]), [1, 1],
            list(slots), [0, 1],
        ), pool, all_logits=True)  # fmt: skip
        at = 0
        for i, x in enumerate(seqs):
            want = reference(x[None]).logits[0]
            got = torch.cat([pre[at : at + len(x) - 1], dec[i : i + 1]]).float()
            at += len(x) - 1
            torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)  # bf16: off 0.004
    engine = Engine(str(folder), dtype=dtype, page_size=16, chunk_size=64)
    shared = rand(64, 5)
    runs = [engine.generate([shared + rand(9, 6 + i) for i in range(k)], max_new_tokens=4,
                            chat=False, ignore_eos=True) for k in (2, 3)]  # fmt: skip
    assert runs[1].stats.cached_tokens >= 3 * 64


@pytest.mark.parametrize("page", [1, 16])
def test_token_for_token_and_the_third_sharer_hits(folder, reference, page):
    """A 300-token shared prefix: the first request checkpoints its prompt's and its
    output's end, the second leaves that path at 300 and snapshots the branch point
    during its own prefill, the third starts there (>= 256 tokens at page 16)."""
    engine = Engine(str(folder), page_size=page, chunk_size=64, check_memory=True)
    shared = rand(300, 1)
    prompts = [shared + rand(k, 10 + k) for k in (9, 23, 40)]
    hits = []
    for p in prompts:
        res = engine.generate([p], max_new_tokens=8, chat=False, ignore_eos=True)
        assert res.outputs[0].token_ids == greedy(reference, p, 8)
        hits.append(res.stats.cached_tokens)
    assert hits[0] == 0 and hits[1] == 0
    assert hits[2] >= 256 and hits[2] == 300 - 300 % page
    kinds = sorted(c.kind for c in engine.recurrent.component.held.values())
    assert "branch" in kinds and "end" in kinds


@pytest.mark.parametrize("page", [1, 16])
def test_a_batch_decodes_together_token_for_token(folder, reference, page):
    """Prompts of different lengths (one of a single token) run at once: their decode
    steps go through the DeltaNet layers as one batch, each still transformers'."""
    engine = Engine(str(folder), page_size=page, chunk_size=64, check_memory=True)
    prompts = [rand(70, 41), [17], rand(33, 42), rand(130, 43)]
    res = engine.generate(prompts, max_new_tokens=10, chat=False, ignore_eos=True)
    for p, out in zip(prompts, res.outputs, strict=True):
        assert out.token_ids == greedy(reference, p, 10)


@pytest.mark.parametrize("cache_bytes", [None, 2**20])
@pytest.mark.parametrize("page", [4, 16])
def test_a_chats_next_turn_starts_at_the_last_page_its_answer_reached(
    folder, reference, page, cache_bytes
):
    """A decode step that ends on a page boundary snapshots the state there (replacing
    the request's previous one), so the next turn (prompt + answer + a new message) hits
    every whole page but the answer's last token, whose KV is never computed; before, it
    hit only the prompt's end unless prompt + answer - 1 happened to be page-aligned. The
    next turn still equals transformers'."""
    engine = Engine(str(folder), page_size=page, chunk_size=64, check_memory=True,
                    cache_bytes=cache_bytes)  # fmt: skip
    prompt = rand(37, 51)
    first = engine.generate([prompt], max_new_tokens=40, chat=False, ignore_eos=True)
    answer = first.outputs[0].token_ids
    turn = prompt + answer + rand(5, 52)
    second = engine.generate([turn], max_new_tokens=6, chat=False, ignore_eos=True).outputs[0]
    assert second.cached_tokens == (37 + 40 - 1) // page * page > 37
    assert second.token_ids == greedy(reference, turn, 6)
    cache = engine.cache
    depths = sorted(len(cache.path_values(c.node)) - len(c.node) + c.offset
                    for c in engine.recurrent.component.held.values())  # fmt: skip
    answer_end = (37 + 40 - 1) // page * page  # one snapshot kept, not one per page
    assert [d for d in depths if 37 < d <= answer_end] == [answer_end]


def test_a_hit_copies_the_state_never_lends_it(folder):
    """Two requests start from the same checkpoint at once and run different suffixes;
    the checkpoint stays as it was (a later request still gets the first's answer)."""
    engine = Engine(str(folder), chunk_size=64, check_memory=True)
    base = rand(40, 3)
    engine.generate([base], max_new_tokens=4, chat=False, ignore_eos=True)
    again = engine.generate([base + [7]], max_new_tokens=6, chat=False, ignore_eos=True)
    engine.generate([base + rand(20, 4), base + rand(9, 5)], max_new_tokens=6, chat=False,
                    ignore_eos=True)  # fmt: skip
    later = engine.generate([base + [7]], max_new_tokens=6, chat=False, ignore_eos=True)
    assert later.stats.cached_tokens > 0
    assert later.outputs[0].token_ids == again.outputs[0].token_ids


def test_cache_on_and_off_agree_under_preemption_and_sampling(folder):
    """Eight requests over three shared prefixes in a pool that preempts, greedy and
    seeded sampling: the same outputs as with the prefix cache off, every step checked
    (KV accounting, the tree, checkpoint rows)."""
    prefixes = [rand(70, 20 + i) for i in range(3)]
    prompts = [prefixes[i % 3] + rand(5 + i, 30 + i) for i in range(8)]
    for temperature in (0.0, 0.8):
        outs = []
        for cache in (True, False):
            engine = Engine(str(folder), prefix_cache=cache, kv_tokens=300, max_running=6,
                            chunk_size=48, check_memory=True, max_checkpoints=6)  # fmt: skip
            warm = engine.generate(prompts[:3], max_new_tokens=12, chat=False, ignore_eos=True,
                                   temperature=temperature, seed=3)  # fmt: skip
            res = engine.generate(prompts, max_new_tokens=40, chat=False, ignore_eos=True,
                                  temperature=temperature, seed=3)  # fmt: skip
            outs.append([o.token_ids for o in warm.outputs + res.outputs])
            if cache:
                assert res.stats.cached_tokens > 0
                assert engine.scheduler.preemptions > 0
                assert len(engine.recurrent.component.held) <= 6
        assert outs[0] == outs[1]


@pytest.mark.parametrize("cache_bytes", [None, 2**22])
@pytest.mark.parametrize("tier", ["host", "store"])
def test_checkpoints_go_down_the_tiers_and_come_back(folder, reference, tier, cache_bytes,
                                                     tmp_path):  # fmt: skip
    """KV pages alone are no hit on a recurrent model: the tiers keep the checkpoints too.
    Two requests leave a branch point at 288; then everything leaves the device (into
    the host pool), or a second engine starts on the same store: the third request
    starts from that checkpoint, with transformers' output. From separate pools and
    from one arena's units."""
    shared = rand(300, 1)
    prompts = [shared + rand(20, 10 + i) for i in range(3)]
    kw = {"page_size": 16, "chunk_size": 64, "check_memory": True, "cache_bytes": cache_bytes}
    if tier == "host":
        engine = Engine(str(folder), host_tokens=4096, **kw)
    else:
        engine = Engine(str(folder), storage=f"file://{tmp_path}/store", **kw)
    assert (engine.arena is None) == (cache_bytes is None)
    for p in prompts[:2]:
        engine.generate([p], max_new_tokens=4, chat=False, ignore_eos=True)
    if tier == "host":
        engine.flush_cache()
        # two prompts' ends, a page before each (a resend's start), the branch point
        assert engine.cache.total_size() == 0 and len(engine.recurrent.tiers.host) == 5
    else:
        engine.tier.flush()
        # each checkpoint as it was made: two prompts' ends, a page before each (where
        # each prompt sent again starts), and the branch point
        assert engine.recurrent.tiers.written == len(engine.recurrent.component.held) == 5
        engine = Engine(str(folder), storage=f"file://{tmp_path}/store", **kw)
    res = engine.generate([prompts[2]], max_new_tokens=8, chat=False, ignore_eos=True)
    assert res.stats.cached_tokens == 288 and engine.recurrent.tiers.loaded == 1
    assert res.outputs[0].token_ids == greedy(reference, prompts[2], 8)


@pytest.mark.slow
def test_two_processes_share_a_checkpoint_through_redis(folder):
    """The first process makes a branch point; a second process, on the same Redis,
    starts from the store (state and KV), with the first's output."""
    import redis

    url = "redis://127.0.0.1:6379/15"
    client = redis.Redis.from_url(url, socket_timeout=2)
    client.flushdb()
    shared = rand(300, 1)
    prompts = [shared + rand(20, 10 + i) for i in range(3)]
    kw = {"page_size": 16, "chunk_size": 64}
    try:
        first = engine_process(folder, url, prompts, **kw)
        second = engine_process(folder, url, prompts[2:], **kw)
    finally:
        client.flushdb()
    assert [c for _, c in first] == [0, 0, 288]
    # the same prompt again, from the store: from the checkpoint a page before its end
    # (the first process wrote it for a resend), with the same tokens
    assert second == [[first[2][0], 304]]


def test_a_huge_value_planted_under_a_state_key_is_refused_unread(folder, tmp_path):
    """Whoever can write to the store can put 16 MiB under a state's key: it is a bad
    state of that prompt (counted, recomputed, written again), never read whole."""
    shared = rand(300, 1)
    prompts = [shared + rand(20, 10 + i) for i in range(3)]
    kw = {"page_size": 16, "chunk_size": 64, "storage": f"file://{tmp_path}/store"}
    first = Engine(str(folder), **kw)
    for p in prompts[:2]:
        first.generate([p], max_new_tokens=4, chat=False, ignore_eos=True)
    first.tier.flush()
    keys = [k for k, _ in first.recurrent.tiers.keys.values()]
    first.tier.store.set(keys, [b"\0" * (16 << 20)] * len(keys))
    second = Engine(str(folder), **kw)

    def whole(keys):  # a read of whole values: what a planted huge one must never get
        raise AssertionError(f"read whole: {len(keys)} values")

    second.tier.store.get = whole
    res = second.generate([prompts[2]], max_new_tokens=2, chat=False, ignore_eos=True)
    assert res.stats.cached_tokens == 0 and second.recurrent.tiers.bad >= 1


def test_a_bad_state_in_the_store_is_refused_and_written_again(folder, reference, tmp_path):
    """A stored state whose bytes changed fails its check: the request recomputes (the
    right output), the bad value is counted and written again, and the next engine on
    the store starts from it. Without the storage secret's MAC it is refused too."""
    shared = rand(300, 1)
    prompts = [shared + rand(20, 10 + i) for i in range(3)]
    url = f"file://{tmp_path}/store"
    kw = {"page_size": 16, "chunk_size": 64, "check_memory": True, "storage": url}
    first = Engine(str(folder), **kw)
    for p in prompts[:2]:
        first.generate([p], max_new_tokens=4, chat=False, ignore_eos=True)
    first.tier.flush()
    store = first.tier.store
    states = [k for k, _ in first.recurrent.tiers.keys.values()]
    assert len(states) == 5 and all(store.get(states))  # ends, a page before each, branch
    for k in states:  # one flipped byte in every state's payload
        value = bytearray(store.get([k])[0])
        value[200] ^= 1
        store.set([k], [bytes(value)])
    second = Engine(str(folder), **kw)
    res = second.generate([prompts[2]], max_new_tokens=8, chat=False, ignore_eos=True)
    assert res.stats.cached_tokens == 0 and second.recurrent.tiers.bad >= 1
    assert res.outputs[0].token_ids == greedy(reference, prompts[2], 8)
    second.generate([prompts[1]], max_new_tokens=4, chat=False, ignore_eos=True)
    second.tier.flush()  # prompts[2]'s states are made again, and written again
    third = Engine(str(folder), **kw)
    assert third.generate([prompts[2]], max_new_tokens=2, chat=False,
                          ignore_eos=True).stats.cached_tokens == 304  # fmt: skip
    keyed = Engine(str(folder), storage_secret="fleet secret", **kw)
    got = keyed.generate([prompts[2]], max_new_tokens=2, chat=False, ignore_eos=True)
    assert got.stats.cached_tokens == 0 and keyed.recurrent.tiers.bad >= 1


def served_and_credited(engine: Engine, cuts: tuple[int, ...], salt: str | None = None,
                        salt_key: bytes | None = None, tokens: bool = True,
                        flush_after: int = -1) -> tuple:  # fmt: skip
    """Prompts sharing a 400-token prefix up to each of ``cuts``, one at a time, the
    engine's KV events (through the wire) applied to a router's index: per prompt, the
    tokens the engine served from its cache and those the index credited it before it
    ran. After each, the index checks and holds exactly the engine's checkpoints.
    ``flush_after``: the cache is flushed after that prompt."""
    from support.events import apply_to_index

    from radixkv.engine.request import SamplingParams
    from radixkv.events import salt_tag
    from radixkv.router.index import KvIndex

    batches: list = []
    engine.publish_kv_events(batches.append, salt_key=salt_key, tokens=tokens)
    index = KvIndex(16)
    index.sparse.add("w")
    tag = salt_tag(salt, salt_key) if salt is not None else None
    shared = rand(400, 1)
    served, credited = [], []
    for i, cut in enumerate(cuts):
        prompt = shared[:cut] + rand(9 + i, 20 + i)
        credited.append(16 * index.overlap(prompt, tag, salt).get("w", 0))
        rid = engine.add_request(prompt, SamplingParams(max_new_tokens=4, ignore_eos=True),
                                 extra_key=salt, chat=False)  # fmt: skip
        while engine.requests:
            for out in engine.step():
                if out.rid == rid and out.finished:
                    served.append(out.cached_tokens)
        if i == flush_after:
            engine.flush_cache()
        apply_to_index(batches, index)
        assert index.num_blocks("w") == len(engine.recurrent.component.held)
    return served, credited


@pytest.mark.parametrize("tokens", [True, False])
@pytest.mark.parametrize("cache_bytes", [None, 2**20])
def test_kv_events_advertise_exactly_the_prefixes_it_serves(folder, tokens, cache_bytes):
    """A prefix is servable only up to a checkpoint: the events (through the wire) tell
    one block per checkpoint, an index of them credits each prompt with the deepest one
    it passes, and that is what the engine then serves, prompt after prompt, while
    checkpoints beyond ``max_checkpoints`` are evicted and removed (with token ids, and
    hash-only in a salted namespace), from the separate pools or one arena (its
    checkpoints in arena units, ``max_checkpoints`` a cap inside the budget)."""
    engine = Engine(str(folder), page_size=16, chunk_size=64, max_checkpoints=3,
                    check_memory=True, cache_bytes=cache_bytes)  # fmt: skip
    served, predicted = served_and_credited(
        engine, (300, 300, 300, 350, 120, 300, 390, 120, 350), salt="tenant-a",
        salt_key=b"fleet key", tokens=tokens)  # fmt: skip
    assert served == predicted
    # the third sharer starts at the branch point; later that checkpoint is evicted (and
    # removed from the index), so the same prefix gets only an earlier one
    assert served[2] == 288 and 0 < served[5] < 288 and engine.recurrent.component.evictions


@pytest.mark.parametrize("cache_bytes", [None, 2**20])
def test_kv_events_tell_the_checkpoints_a_host_tier_brings_back(folder, cache_bytes):
    """With a host pool below, checkpoints that leave the device (evicted beyond
    ``max_checkpoints``, or all at once by a flush) come back when a prompt needs them,
    each told again: after every request the index holds exactly the checkpoints the
    engine holds, and a prompt is served at least what the index credited it (more
    where the host pool had a deeper one), from the separate pools or one arena."""
    engine = Engine(str(folder), page_size=16, chunk_size=64, max_checkpoints=3,
                    host_tokens=2048, check_memory=True, cache_bytes=cache_bytes)  # fmt: skip
    served, credited = served_and_credited(
        engine, (300, 300, 300, 350, 120, 300, 390, 120, 350, 300, 120, 300), flush_after=10)
    assert all(s >= c for s, c in zip(served, credited, strict=True))
    assert sum(served) > sum(credited) and engine.recurrent.tiers.loaded > 0
    assert served[11] > credited[11] == 0  # (after the flush: from the host pool)


def test_served_with_the_openai_client(folder):
    """`radixkv serve` on the Qwen3.5 folder (with a host tier, in one budget: a tier
    keeps ``--cache-bytes auto``), the official client: three completions sharing a
    300-character prefix (a byte per token), the third served 288 tokens from the
    cache; two chats sharing a system message, the second served it from the cache;
    /metrics shows the budget, the checkpoints, their bytes and the state tiers."""
    import re

    import httpx
    import openai

    from radixkv.web.process import ServerProcess

    args = ["--model", str(folder), "--page-size", "16", "--kv-tokens", "4096",
            "--max-checkpoints", "8", "--check-memory", "--host-tokens", "1024"]  # fmt: skip
    with ServerProcess(*args, timeout=90) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        shared = "The quick brown fox jumps over the lazy dog, again and again. " * 5
        cached = []
        for question in ("What?", "Where is it going now?", "Who saw it first?"):
            out = client.completions.create(model=model, prompt=shared[:300] + question,
                                            max_tokens=4, temperature=0)  # fmt: skip
            cached.append(out.usage.prompt_tokens_details.cached_tokens)
        system = "Answer in one short sentence. " * 6
        chats = cached_chats(client, model, system, ("A colour?", "A fruit?"))
        text = httpx.get(f"{srv.url}/metrics").text
    assert cached[0] == 0 and cached[2] == 288
    # the second chat starts from the checkpoint at the system message's end
    assert chats[0] == 0 and chats[1] >= 160
    held = re.search(r"radixkv:state_checkpoints\{[^}]*\} ([0-9.]+)", text)
    size = re.search(r"radixkv:state_checkpoint_bytes\{[^}]*\} ([0-9.e+]+)", text)
    assert held and 0 < float(held.group(1)) <= 8 and size and float(size.group(1)) > 0
    assert re.search(r"radixkv:state_checkpoints_loaded_total\{[^}]*\} 0", text)
    assert re.search(r"radixkv:host_state_checkpoints\{[^}]*\} ", text)
    assert re.search(r"radixkv:cache_budget_bytes\{[^}]*\} [1-9]", text)


def test_an_agent_on_a_hybrid_model_gets_the_session_order_and_a_host_tier(folder):
    """`radixkv serve --eviction-policy session --host-tokens N` on the Qwen3.5 folder
    with no size flag: refused before (a tier turned ``--cache-bytes auto`` into the
    separate pools, where the session order is refused); now one budget with both. An
    agent's three calls through Anthropic's official client, one session: each later
    call reads the earlier ones from the cache; /metrics shows the budget, the waiting
    session and the state tier."""
    import re

    import anthropic
    import httpx

    from radixkv.web.process import ServerProcess

    args = ["--model", str(folder), "--page-size", "16", "--kv-tokens", "1024",
            "--eviction-policy", "session", "--host-tokens", "1024", "--check-memory"]  # fmt: skip
    with ServerProcess(*args, timeout=90) as srv:
        client = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        system, messages, read = "You are a careful coding agent. " * 10, [], []
        for i in range(3):
            messages.append({"role": "user", "content": f"step {i}: list the files"})
            out = client.messages.create(model=model, max_tokens=4, system=system,
                                         messages=messages,
                                         metadata={"user_id": "session_agent_1"})  # fmt: skip
            messages.append({"role": "assistant", "content": "".join(
                b.text for b in out.content if b.type == "text") or "ok"})  # fmt: skip
            read.append(out.usage.cache_read_input_tokens)
        text = httpx.get(f"{srv.url}/metrics").text
    assert read[0] == 0 and read[1] > 200 and read[2] > read[1]
    assert re.search(r"radixkv:cache_budget_bytes\{[^}]*\} [1-9]", text)
    assert re.search(r"radixkv:agent_sessions_waiting\{[^}]*\} 1", text)
    assert re.search(r"radixkv:host_state_checkpoints\{[^}]*\} ", text)


@pytest.mark.slow
def test_a_hybrid_fleet_routes_on_what_its_workers_can_serve(folder):
    """Two `radixkv serve` workers on the Qwen3.5 folder publish their checkpoints as KV
    events, `radixkv route --policy kv` indexes them; four interleaved multi-turn
    conversations: what routing captured (the index's prefix on the chosen worker) is
    within 5% of what the engines delivered (their ``cached_tokens``), each
    conversation's later turns hit, and no worker is credited past a checkpoint."""
    from radixkv.web.process import ServerProcess, free_port_pair

    ports = [free_port_pair() for _ in range(2)]
    args = ["--model", str(folder), "--page-size", "16", "--kv-tokens", "8192",
            "--max-checkpoints", "32"]  # fmt: skip
    workers = [ServerProcess(*args, "--kv-events", f"tcp://127.0.0.1:{p}", timeout=90)
               for p in ports]  # fmt: skip
    specs = [a for w, p in zip(workers, ports, strict=True)
             for a in ("--worker", f"{w.url},tcp://127.0.0.1:{p}")]  # fmt: skip
    router = ServerProcess("--model", str(folder), "--policy", "kv", *specs,
                           command="route", timeout=90)  # fmt: skip
    try:
        cached, captured, delivered = routed_conversations(
            router, workers, "radixkv:state_checkpoints"
        )
    finally:
        router.stop()
        for w in workers:
            w.stop()
    assert all(x[0] == 0 and all(n > 0 for n in x[1:]) for x in cached), cached
    assert delivered > 0 and abs(captured - delivered) <= 0.05 * delivered, (captured, delivered)


@pytest.mark.parametrize("page", [1, 16])
def test_a_shared_system_message_hits_from_the_second_request(folder, reference, page):
    """Chat messages mark the end of the system message; the first request writes a
    checkpoint there during its prefill, so the second one (another user message)
    already starts from it, and its output is still transformers'."""
    engine = Engine(str(folder), page_size=page, chunk_size=64, check_memory=True)
    system = {"role": "system", "content": "You answer in one short sentence, always. " * 4}
    first = [system, {"role": "user", "content": "Name a colour."}]
    second = [system, {"role": "user", "content": "And a fruit?"}]
    ids = engine.encode(second)
    (end,) = ids.boundaries
    assert engine.encode([system])[:end] == ids[:end]  # the system part, as rendered alone
    engine.generate([first], max_new_tokens=4, ignore_eos=True)
    res = engine.generate([second], max_new_tokens=6, ignore_eos=True)
    assert res.stats.cached_tokens == end - end % page > 0
    assert res.outputs[0].token_ids == greedy(reference, list(ids), 6)
    assert "boundary" in {c.kind for c in engine.recurrent.component.held.values()}


def test_a_retained_breakpoint_is_a_checkpoint_and_outlives_a_flood(folder, reference):
    """A prompt-caching breakpoint inside the prompt is where the prefill writes a state
    checkpoint, and retention keeps that prefix (KV and its state) through a flood of
    other prompts: the next request sharing it starts there, still transformers'."""
    from radixkv.engine.request import CacheSpec, SamplingParams

    engine = Engine(str(folder), kv_tokens=512, max_checkpoints=4, max_retained_tokens=128,
                    check_memory=True)  # fmt: skip
    head = rand(96, 11)
    sp = SamplingParams(max_new_tokens=2, ignore_eos=True)
    engine.add_request(head + rand(20, 12), sp, chat=False, cache=CacheSpec(((96, 600.0),)))
    while engine.has_unfinished():
        engine.step()
    for i in range(12):  # 12 x 100 tokens through a 512-token pool and 4 checkpoints
        engine.generate([rand(98, 100 + i)], max_new_tokens=2, ignore_eos=True, chat=False)
    ids = head + rand(9, 13)
    res = engine.generate([ids], max_new_tokens=4, ignore_eos=True, chat=False)
    assert res.stats.cached_tokens == 96
    assert res.outputs[0].token_ids == greedy(reference, ids, 4)


def test_boundaries_are_checked_and_kept_by_generate(folder):
    """Marked ids keep their marks through `generate` (it dropped them once): the
    second prompt sharing a marked 100-token head starts from it (page 1)."""
    from radixkv.engine.request import MarkedIds

    engine = Engine(str(folder))
    with pytest.raises(ValueError, match="boundaries"):
        engine.add_request(MarkedIds([5, 6, 7], (4,)), chat=False)
    assert not engine.requests
    with pytest.raises(ValueError, match="boundaries"):
        engine.generate([MarkedIds([5, 6, 7], (4,))], chat=False)
    head = rand(100, 21)
    hits = [engine.generate([MarkedIds(head + rand(30, 22 + i), (100,))], max_new_tokens=2,
                            chat=False).stats.cached_tokens for i in range(2)]  # fmt: skip
    assert hits == [0, 100]


def test_checkpoint_every_hits_a_shared_prefix_from_the_second_request(folder, reference):
    """Without a boundary, a prefix two requests share is a hit only from the third (the
    second saves the branch point); with ``checkpoint_every`` the first one's prefill
    leaves states on that grid, so the second starts from the last one inside the
    prefix, with transformers' output. Set on a model without recurrent layers, or off
    the page grid, it is refused, naming it."""
    head = rand(200, 31)
    prompts = [head + rand(30, 32 + i) for i in range(2)]
    hits = {}
    for every in (0, 64):
        engine = Engine(str(folder), page_size=16, chunk_size=64, checkpoint_every=every,
                        check_memory=True)  # fmt: skip
        runs = [engine.generate([p], max_new_tokens=4, chat=False, ignore_eos=True)
                for p in prompts]  # fmt: skip
        hits[every] = [r.stats.cached_tokens for r in runs]
        assert runs[1].outputs[0].token_ids == greedy(reference, prompts[1], 4)
    assert hits == {0: [0, 0], 64: [0, 192]}
    with pytest.raises(ValueError, match="checkpoint_every"):
        Engine(str(folder), page_size=16, checkpoint_every=40)
    with pytest.raises(ValueError, match="checkpoint_every"):
        Engine("random", checkpoint_every=64)


def test_the_demo_runs_a_qwen3_5_folder(folder, capsys):
    """`radixkv demo --model FOLDER`: both workloads, cache off and on, identical greedy
    outputs, and the system-prompt workload served mostly from the cache."""
    from radixkv.cli import main

    assert main(["demo", "--model", str(folder), "--max-new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("greedy outputs with and without the cache are identical") == 2


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "yarn"),
        ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.3}},
         "partial_rotary_factor"),
        ({"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim"),
        ({"layer_types": ["linear_attention"] * 3 + ["sliding_attention"]}, "layer_types"),
        ({"mtp_num_hidden_layers": 1}, "mtp_num_hidden_layers"),
    ],
)  # fmt: skip
def test_config_fields_qwen3_5_does_not_implement_are_refused(folder, tmp_path, change, named):
    import json
    import shutil

    from radixkv.engine.models import UnsupportedModel

    path = tmp_path / "changed"
    shutil.copytree(folder, path)
    conf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**conf, **change}))
    with pytest.raises(UnsupportedModel, match=named):
        Engine(str(path))
