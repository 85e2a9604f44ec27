"""`radixkv serve` over HTTP: the prefix cache's effect on time to first token, and what
the HTTP layer costs.

    python benchmarks/bench_serve.py                 # SmolLM2 when installed, else random
    python benchmarks/bench_serve.py --model random --json out.json

1. Cache on vs ``--no-prefix-cache``: eight groups of prompts sharing a ~1,000-token
   system prompt, fixed concurrency, greedy; a server process per setting, driven by
   ``bench-serve``'s client. Reports TTFT p50 (and the ratio), the hit rate against the
   best this arrival order allows (each prefix computed once, the last prompt token
   always computed, whole pages), and whether the outputs are identical.
2. Serving overhead: the tiny random model at concurrency 1, the same prompts through
   HTTP and through an in-process `Engine`; the difference of the TTFT medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import time
from pathlib import Path

from radixkv import RadixCache, RadixKey
from radixkv.bench.client import BenchConfig, run_bench, shared_prefix_items
from radixkv.engine.engine import Engine, load_model
from radixkv.engine.request import SamplingParams
from radixkv.web.process import ServerProcess

RESULTS = Path(__file__).resolve().parent / "results"
SERVER = ["--page-size", "16", "--kv-tokens", "65536", "--max-running", "16"]
SERVER += ["--max-context-len", "4096", "--chunk-size", "2048"]


def best_hit_rate(model: str, cfg: BenchConfig, page: int) -> float:
    """Hits if every shared prefix were computed once, in arrival order (ceiling)."""
    engine_tok = load_model(model)[1]
    tree = RadixCache(page_size=page)
    hit = total = 0
    for item in shared_prefix_items(cfg):
        ids = engine_tok.encode(item.prompt)
        key = RadixKey(ids)
        hit += tree.match_len(key[: len(ids) - 1])
        total += len(ids)
        tree.insert(key)
    return hit / total


def cache_on_off(args: argparse.Namespace) -> dict:
    cfg = BenchConfig(
        num_prompts=args.groups * args.per_group,
        groups=args.groups,
        prompts_per_group=args.per_group,
        system_words=args.system_words,
        question_words=args.question_words,
        max_tokens=args.max_tokens,
        max_concurrency=args.concurrency,
        time_limit=1800,
    )
    reps = {}
    for cache in (False, True):
        flags = [] if cache else ["--no-prefix-cache"]
        with ServerProcess("--model", args.model, *SERVER, *flags, timeout=600) as srv:
            cfg.url = srv.url
            warm = BenchConfig(url=srv.url, num_prompts=2, system_words=20, max_tokens=2, seed=99)
            asyncio.run(run_bench(warm))  # first requests pay for allocations
            reps[cache] = asyncio.run(run_bench(cfg))
        r = reps[cache]
        print(
            f"cache {'on ' if cache else 'off'}: TTFT p50 {r['ttft_s']['p50'] * 1e3:8.1f} ms, "
            f"p90 {r['ttft_s']['p90'] * 1e3:8.1f} ms, E2E p50 {r['e2e_s']['p50']:.2f} s, "
            f"{r['request_throughput']:.2f} req/s, {r['output_throughput']:.1f} out tok/s, "
            f"hit rate {r['server_hit_rate']:.3f}",
            flush=True,
        )
    off, on = reps[False], reps[True]
    best = best_hit_rate(args.model, cfg, 16)
    return {
        "model": on["model"],
        "prompts": cfg.num_prompts,
        "prompt_tokens": on["prompt_tokens"],
        "concurrency": args.concurrency,
        "ttft_p50_off_s": off["ttft_s"]["p50"],
        "ttft_p50_on_s": on["ttft_s"]["p50"],
        "ttft_p90_off_s": off["ttft_s"]["p90"],
        "ttft_p90_on_s": on["ttft_s"]["p90"],
        "ttft_ratio": off["ttft_s"]["p50"] / on["ttft_s"]["p50"],
        "e2e_p50_off_s": off["e2e_s"]["p50"],
        "e2e_p50_on_s": on["e2e_s"]["p50"],
        "throughput_off": off["request_throughput"],
        "throughput_on": on["request_throughput"],
        "hit_rate": on["server_hit_rate"],
        "best_hit_rate": best,
        "hit_rate_of_best": on["server_hit_rate"] / best,
        "identical_outputs": off["outputs"] == on["outputs"],
        "failed": off["requests"]["failed"] + on["requests"]["failed"],
    }


def overhead(args: argparse.Namespace) -> dict:
    """TTFT through HTTP minus TTFT in process, tiny random model, concurrency 1. The two
    alternate request by request on the same prompts (each side with its own cache), so
    drift on a shared machine hits both alike."""
    cfg = BenchConfig(
        num_prompts=args.overhead_requests,
        groups=8,
        prompts_per_group=8,
        system_words=60,
        question_words=8,
        max_tokens=1,
        max_concurrency=1,
    )
    prompts = [item.prompt for item in shared_prefix_items(cfg)]
    engine = Engine(
        "random", page_size=16, kv_tokens=65536, max_running=16, max_context_len=4096,
        chunk_size=2048,
    )  # fmt: skip
    sp = SamplingParams(max_new_tokens=1, ignore_eos=True)

    def local_ttft(prompt: str) -> float:
        t0 = time.perf_counter()
        engine.add_request(prompt, sp, chat=False)
        while not any(o.token_ids for o in engine.step()):
            pass
        ttft = time.perf_counter() - t0
        while engine.has_unfinished():
            engine.step()
        return ttft

    with ServerProcess("--model", "random", *SERVER) as srv:
        host, port = srv.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for warm in ("warm up", "warm up again"):
                local_ttft(warm)
                raw_ttft(sock, host, warm)
            local, raw = [], []
            for prompt in prompts:
                local.append(local_ttft(prompt))
                raw.append(raw_ttft(sock, host, prompt))
        cfg.url = srv.url
        bench = [item.prompt + " (bench-serve)" for item in shared_prefix_items(cfg)]
        cfg.workload, cfg.dataset = "file", _write_prompts(bench)
        rep = asyncio.run(run_bench(cfg))  # bench-serve's client (httpx, asyncio)
    http_p50, local_p50, raw_p50 = (
        rep["ttft_s"]["p50"],
        statistics.median(local),
        statistics.median(raw),
    )
    print(
        f"overhead: TTFT p50 in process {local_p50 * 1e3:.2f} ms; over HTTP "
        f"{raw_p50 * 1e3:.2f} ms with a bare socket client (HTTP adds "
        f"{(raw_p50 - local_p50) * 1e3:.2f} ms), {http_p50 * 1e3:.2f} ms with bench-serve's "
        f"httpx client (adds {(http_p50 - local_p50) * 1e3:.2f} ms)"
    )
    return {
        "requests": len(prompts),
        "ttft_p50_local_s": local_p50,
        "ttft_p50_http_raw_s": raw_p50,
        "ttft_p50_http_httpx_s": http_p50,
        "overhead_raw_s": raw_p50 - local_p50,
        "overhead_httpx_s": http_p50 - local_p50,
    }


def _write_prompts(prompts: list[str]) -> str:
    path = RESULTS / "overhead_prompts.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return str(path)


def raw_ttft(sock: socket.socket, host: str, prompt: str) -> float:
    """TTFT of one streamed completion read from a bare kept-alive socket: the time to
    the first ``data: {`` chunk (no client library in the way)."""
    body = json.dumps(
        {"prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True, "stream": True}
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    t0 = time.perf_counter()
    sock.sendall(head + body)
    buf, first = b"", None
    while not buf.endswith(b"0\r\n\r\n"):  # the chunked body's end
        buf += sock.recv(65536)
        if first is None and b"data: {" in buf:
            first = time.perf_counter() - t0
    assert first is not None and b" 200 OK" in buf[:20], buf[:200]
    return first


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="auto", help="auto, smollm2, random or a folder [auto]")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=8)
    p.add_argument("--system-words", type=int, default=1000)
    p.add_argument("--question-words", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--overhead-requests", type=int, default=64)
    p.add_argument("--only", choices=["cache", "overhead"], help="run one part")
    p.add_argument("--json", default=str(RESULTS / "serve.json"))
    args = p.parse_args()
    if args.model == "auto":
        args.model = "smollm2" if "SmolLM2" in load_model("auto")[2] else "random"
    result = {}
    if args.only != "overhead":
        result["cache"] = c = cache_on_off(args)
        print(
            f"{c['model']}: TTFT p50 {c['ttft_ratio']:.2f}x better with the cache; hit rate "
            f"{c['hit_rate']:.3f} = {c['hit_rate_of_best']:.1%} of the best "
            f"{c['best_hit_rate']:.3f}; identical outputs: {c['identical_outputs']}"
        )
    if args.only != "cache":
        result["overhead"] = overhead(args)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"written to {args.json}")


if __name__ == "__main__":
    main()
