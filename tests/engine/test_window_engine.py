"""The engine on models with sliding-window layers whose KV lives in a pool of its own
(`radixkv.kvcache.window.slots`): Gemma 3 (sliding and global layers) and Mistral (every layer
sliding), from tiny random folders transformers writes. Outputs equal transformers' and
an engine that keeps every window, under window-pool pressure, chunked prefill,
preemption, sampling and ``n`` choices; a running request holds only its last window."""

from __future__ import annotations

import pytest
from helpers import cached_chats, routed_conversations
from support.models import GEMMA, MISTRAL, folder, greedy, prompts

from radixkv import RadixKey
from radixkv.engine.engine import Engine, SamplingParams


@pytest.fixture(scope="module", params=[GEMMA, MISTRAL], ids=["gemma3", "mistral"])
def model(request, tmp_path_factory):
    arch, config = request.param
    return arch, folder(tmp_path_factory.mktemp(arch) / "ckpt", arch, **config)


@pytest.mark.parametrize("page", [1, 16])
def test_outputs_equal_keeping_every_window_under_pressure(model, page):
    """A window pool barely larger than one request's window and chunk: windows are
    evicted and requests preempted, and every token is what an engine that keeps all
    window KV (and transformers) computes, greedy and seeded."""
    arch, path = model
    small = dict(page_size=page, chunk_size=16, max_running=4, kv_tokens=640, check_memory=True)
    split = Engine(str(path), window_tokens=4 * 16 + 64 if page == 16 else 60, **small)
    whole = Engine(str(path), window_tokens=0, **small)
    assert split.window is not None and whole.window is None
    ps = prompts()
    for temperature in (0.0, 0.8):
        a = split.generate(ps, max_new_tokens=20, temperature=temperature, chat=False,
                           ignore_eos=True)  # fmt: skip
        b = whole.generate(ps, max_new_tokens=20, temperature=temperature, chat=False,
                           ignore_eos=True)  # fmt: skip
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        assert a.stats.cached_tokens > 0
    assert split.window.evicted > 0  # the pool was short: cached windows gave way,
    assert split.scheduler.preemptions > 0  # and requests waiting on windows yielded
    import transformers

    reference = getattr(transformers, arch).from_pretrained(path).eval()
    last = split.generate(ps[:2], max_new_tokens=20, chat=False, ignore_eos=True)
    for p, out in zip(ps[:2], last.outputs, strict=True):
        assert out.token_ids == greedy(reference, p, 20)


def test_a_running_request_holds_only_its_last_window(model):
    _, path = model
    engine = Engine(str(path), page_size=1, chunk_size=32, check_memory=True)
    win = engine.window
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    rid = engine.add_request(list(range(3, 300)), params, chat=False)
    req = engine.requests[rid]
    most = 0
    while engine.has_unfinished():
        engine.step()
        if req.admitted:
            most = max(most, int(win.own[req.row].sum()))
    assert 0 < most <= win.peak(32) < 100  # not the 357 tokens of its context
    # the cache keeps all of it while there is room, and frees the spare under pressure
    comp = win.component
    assert comp.held_units() >= 300
    comp.evict_spare(10**6)
    assert comp.held_units() == win.span  # one window: the end a match can use
    again = engine.generate([list(range(3, 300)) + req.output_ids + [5]], max_new_tokens=2,
                            chat=False)  # fmt: skip
    assert again.outputs[0].cached_tokens == 356


def test_n_choices_and_a_shared_prefix_in_one_batch(model):
    _, path = model
    split = Engine(str(path), page_size=16, chunk_size=24, check_memory=True)
    whole = Engine(str(path), page_size=16, chunk_size=24, window_tokens=0)
    ids = prompts(1)[0]
    outs = []
    for e in (split, whole):
        rids = [e.add_request(ids, SamplingParams(max_new_tokens=16, temperature=1.0, seed=s,
                                                  ignore_eos=True), group="g", chat=False)
                for s in range(4)]  # fmt: skip
        done: dict = {}
        while e.has_unfinished():
            for o in e.step():
                done.setdefault(o.rid, []).extend(o.token_ids)
        outs.append([done[r] for r in rids])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("tier", ["host", "store"])
def test_window_pages_go_down_the_tiers_apart_and_come_back(model, tier, tmp_path):
    """With tiers the sliding layers' KV stays apart: full pages and window pages go
    down the tiers separately (`radixkv.storage.windows`); after the device is flushed
    into the host pool, or in a second engine on the same store, a prompt longer than
    the window starts from the tier (its full pages and the window before their end),
    with transformers' output."""
    import transformers

    arch, path = model
    shared = prompts(1)[0][:40] + list(range(3, 60))  # 96 tokens: many windows
    kw = {"page_size": 16, "chunk_size": 32, "check_memory": True}
    store = {"storage": f"file://{tmp_path}/store"}
    engine = Engine(str(path), **({"host_tokens": 1024} if tier == "host" else store), **kw)
    assert engine.window is not None and engine.layer_tiers
    engine.generate([shared + [7, 8]], max_new_tokens=4, chat=False, ignore_eos=True)
    if tier == "host":
        engine.flush_cache()
        assert engine.cache.total_size() == 0
    else:
        engine.tier.flush()
        engine = Engine(str(path), **store, **kw)
    res = engine.generate([shared + [9]], max_new_tokens=8, chat=False, ignore_eos=True)
    assert res.stats.cached_tokens == 96
    assert engine.layer_tiers[0].loaded > 0  # the window came from the tier, not computed
    reference = getattr(transformers, arch).from_pretrained(path).eval()
    assert res.outputs[0].token_ids == greedy(reference, shared + [9], 8)


def test_window_tokens_is_checked(model, tmp_path):
    _, path = model
    with pytest.raises(ValueError, match="window_tokens must hold one request's window"):
        Engine(str(path), page_size=16, chunk_size=64, window_tokens=32)
    tiers = Engine(str(path), host_tokens=256, window_tokens=1024)  # apart with tiers too
    assert tiers.window is not None and tiers.layer_tiers
    with pytest.raises(ValueError, match="window_tokens: LlamaForCausalLM has no sliding"):
        Engine("random", window_tokens=512)
    split = Engine(str(path))  # KV events with the window apart: servable blocks only
    split.publish_kv_events(lambda batch: None)
    assert split.window is not None and split.event_blocks == "windows"
    whole = Engine(str(path), window_tokens=0)
    whole.publish_kv_events(lambda batch: None)
    assert whole.event_blocks == "pages"


def test_the_pools_are_sized_per_layer_type_and_said(model):
    arch, path = model
    engine = Engine(str(path), kv_tokens=4096, max_running=4, chunk_size=64)
    lines = engine.memory_summary()
    kv = engine.kv
    full_layers = 0 if arch.startswith("Mistral") else 1
    assert lines[0].startswith(f"full-attention KV: 4,096 tokens x {full_layers} layers")
    assert lines[1].startswith("sliding-window KV: 1,024 tokens x")  # a quarter, by default
    assert kv.k[kv.window_layers[0]].shape[0] == 1024
    assert all(kv.k[i].shape[0] == 4096 for i in range(kv.num_layers) if i not in kv.window_layers)


@pytest.mark.slow
def test_served_with_the_openai_client(tmp_path):
    """`radixkv serve` on a Gemma 3 folder, the official client: the pools' sizes are
    printed at start, a chat sharing a long system message hits it, and /metrics shows
    the window KV the cache holds; a window pool under one request's window is refused."""
    import re
    import subprocess
    import sys

    import httpx
    import openai

    from radixkv.web.process import ServerProcess

    arch, config = GEMMA
    path = folder(tmp_path / "ckpt", arch, **config)
    args = ["--model", str(path), "--page-size", "16", "--kv-tokens", "4096",
            "--window-tokens", "1024", "--check-memory"]  # fmt: skip
    with ServerProcess(*args, timeout=90) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        system = "Answer in one short sentence. " * 6
        cached = cached_chats(client, model, system, ("A colour?", "A fruit?"))
        text = httpx.get(f"{srv.url}/metrics").text
    assert cached[0] == 0 and cached[1] >= 160
    printed = srv.stderr()
    assert "full-attention KV: 4,096 tokens x 1 layers" in printed
    assert "sliding-window KV: 1,024 tokens x 1 layers" in printed
    held = re.search(r"radixkv:prefix_cache_window_tokens\{[^}]*\} ([0-9.]+)", text)
    size = re.search(r"radixkv:prefix_cache_window_bytes\{[^}]*\} ([0-9.e+]+)", text)
    assert held and float(held.group(1)) > 0 and size and float(size.group(1)) > 0
    assert re.search(r"radixkv:window_kv_usage_perc\{[^}]*\} ", text)
    bad = subprocess.run(
        [sys.executable, "-m", "radixkv.cli", "serve", "--model", str(path), "--window-tokens",
         "8"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    last = bad.stderr.strip().splitlines()[-1]
    assert bad.returncode == 2 and last.startswith("error: ") and "window_tokens must hold" in last


@pytest.mark.parametrize("page", [1, 16])
def test_kv_events_tell_the_blocks_a_match_can_end_at_under_window_pressure(model, page):
    """KV events with the window apart (`radixkv.kvcache.window.servable`): after every step the
    blocks told are exactly the pages a match may end at (full KV in the tree and the
    window before it held), as windows are evicted while their full KV stays; a router
    index fed the stream credits this worker where its cache would hit, each block
    alone; the outputs equal an engine that keeps every window."""
    from support.events import servable_blocks

    from radixkv.events import BlockRemoved, BlockStored
    from radixkv.router.index import KvIndex

    _, path = model
    small = dict(page_size=page, chunk_size=16, max_running=4, kv_tokens=640, check_memory=True)
    split = Engine(str(path), window_tokens=4 * 16 + 64 if page == 16 else 60, **small)
    whole = Engine(str(path), window_tokens=0, **small)
    batches: list = []
    split.publish_kv_events(batches.append)
    told: set[int] = set()
    index = KvIndex(page)
    index.sparse.add("w")
    ps = prompts()
    for i, p in enumerate(ps):
        split.add_request(p, SamplingParams(12, ignore_eos=True), i, chat=False)
    outputs: dict = {}
    while split.has_unfinished():
        for out in split.step():
            outputs.setdefault(out.rid, []).extend(out.token_ids)
        for b in batches:
            index.apply("w", b)
            for e in b.events:
                if isinstance(e, BlockStored):
                    assert told.isdisjoint(e.block_hashes)
                    told.update(e.block_hashes)
                elif isinstance(e, BlockRemoved):
                    assert set(e.block_hashes) <= told
                    told.difference_update(e.block_hashes)
        batches.clear()
        assert told == servable_blocks(split.cache, False)
    assert split.window.evicted > 0 and told  # windows went, and blocks are still told
    ref = whole.generate(ps, max_new_tokens=12, chat=False, ignore_eos=True)
    assert [outputs[i] for i in range(len(ps))] == [o.token_ids for o in ref.outputs]
    # the router credits the deepest told page of a prompt; the engine hits there
    credits = [index.overlap(p).get("w", 0) for p in ps]
    assert credits == [split.cache.match_len(RadixKey(p)) // page for p in ps]
    assert any(credits)


@pytest.mark.slow
def test_a_windowed_fleet_routes_on_the_blocks_its_workers_can_serve(tmp_path):
    """Two `radixkv serve` workers on a Gemma 3 folder, the sliding layers' KV apart
    under one byte budget, publish KV events; `radixkv route --policy kv` indexes them
    (each block alone: the cards say ``"events": "windows"``). Four interleaved
    multi-turn conversations: each one's later turns hit, and what routing captured is
    within 5% of what the engines delivered."""
    import httpx

    from radixkv.web.process import ServerProcess, free_port_pair

    arch, config = GEMMA
    path = folder(tmp_path / "g", arch, **config)
    ports = [free_port_pair() for _ in range(2)]
    # a budget where windows are evicted while their full KV stays: the told pages
    # have holes, so a router that chained them from the root would credit too little
    args = ["--model", str(path), "--page-size", "16", "--cache-bytes", "320KiB"]
    workers = [ServerProcess(*args, "--kv-events", f"tcp://127.0.0.1:{p}", timeout=90)
               for p in ports]  # fmt: skip
    specs = [a for w, p in zip(workers, ports, strict=True)
             for a in ("--worker", f"{w.url},tcp://127.0.0.1:{p}")]  # fmt: skip
    router = ServerProcess("--model", str(path), "--policy", "kv", *specs,
                           command="route", timeout=90)  # fmt: skip
    try:
        card = httpx.get(f"{workers[0].url}/v1/models").json()["data"][0]["radixkv"]
        assert card["events"] == "windows"
        cached, captured, delivered = routed_conversations(
            router, workers, "radixkv:prefix_cache_servable_blocks"
        )
        evicted = sum(float(line.rsplit(" ", 1)[1]) for w in workers
                      for line in httpx.get(f"{w.url}/metrics").text.splitlines()
                      if line.startswith("radixkv:cache_kind_evicted_bytes_total{")
                      and 'kind="window"' in line)  # fmt: skip
    finally:
        router.stop()
        for w in workers:
            w.stop()
    assert evicted > 0
    assert all(x[0] == 0 and all(n > 0 for n in x[1:]) for x in cached), cached
    assert delivered > 0 and abs(captured - delivered) <= 0.05 * delivered, (captured, delivered)
