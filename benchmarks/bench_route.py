"""`radixkv route` against SGLang's router on real processes: three `radixkv serve`
replicas (tiny random model) publishing KV events, a router in front, bench-serve's
multi-turn chats, once per router and workload, repeated ``--runs`` times.

    python benchmarks/bench_route.py [--runs 2 --workloads chats,system,pressure]

Workloads: ``chats`` (multi-turn, nothing shared between conversations), ``system`` (the
same with one shared system prompt), ``pressure`` and ``tight`` (each replica's KV pool
about 75% and 40% of its share of the working set, so caches churn and a router that
does not hear evictions goes stale), ``keys`` (tenants, each with its own prefix and
``prompt_cache_key``: a radixkv router keeps a key on one worker). Routers: every radixkv
policy, and SGLang's router
(``sglang-router``, ``cache_aware``) when ``benchmarks/peers/setup.sh router`` has built
it (``--peer``).

Between routers every replica's cache is flushed (the router hears it as events) and a
new router starts, so each starts cold. Each round runs every router once, `kv` and
SGLang's right after one another, so ``--runs 5`` gives 5 interleaved pairs;
``--kv-tokens 10240,20480,40960`` runs each workload at each pool size. Reported: the
replicas' prefix-cache hit rate and prompt tokens computed (their /metrics), TTFT,
imbalance (the busiest replica's requests over the mean), the router's CPU time, for
radixkv the reuse decomposed (available / captured / delivered), and per size each
pair's ratio, every router's median and range, and the fleet simulator's prediction for
the same turns (`radixkv.sim.fleet`). The issue's pressure setup:

    OMP_NUM_THREADS=1 python benchmarks/bench_route.py --workload pressure --runs 5 \
        --conversations 48 --turns 6 --concurrency 16 --kv-tokens 10240,20480,40960
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import statistics
import subprocess
from pathlib import Path

import httpx

from radixkv.bench.client import BenchConfig, multi_turn_items, run_bench, shared_system
from radixkv.sim.fleet import StepCost
from radixkv.web.process import ServerProcess, free_port, free_port_pair, wait_healthy

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = ["--model", "random"]  # the replicas' and routers' model (--hybrid: a Qwen3.5 folder)
WORKER = ["--page-size", "16", "--max-running", "16",
          "--max-context-len", "8192", "--chunk-size", "2048",
          "--admin-key", "bench-admin"]  # fmt: skip
KV_TOKENS = 65536  # per replica; the pressure workload's is a quarter of its working set
PEER = Path.home() / ".cache" / "radixkv-peers" / "router" / "bin" / "python"
WORKLOADS = ("chats", "system", "pressure", "tight", "keys")
# each replica's KV pool as a share of its part of the working set (1/replicas of it):
# "pressure" about three quarters, "tight" about 40%; the others have plenty
POOL_SHARE = {"pressure": 0.75, "tight": 0.4}
ADMIN = {"Authorization": "Bearer bench-admin"}  # /flush_cache is an admin endpoint
POLICIES = ("round_robin", "least_load", "approx", "kv")


def write_hybrid(path: Path) -> Path:
    """A tiny random ``Qwen3_5ForCausalLM`` folder (kept between runs)."""
    if not (path / "config.json").exists():
        import torch
        import transformers

        torch.manual_seed(0)
        conf = transformers.Qwen3_5TextConfig(
            vocab_size=384, hidden_size=64, intermediate_size=176, num_hidden_layers=8,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            max_position_embeddings=16384,
        )  # fmt: skip
        transformers.Qwen3_5ForCausalLM(conf).save_pretrained(path)
    return path


def worker_totals(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        m = re.match(r"radixkv:(\w+_total)\{[^}]*\} ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


REUSE = (
    "prompt_tokens",
    "fleet_available_tokens",
    "routing_captured_tokens",
    "engine_delivered_tokens",
)  # the router's decomposed reuse counters


def rss_mb(pid: int) -> float:
    """A process's resident memory (Linux /proc), MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_s(pid: int) -> float:
    """A process's CPU time so far, user + system (Linux /proc), seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def router_totals(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    text = httpx.get(f"{url}/metrics").text
    for line in text.splitlines():
        m = re.match(r"radixkv_router:(\w+)_total ([0-9.e+-]+)$", line)
        if m and m.group(1) in REUSE:
            out[m.group(1)] = float(m.group(2))
    return out


def start_router(specs: list[str], policy: str, weight: float | None) -> ServerProcess:
    args = [a for s in specs for a in ("--worker", s)]
    if weight is not None:
        args += ["--kv-weight", str(weight)]
    return ServerProcess(*MODEL, "--policy", policy, *args, command="route")


class StateLog:
    """Polls a radixkv router's /route/state into a JSONL file while a run lasts (with
    ``--logs``): in flight, queued and indexed blocks per worker, to see why it chose."""

    def __init__(self, url: str, path: Path, every: float = 0.25) -> None:
        import threading

        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url, path, every), daemon=True)
        self._thread.start()

    def _run(self, url: str, path: Path, every: float) -> None:
        with path.open("a") as f:
            while not self._stop.wait(every):
                with contextlib.suppress(httpx.HTTPError):
                    f.write(httpx.get(f"{url}/route/state", timeout=2).text + "\n")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class PeerRouter:
    """SGLang's router (``sglang_router.launch_router``, ``cache_aware``) on a free port."""

    def __init__(self, python: Path, urls: list[str], timeout: float = 60) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [str(python), "-m", "sglang_router.launch_router", "--worker-urls", *urls,
             "--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(port),
             "--log-level", "warn"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_healthy(self.proc, self.url, timeout)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def working_set_tokens(args: argparse.Namespace) -> int:
    """Tokens of every conversation's last turn (each holds its whole history), roughly:
    words are ~1.5 tokens under the random model's byte-level tokenizer, plus answers."""
    words = args.first_words + (args.turns - 1) * args.message_words
    return args.conversations * int(words * 6 + args.turns * args.max_tokens)


def simulate(args: argparse.Namespace, workload: str, kv_tokens: int, routers: list[str]) -> dict:
    """The same workload through the fleet simulator (`radixkv.sim.fleet`: the replicas'
    own engine on a clock, the shipped routing core, SGLang's cache_aware as its source
    decides): each router's simulated hit rate, to set beside the live median."""
    from radixkv.sim.fleet import Conversation, chat_turns, simulate_fleet

    cfg = BenchConfig(
        workload="multi-turn", conversations=args.conversations, turns=args.turns,
        first_words=args.first_words, message_words=args.message_words,
        max_tokens=args.max_tokens, num_prompts=args.conversations * args.turns,
        shared_system_words=args.system_words if workload == "system" else 0,
    )  # fmt: skip
    by_conv: dict[int, list[str]] = {}
    for item in multi_turn_items(cfg):
        by_conv.setdefault(item.conversation, []).append(item.prompt)
    system = shared_system(cfg)
    key = (workload, args.conversations, args.turns)
    if key not in TURNS:  # the model's answers, generated once per workload
        TURNS[key] = chat_turns([Conversation(m, system) for m in by_conv.values()],
                                args.max_tokens, model=MODEL[1])  # fmt: skip
    out = {}
    for router in routers:
        name = "cache_aware" if router == "sglang:cache_aware" else router
        hits = [
            simulate_fleet(TURNS[key], args.replicas, kv_tokens, name, args.concurrency,
                           SIM_COST, SIM_EVENT_LAG_S, model=MODEL[1], wire_s=SIM_WIRE_S,
                           seed=seed, release_race=SIM_RELEASE_RACE).token_hit_rate
            for seed in range(SIM_SEEDS)
        ]  # fmt: skip
        out[router] = statistics.median(hits)
    return out


TURNS: dict = {}
# this machine (three replicas on two cores, one torch thread each, behind a router and
# bench-serve), fitted to the live medians of both workloads at 10,240-65,536 tokens:
# a step's cost (the live runs' 4-6 s for 288 turns) with 30% jitter, 20 ms each way
# between the router and a replica (HTTP, the router's own time), events 5 ms behind;
# the median of 5 seeds, as the live side is a median of runs
SIM_COST = StepCost(0.0072, 3.6e-5, 5.2e-4, jitter=0.3)
SIM_WIRE_S = 0.02
SIM_EVENT_LAG_S = 0.005  # ZeroMQ on loopback, then the router's subscriber thread
# how often the router hears of an answer's end only after the client's next request
# (both come a few hundred microseconds after the last chunk, on a loaded machine):
# fitted to least_load, the one policy it moves by more than 0.013 (0.376 -> 0.234 at
# 20,480; live 0.224 and 0.245 on two days)
SIM_RELEASE_RACE = 0.7
SIM_SEEDS = 5


def run_one(args: argparse.Namespace, workload: str, router: str, workers: list, specs: list[str],
            model: str) -> dict:  # fmt: skip
    urls = [w.url for w in workers]
    for url in urls:
        httpx.post(f"{url}/flush_cache", headers=ADMIN).raise_for_status()
    peer = router == "sglang:cache_aware"
    log = None
    if args.logs is not None:
        args.logs.mkdir(parents=True, exist_ok=True)
        log = args.logs / f"{workload}-{router}.log"
    proc = PeerRouter(args.peer, urls) if peer else start_router(specs, router, args.kv_weight)
    try:
        before = {u: worker_totals(u) for u in urls}
        if workload == "keys":  # tenants, each with its own prompt_cache_key and prefix
            cfg = BenchConfig(
                url=proc.url, workload="shared-prefix", groups=args.tenants,
                prompts_per_group=args.turns * 2, system_words=args.first_words,
                question_words=args.message_words, max_tokens=args.max_tokens,
                num_prompts=args.tenants * args.turns * 2, max_concurrency=args.concurrency,
                time_limit=900, model=model, cache_keys=True,
            )  # fmt: skip
        else:
            cfg = BenchConfig(
                url=proc.url, workload="multi-turn", conversations=args.conversations,
                turns=args.turns, first_words=args.first_words,
                message_words=args.message_words, max_tokens=args.max_tokens,
                num_prompts=args.conversations * args.turns, max_concurrency=args.concurrency,
                time_limit=900, model=model,
                shared_system_words=args.system_words if workload == "system" else 0,
            )  # fmt: skip
        reused = {} if peer else router_totals(proc.url)
        rss_before, cpu_before = rss_mb(proc.proc.pid), cpu_s(proc.proc.pid)
        watch = None if peer or log is None else StateLog(proc.url, log.with_suffix(".jsonl"))
        try:
            rep = asyncio.run(run_bench(cfg))
        finally:
            if watch is not None:
                watch.stop()
        after = {u: worker_totals(u) for u in urls}
        rss_after, cpu = rss_mb(proc.proc.pid), cpu_s(proc.proc.pid) - cpu_before
        if not peer:
            reused = {k: v - reused.get(k, 0) for k, v in router_totals(proc.url).items()}
    finally:
        proc.stop()
        if log is not None and not peer:  # its warnings: workers out and back
            with log.open("a") as f:
                f.write(proc.stderr())
    served = [after[u].get("request_success_total", 0) - before[u].get("request_success_total", 0)
              for u in urls]  # fmt: skip
    mean = sum(served) / len(served)
    return {
        "workload": workload,
        "router": router,
        "completed": rep["requests"]["completed"],
        "failed": rep["requests"]["failed"],
        # the workload's own requests, by their usage (bench-serve's size probe, sent
        # only where /v1/models gives a context length, is left out for every router)
        "hit_rate": rep["cached_tokens"] / max(rep["prompt_tokens"], 1),
        "prefill_tokens": rep["prompt_tokens"] - rep["cached_tokens"],
        "ttft_p50_s": rep["ttft_s"]["p50"],
        "ttft_p90_s": rep["ttft_s"]["p90"],
        "imbalance": max(served) / mean if mean else 1.0,
        "per_worker": served,
        # keys: per tenant, how many workers its requests went to (a radixkv router's)
        "workers_per_key": sorted(len(v) for v in rep.get("key_workers", {}).values()),
        "duration_s": rep["duration_s"],
        "router_rss_mb": [rss_before, rss_after],  # before and after the run
        "router_cpu_s": cpu,  # the router's CPU time during the run
        # reuse decomposed (the router's tokens): available, captured, delivered
        **{
            k.removesuffix("_tokens") + "_rate": (
                reused[k] / max(reused.get("prompt_tokens", 0), 1) if k in reused else None
            )
            for k in REUSE[1:]
        },
    }


def show(row: dict) -> None:
    rates = ("fleet_available_rate", "routing_captured_rate", "engine_delivered_rate")
    decomposed = (
        "available / captured / delivered " + " / ".join(f"{row[k]:.3f}" for k in rates)
        if row["fleet_available_rate"] is not None
        else ""
    )
    per_key = row.get("workers_per_key")
    keys = f"workers per key {per_key}  " if per_key else ""
    print(
        f"{row['workload']:<9}{row['router']:<20} hit {row['hit_rate']:.3f}  prefill "
        f"{row['prefill_tokens']:>8,.0f}  TTFT p50 {row['ttft_p50_s'] * 1e3:6.0f} ms  p90 "
        f"{row['ttft_p90_s'] * 1e3:6.0f} ms  imbalance {row['imbalance']:.2f} "
        f"{[int(x) for x in row['per_worker']]}  {decomposed}  {keys}"
        f"({row['completed']} ok, {row['failed']} failed, {row['duration_s']:.1f} s, router "
        f"RSS {row['router_rss_mb'][0]:.0f} -> {row['router_rss_mb'][1]:.0f} MB, CPU "
        f"{row['router_cpu_s']:.1f} s)",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first-words", type=int, default=150)
    p.add_argument("--message-words", type=int, default=20)
    p.add_argument("--system-words", type=int, default=120,
                   help="the shared system prompt of the 'system' workload [120]")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--tenants", type=int, default=12,
                   help="the 'keys' workload's tenants, each with its own prefix and "
                   "prompt_cache_key [12]")  # fmt: skip
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--kv-weight", type=float, help="the kv router's weight [its default]")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--workloads", "--workload", default=",".join(WORKLOADS))
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--kv-tokens", type=lambda t: [int(x) for x in t.split(",")],
                   help="each replica's KV pool, tokens; several (10240,20480,40960) run "
                   "each workload at each [sized per workload]")  # fmt: skip
    p.add_argument(
        "--peer",
        type=Path,
        default=Path(os.environ.get("SGLANG_ROUTER_PYTHON", PEER)),
        help="the sglang-router environment's python [~/.cache/radixkv-peers/router]",
    )
    p.add_argument("--hybrid", action="store_true",
                   help="replicas on a tiny random Qwen3.5 (recurrent state checkpoints: "
                   "their KV events name checkpoints only)")  # fmt: skip
    p.add_argument("--json", default=str(RESULTS / "route.json"))
    p.add_argument("--logs", type=Path, help="a folder for the radixkv routers' stderr")
    p.add_argument("--soak", type=int, default=0,
                   help="also send this many distinct prompts through kv and report the "
                   "router's memory as they go [0: no soak]")  # fmt: skip
    args = p.parse_args()
    # one torch thread per replica: with two each, three replicas on two cores starve
    # one another at random, and whichever runs first answers first (a router that
    # watches queues then rightly favours it: the imbalance measured is the machine's)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.hybrid:  # a tiny random Qwen3.5 (Gated DeltaNet + attention), as transformers writes it
        MODEL[1] = str(write_hybrid(RESULTS / "qwen3_5-tiny"))
    routers = args.policies.split(",")
    if args.peer.exists():  # right after kv: the runs interleave kv, cache_aware, kv, ...
        routers.insert(routers.index("kv") + 1 if "kv" in routers else 0, "sglang:cache_aware")
    else:
        print(f"no SGLang router at {args.peer}: benchmarks/peers/setup.sh router builds it")
    rows = []
    sizes = [(w, n) for w in args.workloads.split(",") for n in args.kv_tokens or [None]]
    for workload, given in sizes:
        kv_tokens = KV_TOKENS
        if workload in POOL_SHARE:
            kv_tokens = int(working_set_tokens(args) / args.replicas * POOL_SHARE[workload])
        kv_tokens = max(2048, (given or kv_tokens) // 16 * 16)
        ports = [free_port_pair() for _ in range(args.replicas)]
        flags = [*MODEL, *WORKER, "--kv-tokens", str(kv_tokens)]
        workers = [ServerProcess(*flags, "--kv-events", f"tcp://127.0.0.1:{q}") for q in ports]
        specs = [f"{w.url},tcp://127.0.0.1:{q}" for w, q in zip(workers, ports, strict=True)]
        name = httpx.get(f"{workers[0].url}/v1/models").json()["data"][0]["id"]
        print(f"{workload}: {args.replicas} replicas of {kv_tokens:,} KV tokens", flush=True)
        try:
            for run in range(args.runs):
                for router in routers:
                    row = run_one(args, workload, router, workers, specs, name)
                    row["run"], row["kv_tokens"] = run, kv_tokens
                    rows.append(row)
                    show(row)
        finally:
            for w in workers:
                w.stop()
        if workload in ("chats", "system", "pressure", "tight") and not args.hybrid:
            sims = simulate(args, workload, kv_tokens, routers)
            rows.append({"workload": workload, "kv_tokens": kv_tokens, "simulated": sims})
    summarize(rows)
    if args.soak:
        rows.append(soak(args))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=2))


def soak(args: argparse.Namespace) -> dict:
    """``--soak N``: N distinct prompts through the kv router over two small replicas
    (4,096 KV tokens each): the router's memory must follow what the fleet holds, not
    grow with what it was told (the finding: +9 KB a request, no plateau)."""
    ports = [free_port_pair() for _ in range(2)]
    flags = [*MODEL, *WORKER, "--kv-tokens", "4096"]
    workers = [ServerProcess(*flags, "--kv-events", f"tcp://127.0.0.1:{q}") for q in ports]
    specs = [f"{w.url},tcp://127.0.0.1:{q}" for w, q in zip(workers, ports, strict=True)]
    router = start_router(specs, "kv", args.kv_weight)
    try:
        marks = []
        for part in range(4):
            cfg = BenchConfig(
                url=router.url, workload="shared-prefix", groups=args.soak // 4,
                prompts_per_group=1, system_words=60, question_words=8, max_tokens=4,
                num_prompts=args.soak // 4, max_concurrency=8, time_limit=900, seed=part,
            )  # fmt: skip
            rep = asyncio.run(run_bench(cfg))
            state = httpx.get(f"{router.url}/route/state").json()
            marks.append({
                "requests": (part + 1) * (args.soak // 4),
                "failed": rep["requests"]["failed"],
                "router_rss_mb": rss_mb(router.proc.pid),
                "indexed_blocks": sum(w["indexed_blocks"] for w in state["workers"]),
            })  # fmt: skip
            print(f"soak: {marks[-1]}", flush=True)
    finally:
        router.stop()
        for w in workers:
            w.stop()
    return {"soak": marks}


def summarize(rows: list[dict]) -> None:
    """Per workload and KV size: each run's kv ÷ cache_aware hit rate (the pair run
    back to back), then every router's medians over the runs, and kv's median ratio,
    its lowest pair, and its ratio to approx."""

    for workload, kv_tokens in dict.fromkeys((r["workload"], r["kv_tokens"]) for r in rows):
        here = [r for r in rows if r["workload"] == workload and r["kv_tokens"] == kv_tokens]
        mine = [r for r in here if "router" in r]
        sims = next((r["simulated"] for r in here if "simulated" in r), {})
        ratios = []
        for run in sorted({r["run"] for r in mine}):
            by = {r["router"]: r for r in mine if r["run"] == run}
            if "kv" in by and "sglang:cache_aware" in by:
                peer = by["sglang:cache_aware"]["hit_rate"]
                ratios.append(by["kv"]["hit_rate"] / max(peer, 1e-9))
        print(
            f"{workload}, {kv_tokens:,} KV tokens a replica, medians of "
            f"{len({r['run'] for r in mine})} run(s):"
        )
        med: dict[str, dict] = {}
        for router in dict.fromkeys(r["router"] for r in mine):
            runs = [r for r in mine if r["router"] == router]
            med[router] = {k: statistics.median(r[k] for r in runs)
                           for k in ("hit_rate", "ttft_p90_s", "imbalance")}  # fmt: skip
            hits = sorted(r["hit_rate"] for r in runs)
            sim = f"  simulated {sims[router]:.3f}" if router in sims else ""
            print(f"  {router:<20} hit {med[router]['hit_rate']:.3f} ({hits[0]:.3f}-{hits[-1]:.3f})"
                  f"  TTFT p90 {med[router]['ttft_p90_s'] * 1e3:.0f} ms  imbalance "
                  f"{med[router]['imbalance']:.2f}{sim}")  # fmt: skip
        if ratios:
            peer = med["sglang:cache_aware"]
            print(
                f"  kv / cache_aware: median {statistics.median(ratios):.3f}x, pairs "
                f"{' '.join(f'{x:.3f}' for x in ratios)} (lowest {min(ratios):.3f}); TTFT "
                f"p90 {med['kv']['ttft_p90_s'] / max(peer['ttft_p90_s'], 1e-9):.2f}x"
            )
        if "kv" in med and "approx" in med:
            ratio = med["kv"]["hit_rate"] / max(med["approx"]["hit_rate"], 1e-9)
            print(f"  kv / approx: {ratio:.3f}x")


if __name__ == "__main__":
    main()
