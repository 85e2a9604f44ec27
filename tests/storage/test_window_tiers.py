"""Window pages below the device (`radixkv.storage.windows`): with the sliding layers' KV
apart, full pages and window pages go down the host pool and the store separately, each
checked as a KV page is, and come back so that a match may end where they end. Outputs
equal transformers' and an engine that keeps every layer in one pool; KV events tell
what the loaded pages make servable."""

from __future__ import annotations

import pytest
import torch
from helpers import engine_process
from support.events import servable_blocks
from support.models import GEMMA, MISTRAL, folder, greedy

from radixkv.engine.engine import Engine, SamplingParams
from radixkv.events import BlockRemoved, BlockStored


@pytest.fixture(scope="module", params=[GEMMA, MISTRAL], ids=["gemma3", "mistral"])
def model(request, tmp_path_factory):
    arch, config = request.param
    return arch, folder(tmp_path_factory.mktemp(arch) / "ckpt", arch, **config)


def rand(n: int, seed: int) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_bad_window_page_in_the_store_is_refused_and_written_again(model, tmp_path):
    """A stored window page whose bytes changed fails its check: the request computes
    (transformers' output), the bad value is counted and written again, and the next
    engine on the store starts from it. Without the storage secret's MAC it is refused
    too. The full pages alone are no hit: a match needs the window before its end."""
    import transformers

    arch, path = model
    prompt = rand(96, 1) + [5]
    kw = {"page_size": 16, "chunk_size": 32, "check_memory": True,
          "storage": f"file://{tmp_path}/store"}  # fmt: skip
    first = Engine(str(path), **kw)
    first.generate([prompt], max_new_tokens=4, chat=False, ignore_eos=True)
    first.tier.flush()
    store, wt = first.tier.store, first.layer_tiers[0]
    assert wt.written > 0
    hashes = first.tier.page_hashes(prompt, None, 6)
    windows = [wt.prefix + h for h in hashes]
    windows = [k for k, ok in zip(windows, store.exists(windows), strict=True) if ok]
    assert windows and all(store.exists([first.tier.prefix + h for h in hashes]))
    assert wt.prefix != first.tier.prefix  # a window page is never read as a full one
    for k in windows:  # one flipped byte in every window page's payload
        value = bytearray(store.get([k])[0])
        value[100] ^= 1
        store.set([k], [bytes(value)])
    second = Engine(str(path), **kw)
    res = second.generate([prompt], max_new_tokens=8, chat=False, ignore_eos=True)
    assert res.stats.cached_tokens == 0 and second.layer_tiers[0].bad >= 1
    # its full pages came back, but no match may end there without their window
    assert second.tier.stats.store_hit_tokens > 0
    reference = getattr(transformers, arch).from_pretrained(path).eval()
    assert res.outputs[0].token_ids == greedy(reference, prompt, 8)
    second.tier.flush()  # the window pages were made again, and written again
    third = Engine(str(path), **kw)
    got = third.generate([prompt], max_new_tokens=8, chat=False, ignore_eos=True)
    assert got.stats.cached_tokens == 96 and third.layer_tiers[0].loaded > 0
    assert got.outputs[0].token_ids == res.outputs[0].token_ids
    keyed = Engine(str(path), storage_secret="fleet secret", **kw)
    miss = keyed.generate([prompt], max_new_tokens=2, chat=False, ignore_eos=True)
    assert miss.stats.cached_tokens == 0


@pytest.mark.parametrize("page", [1, 16])
def test_a_host_tier_under_pressure_with_kv_events(model, page):
    """A small device pool and window pool over a host tier, KV events on: requests
    sharing stems evict to the host and load back (full pages and windows apart);
    after every step the blocks told are exactly the servable pages, every invariant
    holds (`check_memory`: slots, rows, both host pools), and the tokens equal an
    engine that keeps every layer in one pool without tiers."""
    _, path = model
    stems = [rand(48, 2 + i) for i in range(6)]  # more than the device holds:
    ps = [stems[i % 6] + rand(3 + i, 10 + i) for i in range(12)]  # each comes back
    small = dict(page_size=page, chunk_size=16, max_running=2, check_memory=True)
    tiered = Engine(str(path), kv_tokens=256, window_tokens=96 if page == 1 else 160,
                    host_tokens=1024, **small)  # fmt: skip
    plain = Engine(str(path), kv_tokens=4096, window_tokens=0, **small)
    batches: list = []
    tiered.publish_kv_events(batches.append)
    told: set[int] = set()
    outputs: dict = {}
    for i, p in enumerate(ps):  # one at a time: each finds what the others left
        tiered.add_request(p, SamplingParams(6, ignore_eos=True), i, chat=False)
        while tiered.has_unfinished():
            for out in tiered.step():
                outputs.setdefault(out.rid, []).extend(out.token_ids)
            for b in batches:
                for e in b.events:
                    if isinstance(e, BlockStored):
                        told.update(e.block_hashes)
                    elif isinstance(e, BlockRemoved):
                        told.difference_update(e.block_hashes)
            batches.clear()
            assert told == servable_blocks(tiered.cache, False)
    ref = plain.generate(ps, max_new_tokens=6, chat=False, ignore_eos=True)
    assert [outputs[i] for i in range(len(ps))] == [o.token_ids for o in ref.outputs]
    assert tiered.tier.stats.host_hit_tokens > 0 and tiered.layer_tiers[0].host_loaded > 0


@pytest.mark.slow
def test_two_processes_share_full_and_window_pages_through_redis(model):
    """The first process serves two prompts sharing a stem; a second process on the same
    Redis starts the third from the store (full pages and the window before their end)
    with the first's output for it."""
    import redis

    _, path = model
    url = "redis://127.0.0.1:6379/14"
    client = redis.Redis.from_url(url, socket_timeout=2)
    client.flushdb()
    stem = rand(96, 4)
    prompts = [stem + rand(8, 20 + i) for i in range(3)]
    kw = {"page_size": 16, "chunk_size": 32}
    try:
        first = engine_process(path, url, prompts, **kw)
        second = engine_process(path, url, prompts[2:], **kw)
    finally:
        client.flushdb()
    assert first[0][1] == 0 and first[2][1] == 96
    assert second == [[first[2][0], 96]]


def test_a_huge_value_planted_under_a_window_key_is_refused_unread(model, tmp_path):
    """Whoever can write to the store can put 16 MiB under a window page's key: it is a
    bad window page (counted; the request computes), never read whole."""
    _, path = model
    prompt = rand(96, 5) + [5]
    kw = {"page_size": 16, "chunk_size": 32, "storage": f"file://{tmp_path}/store"}
    first = Engine(str(path), **kw)
    first.generate([prompt], max_new_tokens=2, chat=False, ignore_eos=True)
    first.tier.flush()
    keys = [first.layer_tiers[0].prefix + h for h in first.tier.page_hashes(prompt, None, 6)]
    first.tier.store.set(keys, [b"\0" * (16 << 20)] * len(keys))
    second = Engine(str(path), **kw)

    def whole(keys):  # a read of whole values: what a planted huge one must never get
        raise AssertionError(f"read whole: {len(keys)} values")

    second.tier.store.get = whole
    res = second.generate([prompt], max_new_tokens=2, chat=False, ignore_eos=True)
    assert res.stats.cached_tokens == 0 and second.layer_tiers[0].bad >= 1


def test_a_prompt_sent_again_to_a_fresh_engine_hits_the_window_store(model, tmp_path):
    """The same prompt sent again matches up to its last whole page before its last
    token, so the window there is what it needs: the store keeps it (the tree marks the
    prompt's resend point). It got 0 cached, while the prompt extended got all of it."""
    import transformers

    arch, path = model
    prompt = rand(203, 7)
    kw = {"page_size": 16, "chunk_size": 32, "check_memory": True,
          "storage": f"file://{tmp_path}/store"}  # fmt: skip
    first = Engine(str(path), **kw)  # its answer runs past a page: the row's window
    first.generate([prompt], max_new_tokens=12, chat=False, ignore_eos=True)  # moved on
    first.tier.flush()
    second = Engine(str(path), **kw)
    res = second.generate([prompt], max_new_tokens=6, chat=False, ignore_eos=True)
    assert res.stats.cached_tokens == 192  # align_down(203 - 1, 16)
    assert second.layer_tiers[0].loaded > 0 and second.tier.stats.store_hit_tokens >= 192
    reference = getattr(transformers, arch).from_pretrained(path).eval()
    assert res.outputs[0].token_ids == greedy(reference, prompt, 6)
