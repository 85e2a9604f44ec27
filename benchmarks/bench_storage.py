"""The shared KV tier on Redis: a second engine process against a cold one.

    python benchmarks/bench_storage.py [--model auto] [--redis redis://127.0.0.1:6379/14]

Three processes run the same greedy workload (eight questions sharing a ~1,000-word
system prompt, one after another, so each time to first token is one request's):
the first with ``storage=REDIS`` (it computes and writes the pages), the second with the
same store (it reads them), the third cold without a store. Reported: TTFT p50 of the
second and the third, the store's read rate (page bytes / time reading, decode and pool
writes included) beside the prefill it replaced, and whether the outputs are identical.
The Redis database is flushed first.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import redis

from radixkv.bench.client import WORDS

RESULTS = Path(__file__).resolve().parent / "results"

CHILD = """
import json, statistics, sys, time
from radixkv.engine.engine import Engine
from radixkv.engine.request import SamplingParams
model, storage, prompts = sys.argv[1], (sys.argv[2] or None), json.loads(sys.argv[3])
e = Engine(model, page_size=16, kv_tokens=32768, max_context_len=4096, storage=storage)
e.generate(["warm up"], max_new_tokens=2, chat=False)
ttft, outs = [], []
for p in prompts:
    t0 = time.perf_counter()
    rid = e.add_request(p, SamplingParams(max_new_tokens=16, ignore_eos=True), chat=False)
    first, ids = None, []
    while e.has_unfinished():
        for o in e.step():
            if o.token_ids and first is None:
                first = time.perf_counter() - t0
            ids += o.token_ids
    ttft.append(first)
    outs.append(ids)
    e.flush_cache()  # each request alone: the device cache does not help the next one
if e.tier is not None:
    e.tier.flush()
st = e.tier.stats if e.tier is not None else None
print(json.dumps({"ttft_p50": statistics.median(ttft), "outputs": outs,
                  "hit_tokens": e.tier.hit_tokens if e.tier else 0,
                  "bytes_read": st.bytes_read if st else 0, "read_s": st.read_s if st else 0,
                  "bytes_written": st.bytes_written if st else 0,
                  "write_s": st.write_s if st else 0,
                  "pages_written": st.pages_written if st else 0}))
"""


def child(model: str, storage: str, prompts: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, model, storage, json.dumps(prompts)],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def host_tier(model: str, system: str) -> dict:
    """The host tier's load rate (SmolLM2's pages), and a working set 4x the device pool:
    device + host against one pool of the same total size and against the device alone."""
    from radixkv.engine.engine import Engine

    e = Engine(model, page_size=16, kv_tokens=32768, max_context_len=4096, host_tokens=32768)
    prompts = [f"{system}\nQuestion {i}?" for i in range(4)]
    e.generate(prompts[:1], max_new_tokens=1, chat=False)
    for p in prompts:
        e.flush_cache()  # the device forgets: every page is demoted to the host pool
        e.generate([p], max_new_tokens=1, chat=False)
    st = e.tier.stats
    rate = st.host_load_bytes / st.host_load_s / 1e9 if st.host_load_s else 0.0
    # working set: 16 prefixes of 512 tokens = 8,192 tokens; the device holds 2,048
    rng_prompts = [[g * 7 % 251 + 1] * 512 + [q + 1] for q in range(4) for g in range(16)]
    rates = {}
    for name, kw in (("device 2k", {"kv_tokens": 2048}),
                     ("device 2k + host 6k", {"kv_tokens": 2048, "host_tokens": 6144}),
                     ("device 8k", {"kv_tokens": 8192})):  # fmt: skip
        eng = Engine("random", page_size=16, max_context_len=1024, **kw)
        hit = sum(
            eng.generate([p], max_new_tokens=1, ignore_eos=True).stats.cached_tokens
            for p in rng_prompts
        )
        rates[name] = hit / sum(len(p) for p in rng_prompts)
    return {"host_load_gb_s": rate, "host_loaded_mb": st.host_load_bytes / 1e6,
            "working_set_4x": rates}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="auto")
    p.add_argument("--redis", default="redis://127.0.0.1:6379/14")
    p.add_argument("--system-words", type=int, default=1000)
    p.add_argument("--only", choices=["redis", "host"], help="run one part")
    p.add_argument("--json", default=str(RESULTS / "storage.json"))
    args = p.parse_args()
    system = " ".join(WORDS[i * 7 % len(WORDS)] for i in range(args.system_words))
    prompts = [f"{system}\nQuestion {i}: what is {WORDS[i]}?" for i in range(8)]
    if args.only == "host":
        model = "smollm2" if args.model == "auto" else args.model
        result = host_tier(model, system)
        ws = result["working_set_4x"]
        print(f"host tier: loaded {result['host_loaded_mb']:.0f} MB at "
              f"{result['host_load_gb_s']:.2f} GB/s; working set 4x the device: hit rate "
              + ", ".join(f"{k} {v:.3f}" for k, v in ws.items()))  # fmt: skip
        return
    redis.Redis.from_url(args.redis).flushdb()
    writer = child(args.model, args.redis, prompts)
    reader = child(args.model, args.redis, prompts)
    cold = child(args.model, "", prompts)
    rate = reader["bytes_read"] / reader["read_s"] / 1e6 if reader["read_s"] else 0.0
    wrate = writer["bytes_written"] / writer["write_s"] / 1e6 if writer["write_s"] else 0.0
    result = {
        "model": args.model,
        "ttft_p50_cold_s": cold["ttft_p50"],
        "ttft_p50_second_process_s": reader["ttft_p50"],
        "ttft_ratio": cold["ttft_p50"] / reader["ttft_p50"],
        "store_hit_tokens": reader["hit_tokens"],
        "pages_written": writer["pages_written"],
        "read_mb_s": rate,
        "write_mb_s": wrate,
        "read_s": reader["read_s"],
        "identical_outputs": reader["outputs"] == cold["outputs"] == writer["outputs"],
    }
    print(
        f"TTFT p50: cold {cold['ttft_p50'] * 1e3:.0f} ms, second process "
        f"{reader['ttft_p50'] * 1e3:.0f} ms ({result['ttft_ratio']:.1f}x); read "
        f"{reader['bytes_read'] / 1e6:.1f} MB from Redis at {rate:.0f} MB/s (written at "
        f"{wrate:.0f} MB/s); identical "
        f"outputs: {result['identical_outputs']}"
    )
    redis.Redis.from_url(args.redis).flushdb()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
