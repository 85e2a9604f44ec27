"""The engine's online API: add_request / step / abort, admission limits, stop strings, and
the async engine's thread."""

from __future__ import annotations

import asyncio
import random
from contextlib import aclosing

import pytest

from radixkv.engine.async_engine import AsyncEngine, EngineDead, QueueFull
from radixkv.engine.engine import Engine
from radixkv.engine.models.llama import ModelConfig
from radixkv.engine.request import SamplingParams

CFG = ModelConfig()


def run_all(engine: Engine, max_steps: int = 10_000) -> dict:
    """Step until nothing is unfinished; returns rid -> (token ids, text, finish reason)."""
    got: dict = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return got
        for out in engine.step():
            ids, text, _ = got.get(out.rid, ([], "", None))
            got[out.rid] = (ids + out.token_ids, text + out.text, out.finish_reason)
    raise AssertionError("the engine did not finish")


def test_online_requests_equal_generate():
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 9], [40, 41]]
    offline = Engine(CFG).generate(prompts, max_new_tokens=6, ignore_eos=True)
    engine = Engine(CFG, check_memory=True)
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    rids = [engine.add_request(p, sp) for p in prompts]
    got = run_all(engine)
    assert [got[r][0] for r in rids] == [o.token_ids for o in offline.outputs]
    assert [got[r][1] for r in rids] == [o.text for o in offline.outputs]
    assert all(got[r][2] == "length" for r in rids)


def test_a_request_that_can_never_fit_is_refused_up_front():
    engine = Engine(CFG, kv_tokens=32, max_context_len=64)
    with pytest.raises(ValueError, match="never fit"):
        engine.generate([list(range(30))], max_new_tokens=10, ignore_eos=True)
    with pytest.raises(ValueError, match="never fit"):
        engine.add_request(list(range(30)), SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="context"):
        engine.add_request(list(range(30)), SamplingParams(max_new_tokens=40))
    assert not engine.has_unfinished()
    engine.add_request(list(range(20)), SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert len(run_all(engine)) == 1


def test_requests_that_fit_only_one_at_a_time_all_finish():
    """Each needs 28 of 32 slots: they preempt one another but the oldest always advances."""
    engine = Engine(CFG, kv_tokens=32, page_size=4, check_memory=True)
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    rids = [engine.add_request([i] * 20, sp) for i in range(1, 5)]
    got = run_all(engine, max_steps=500)
    assert sorted(got) == sorted(rids) and all(len(got[r][0]) == 8 for r in rids)


@pytest.mark.parametrize("stage", ["waiting", "prefilling", "decoding", "finished", "unknown"])
def test_abort_at_every_stage_frees_everything(stage):
    engine = Engine(CFG, chunk_size=8, max_running=1, check_memory=True, kv_tokens=256)
    sp = SamplingParams(max_new_tokens=20, ignore_eos=True)
    first = engine.add_request(list(range(30)), sp)
    second = engine.add_request(list(range(30, 60)), sp)
    engine.step()  # first prefills its first chunk; second waits (one row)
    target = {"waiting": second, "prefilling": first, "decoding": first}.get(stage)
    if stage == "decoding":
        while engine.requests[first].prefilling:
            engine.step()
        engine.step()
    if stage == "finished":
        run_all(engine)
        assert engine.abort(first) is False
        return
    if stage == "unknown":
        assert engine.abort("nope") is False
        return
    assert engine.abort(target)
    outs = engine.step()
    assert any(o.rid == target and o.finish_reason == "abort" for o in outs)
    engine.mgr.check_memory()
    run_all(engine)
    assert engine.mgr.allocator.available_size() + engine.cache.total_size() == 256
    assert engine.counters.finished["abort"] == 1


def test_stop_strings_cut_the_text_and_streamed_text_adds_up():
    engine = Engine(CFG)
    prompt = "tell me"
    full = engine.generate([prompt], max_new_tokens=24, ignore_eos=True).outputs[0].text
    assert len(full) > 8
    stop = full[5:8]
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=24, stop=(stop,)))
    _ids, text, reason = run_all(engine)[rid]
    assert reason == "stop" and text == full[: full.find(stop)]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"stop": ("",)}, "stop"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_bad_sampling_params_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_seeded_sampling_repeats_online():
    engine = Engine(CFG)
    sp = SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)
    a = engine.add_request("hi", sp)
    b = engine.add_request("hi", sp)
    got = run_all(engine)
    assert got[a][0] == got[b][0]


# --- the async engine ----------------------------------------------------------------------
def test_async_engine_streams_many_requests_and_aborts_cleanly():
    async def main():
        engine = Engine(CFG, kv_tokens=512, page_size=4, max_running=4)
        aeng = AsyncEngine(engine, max_queue=64)
        aeng.start()
        rng = random.Random(0)
        stem = [rng.randrange(256) for _ in range(40)]

        async def one(i):
            prompt = stem + [rng.randrange(256) for _ in range(rng.randrange(1, 20))]
            sp = SamplingParams(max_new_tokens=rng.randrange(1, 12), ignore_eos=True)
            n = 0
            async with aclosing(aeng.generate(prompt, sp)) as stream:
                async for out in stream:
                    n += len(out.token_ids)
                    if i % 5 == 0 and n >= 2:
                        break  # a client that goes away mid-stream
            return n

        counts = await asyncio.gather(*(one(i) for i in range(40)))
        assert all(c >= 1 for c in counts)
        await aeng.call(lambda e: e.mgr.check_memory())  # on the engine's own thread
        assert await aeng.call(lambda e: e.has_unfinished()) is False
        assert await aeng.flush_cache() > 0
        await aeng.stop()
        with pytest.raises(EngineDead):
            async for _ in aeng.generate([1, 2], SamplingParams()):
                pass

    asyncio.run(main())


def test_async_engine_reports_bad_requests_and_a_full_queue():
    async def main():
        aeng = AsyncEngine(Engine(CFG, max_context_len=64), max_queue=1)
        aeng.start()
        with pytest.raises(ValueError, match="context"):
            async for _ in aeng.generate([1] * 60, SamplingParams(max_new_tokens=10)):
                pass
        aeng.pause()  # hold the step loop so the queue fills
        first = aeng.generate([1, 2, 3], SamplingParams(max_new_tokens=2))
        task = asyncio.ensure_future(first.__anext__())
        # the loop thread takes commands in order: once it answers this, it has the first
        while await aeng.call(lambda e: e.num_waiting()) < 1:
            await asyncio.sleep(0)
        with pytest.raises(QueueFull):
            async for _ in aeng.generate([4, 5, 6], SamplingParams(max_new_tokens=2)):
                pass
        aeng.resume()
        assert (await task).token_ids
        await first.aclose()
        await aeng.stop()

    asyncio.run(main())
