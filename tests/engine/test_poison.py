"""No request can stop an engine, and no request can take down a fleet: against real
``radixkv serve`` and ``radixkv route`` processes, through the official ``openai`` client.

Two checkpoints written by transformers' own ``save_pretrained`` (tiny Gemma 3, untied
embeddings, every weight finite) make the failures real rather than mocked:

* ``poisoned``: the embedding row of ``~`` is 3e38. Gemma 3 scales embeddings by
  sqrt(hidden_size), so that token's hidden state overflows to inf and every prompt that
  holds it gets NaN logits; prompts without it are untouched. A request's own failure.
* ``broken``: the ``lm_head`` row of one token is 3e38, so every row's logits hold an inf:
  the model fails for every request. The engine's fault.
"""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest
import torch
from helpers import qwen3_5_folder

from radixkv.web.process import ServerProcess

POISON = ord("~")  # the byte tokenizer's id of "~"
CLEAN = "a clean prompt without the poisoned character"
FOLDER_ARGS = ["--page-size", "4", "--kv-tokens", "2048", "--max-context-len", "512",
               "--check-memory", "--served-model-name", "gemma"]  # fmt: skip


def gemma_folder(path, row: str) -> str:
    """A tiny random Gemma 3 folder whose ``row`` (``embed`` or ``lm_head``) of token
    ``POISON`` is 3e38: finite, so it loads."""
    import transformers
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    conf = transformers.Gemma3TextConfig(
        vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=16, layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=False,
    )  # fmt: skip
    transformers.Gemma3ForCausalLM(conf).save_pretrained(path)
    weights = load_file(f"{path}/model.safetensors")
    name = "model.embed_tokens.weight" if row == "embed" else "lm_head.weight"
    weights[name][POISON] = 3e38
    save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
    return str(path)


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory):
    return gemma_folder(tmp_path_factory.mktemp("poisoned"), "embed")


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    return gemma_folder(tmp_path_factory.mktemp("broken"), "lm_head")


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)


def healthy(url: str) -> bool:
    return httpx.get(f"{url}/health", timeout=10).status_code == 200


def post(url: str, **body) -> httpx.Response:
    body = {"max_tokens": 4, "temperature": 0, **body}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def finished(url: str, reason: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(r'radixkv:request_success_total\{[^}]*finished_reason="' + reason
                  + r'"[^}]*\} ([0-9.]+)', text)  # fmt: skip
    return float(m.group(1)) if m else 0.0


# --- sampling values that cannot work ----------------------------------------------------
def test_a_temperature_that_rounds_to_zero_is_greedy_and_penalties_are_bounded():
    """1e-300 lies inside [0, 2], and 1e-40 rounds to 0 in float32: both divided the
    logits into NaN and stopped the engine for good. Now they are greedy."""
    with ServerProcess("--model", "random", "--check-memory", timeout=60) as srv:
        c = client(srv)

        def text(**kw) -> str:
            r = c.completions.create(model="random", prompt="The capital of", max_tokens=6,
                                     extra_body={"ignore_eos": True}, **kw)  # fmt: skip
            return r.choices[0].text

        greedy = text(temperature=0)
        assert text(temperature=1e-300) == greedy
        assert text(temperature=1e-40) == greedy
        stream = c.chat.completions.create(
            model="random", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            temperature=1e-300, stream=True,
        )  # fmt: skip
        assert [ch.choices[0].finish_reason for ch in stream][-1] == "length"
        for penalty in (1e-300, 0.001, 2.5):
            r = post(srv.url, prompt="x", temperature=1, repetition_penalty=penalty)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "repetition_penalty"
        r = post(srv.url, prompt="x", temperature=1, repetition_penalty=1e-300, stream=True)
        assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty"
        assert healthy(srv.url) and text(temperature=0) == greedy


# --- a request that fails alone ----------------------------------------------------------
def test_a_request_whose_logits_go_non_finite_fails_alone(poisoned):
    """Its answer says why (500 before a byte, an error event in a stream); the request
    running beside it finishes; every slot, state and lock is freed (``--check-memory``
    checks each step, a leak would stop the engine); the next request is served."""
    with ServerProcess("--model", poisoned, *FOLDER_ARGS, timeout=120) as srv:
        c = client(srv)
        body = {"prompt": CLEAN, "max_tokens": 48, "temperature": 0, "ignore_eos": True,
                "stream": True}  # fmt: skip
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as beside:
            lines = beside.iter_lines()  # kept: a dropped iterator aborts the request
            next(lines)  # it runs
            r = post(srv.url, prompt=f"{CLEAN} ~ and more")
            assert r.status_code == 500, r.text
            err = r.json()["error"]
            assert err["code"] == "request_failed" and "not finite" in err["message"]
            with pytest.raises(openai.APIError, match="not finite"):
                for _ in c.completions.create(model="gemma", prompt="~", max_tokens=4,
                                              stream=True):  # fmt: skip
                    pass
            with pytest.raises(openai.InternalServerError, match="not finite"):
                messages = [{"role": "user", "content": "hi ~"}]
                c.chat.completions.create(model="gemma", n=3, max_tokens=4, messages=messages)
            rest = [x for x in lines if x]
        assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
        assert finished(srv.url, "error") >= 3
        assert healthy(srv.url)
        for i in range(6):  # more in a row than the fault watch's count: the canary passes
            assert post(srv.url, prompt=f"~ {i}").status_code == 500
        assert healthy(srv.url)
        # greedy: sampled at OpenAI's default temperature 1, one answer in ~100 drew the
        # poisoned token itself and failed on its own (400 of them: 4 did)
        again = [c.completions.create(model="gemma", prompt=CLEAN + "!", max_tokens=4,
                                      temperature=0) for _ in range(2)]  # fmt: skip
        assert again[1].usage.prompt_tokens_details.cached_tokens > 0  # the cache serves


def test_the_kv_a_failed_request_leaves_behind_fails_no_other_request(poisoned):
    """A poisoned prompt's first token goes to slot 0 of a fresh pool and writes inf
    there; the request fails and frees it. The two clean requests beside it then decode
    in one padded batch: the shorter one's padding once read slot 0, and a masked inf
    still turns PyTorch's attention NaN, so it failed too (as the canary would, and the
    engine with it). Both finish, with the tokens each produces alone."""
    from radixkv.engine.engine import Engine
    from radixkv.engine.request import SamplingParams

    prompts = {"short": [7, 8, 9, 10, 11], "long": list(range(20, 29))}

    def run(*first: str) -> dict:
        eng = Engine(poisoned, kv_tokens=256, page_size=4, check_memory=True)
        for rid in first:
            eng.add_request([POISON, 5, 6], SamplingParams(4, ignore_eos=True), rid=rid,
                            chat=False)  # fmt: skip
        for rid, ids in prompts.items():
            eng.add_request(ids, SamplingParams(6, ignore_eos=True), rid=rid, chat=False)
        tokens: dict = {}
        reasons = {}
        while eng.has_unfinished():
            for o in eng.step():
                tokens.setdefault(o.rid, []).extend(o.token_ids)
                if o.finished:
                    reasons[o.rid] = o.finish_reason
        return {rid: (reason, tokens[rid]) for rid, reason in reasons.items()}

    beside = run("poisoned")
    assert beside.pop("poisoned")[0] == "error"
    assert beside == run() and {r for r, _ in beside.values()} == {"length"}


@pytest.mark.parametrize("model", ["random", "qwen3_5"])
@pytest.mark.parametrize("where", ["append", "finishing"])
def test_an_exception_for_one_request_fails_it_alone_and_frees_everything(tmp_path, model, where):
    """A fault injected for one request (its token's processing raises, at its first
    token or at its finish, where a recurrent model has just taken a snapshot row): it
    finishes with ``error``; the others finish as they would have; every invariant holds
    after each step (``check_memory``: KV slots, request rows, recurrent rows, locks)."""
    from radixkv.engine.engine import Engine
    from radixkv.engine.request import SamplingParams

    name = qwen3_5_folder(tmp_path / "q") if model == "qwen3_5" else "random"
    eng = Engine(name, kv_tokens=1024, page_size=4, check_memory=True)
    if where == "finishing" and eng.recurrent is None:
        where = "_save_to_tiers"
    owner = eng.recurrent if where == "finishing" else eng if where != "append" else eng.outputs
    real = getattr(owner, where)

    def faulty(r, *args):
        if r.rid == "victim":
            real(r, *args)
            raise RuntimeError("injected")
        return real(r, *args)

    setattr(owner, where, faulty)
    prompt = list(range(3, 40))
    sampling = SamplingParams(6, ignore_eos=True)
    for rid in ("before", "victim", "after"):
        eng.add_request(prompt + [ord(rid[0])], sampling, rid, chat=False)
    ends = {}
    while eng.has_unfinished():
        ends.update({o.rid: (o.finish_reason, o.error) for o in eng.step() if o.finished})
    assert ends == {"before": ("length", None), "after": ("length", None),
                    "victim": ("error", "RuntimeError: injected")}  # fmt: skip
    assert not eng.requests and eng.num_running() == 0
    assert eng.cache.protected_size() == 0  # no lock left behind
    a = eng.mgr.allocator
    assert a.size - a.available_size() == eng.cache.total_size()  # no slot leaked


# --- the engine's own fault ----------------------------------------------------------------
@pytest.mark.slow
def test_an_engine_whose_model_fails_every_row_says_why_and_exits_non_zero(broken):
    """Not a request's fault: after a few requests fail in a row with none served between,
    a one-token canary of the engine's own fails too; the engine stops, ``/health`` says
    why, and the process exits 1 for its supervisor, rather than answering 503 forever."""
    srv = ServerProcess("--model", broken, *FOLDER_ARGS, timeout=120)
    try:
        codes = []
        for i in range(8):
            try:
                codes.append(post(srv.url, prompt=f"request {i}").status_code)
            except httpx.TransportError:  # it exited already
                break
            if codes[-1] == 503:
                break
        assert codes[:4] == [500] * 4 and codes[-1] == 503, codes
        try:  # /health says why while it lingers (FAULT_LINGER_S)
            health = httpx.get(f"{srv.url}/health", timeout=10)
            assert health.status_code == 503 and "EngineFault" in health.json()["error"]
        except httpx.TransportError:
            pass  # gone already: the exit below is what counts
        assert srv.proc.wait(60) == 1
        assert "error: the engine failed: EngineFault" in srv.stderr()
    finally:
        srv.stop()


# --- through the router -------------------------------------------------------------------
@pytest.mark.slow
def test_one_poisonous_request_through_the_router_leaves_every_worker_serving(poisoned):
    """A 500 the request caused goes back to its client: never retried on the next
    worker (it stopped 3 of 3 workers in 0.13 s when it was)."""
    workers = [ServerProcess("--model", poisoned, *FOLDER_ARGS, timeout=120) for _ in range(3)]
    args = [a for w in workers for a in ("--worker", w.url)]
    router = ServerProcess("--model", poisoned, "--policy", "round_robin", *args,
                           "--health-interval", "0.2", command="route", timeout=60)  # fmt: skip
    try:
        r = post(router.url, prompt="~")
        assert r.status_code == 500 and r.json()["error"]["code"] == "request_failed"
        errors = [finished(w.url, "error") for w in workers]
        assert sorted(errors) == [0, 0, 1], errors  # one worker saw it, once
        assert "radixkv_router:retries_total{" not in httpx.get(f"{router.url}/metrics").text
        assert all(healthy(w.url) for w in workers)
        assert len(httpx.get(f"{router.url}/health").json()["alive"]) == 3
        assert [post(router.url, prompt=f"{CLEAN} {i}").status_code for i in range(3)] == [200] * 3
    finally:
        router.stop()
        for w in workers:
            w.stop()


@pytest.mark.slow
def test_the_router_takes_failed_workers_out_and_is_unhealthy_with_none(broken):
    """A worker whose engine failed leaves the rotation once its ``/health`` fails; the
    router's own ``/health`` lists the live workers, and is 503 when none is."""
    workers = [ServerProcess("--model", broken, *FOLDER_ARGS, timeout=120) for _ in range(2)]
    args = [a for w in workers for a in ("--worker", w.url)]
    router = ServerProcess("--model", broken, "--policy", "round_robin", *args,
                           "--health-interval", "0.1", command="route", timeout=60)  # fmt: skip
    try:
        assert len(httpx.get(f"{router.url}/health").json()["alive"]) == 2
        codes = [post(router.url, prompt=f"request {i}").status_code for i in range(12)]
        assert 200 not in codes and 503 in codes, codes  # 500s, then the engines stop
        for w in workers:
            assert w.proc.wait(60) == 1
        deadline = time.monotonic() + 60
        while httpx.get(f"{router.url}/health").status_code != 503:
            assert time.monotonic() < deadline, "the router stayed healthy with no worker"
            time.sleep(0.05)
        assert httpx.get(f"{router.url}/health").json()["alive"] == []
    finally:
        router.stop()
        for w in workers:
            w.stop()
