"""Shared test helpers: a recording allocator, a full snapshot of a cache's state, a
lifecycle fuzzer's step plan, chats through the official client, tiny checkpoint folders
written by transformers' own ``save_pretrained``."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import torch

from radixkv import RadixCache


class RecordingAllocator:
    """Stands in for a slot allocator in tree tests: records what the tree frees."""

    def __init__(self) -> None:
        self.freed: list[int] = []
        self.calls = 0

    def free(self, indices: torch.Tensor) -> None:
        assert indices.dtype == torch.int64 and indices.dim() == 1
        self.calls += 1
        self.freed.extend(indices.tolist())


def snapshot(cache: RadixCache) -> Any:
    """Everything observable about a cache: structure, statistics, sizes, clock."""
    nodes = [
        (
            n.id,
            n.parent.id if n.parent else None,
            n.lock_ref,
            n.last_access,
            n.hit_count,
            n.created,
            n.priority,
            n.extra_key,
            n.key_bytes,
            n.value_bytes,
        )
        for n in cache.iter_nodes()
    ]
    return (
        nodes,
        cache.evictable_size(),
        cache.protected_size(),
        cache._clock,
        cache._next_id,
        cache.num_nodes(),
    )


def content(cache: RadixCache) -> dict[tuple, tuple]:
    """The cache as a brute-force map, one entry per cached *page* (sharing is per whole
    page): (namespace, pages of the prefix ending with it) -> that page's slot indices.
    A page is a tuple of units (tokens, or bigram pairs)."""
    page = cache.page_size
    out: dict[tuple, tuple] = {}
    stack = [(child, ()) for child in cache.root.children.values()]
    while stack:
        node, prefix = stack.pop()
        keys = np.frombuffer(node.key_bytes, dtype=np.int64)
        units = keys.reshape(-1, 2).tolist() if node.is_bigram else keys.tolist()
        units = [tuple(u) for u in units] if node.is_bigram else units
        values = np.frombuffer(node.value_bytes, dtype=np.int64).tolist()
        assert len(units) == len(values) and len(units) % page == 0
        for i in range(0, len(units), page):
            prefix = (*prefix, tuple(units[i : i + page]))
            out[(node.extra_key, prefix)] = tuple(values[i : i + page])
        stack.extend((child, prefix) for child in node.children.values())
    return out


def removed_values(before: dict, after: dict) -> Counter:
    """Slot indices of the pages that left the cache (which must only shrink)."""
    assert all(k in before and before[k] == v for k, v in after.items()), "cache gained entries"
    return Counter(v for k, vals in before.items() if k not in after for v in vals)


def step_plan(reqs: list, chunk: int, draw: Any, longest: int) -> tuple[list, list[int]]:
    """One engine-like step for a lifecycle fuzzer: each request prefills up to ``chunk``
    tokens or, its prompt done and under ``longest`` tokens, decodes one (``draw()``
    samples the token fed back). Returns (requests, counts) for ``allocate_batch``."""
    batch, counts = [], []
    for req in reqs:
        if req.kv_len < len(req.input_ids):
            counts.append(min(chunk, len(req.input_ids) - req.kv_len))
        elif req.num_tokens < longest:
            if req.kv_len == req.num_tokens:
                req.output_ids.append(draw())
            counts.append(req.num_tokens - req.kv_len)
        else:
            continue
        batch.append(req)
    return batch, counts


def cached_chats(client: Any, model: str, system: str, questions: tuple[str, ...]) -> list[int]:
    """Chats through the official ``openai`` client, one after another, sharing a system
    message: each one's ``cached_tokens``."""
    cached = []
    for question in questions:
        out = client.chat.completions.create(
            model=model, messages=[{"role": "system", "content": system},
                                   {"role": "user", "content": question}],
            max_tokens=3, temperature=0,
        )  # fmt: skip
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
    return cached


def qwen3_5_folder(path: Any, tweak: Any = None) -> str:
    """A tiny random Qwen3.5 folder (Gated DeltaNet + gated attention, 4 layers);
    ``tweak(model)`` changes its weights before they are saved."""
    import transformers

    torch.manual_seed(0)
    conf = transformers.Qwen3_5TextConfig(
        vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
    )  # fmt: skip
    model = transformers.Qwen3_5ForCausalLM(conf)
    if tweak is not None:
        tweak(model)
    model.save_pretrained(path)
    return str(path)


def metric(url: str, name: str) -> float:
    """A metric's value from a server's ``/metrics`` (0 when absent)."""
    import httpx

    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f"{name} ") or line.startswith(f"{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def routed_conversations(router: Any, workers: list, told: str) -> tuple[list, float, float]:
    """Four interleaved 4-turn conversations through a ``radixkv route`` process; after
    each request, waits (bounded) until the router's index holds what each worker's
    ``told`` gauge says its events told. Returns each conversation's ``cached_tokens``
    per turn, and what routing captured and the engines delivered."""
    import time

    import httpx

    def settle() -> None:
        deadline = time.monotonic() + 30
        while True:
            rows = httpx.get(f"{router.url}/route/state").json()["workers"]
            state = {w["url"]: w["indexed_blocks"] for w in rows}
            held = {w.url: metric(w.url, told) for w in workers}
            if all(state[u] == held[u] for u in held):
                return
            assert time.monotonic() < deadline, (state, held)
            time.sleep(0.05)

    talks = [f"Conversation {c}: tell me about the number {c * 37}. " * 3 for c in range(4)]
    cached: list[list[int]] = [[] for _ in talks]
    for turn in range(4):
        for c in range(len(talks)):
            body = {"prompt": talks[c], "max_tokens": 3, "temperature": 0}
            r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            cached[c].append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            talks[c] += f" Reply {turn}: noted. Next question, number {turn}? " * 2
            settle()
    captured = metric(router.url, "radixkv_router:routing_captured_tokens_total")
    delivered = metric(router.url, "radixkv_router:engine_delivered_tokens_total")
    return cached, captured, delivered


def engine_process(folder: Any, storage: str, prompts: list[list[int]], **kw: Any) -> list:
    """A second Python process: an `Engine` on ``folder`` with ``storage`` (and ``kw``)
    generates 6 greedy tokens for each prompt, one after another, and waits for its
    writes; returns ``[[output ids, cached tokens], ...]``."""
    import json
    import subprocess
    import sys

    script = (
        "import json, sys\n"
        "from radixkv.engine.engine import Engine\n"
        f"e = Engine({str(folder)!r}, storage={storage!r}, **json.loads(sys.argv[2]))\n"
        "prompts = json.loads(sys.argv[1])\n"
        "out = [e.generate([p], max_new_tokens=6, chat=False, ignore_eos=True) for p in prompts]\n"
        "e.tier.flush()\n"
        "print(json.dumps([[o.outputs[0].token_ids, o.stats.cached_tokens] for o in out]))\n"
    )
    done = subprocess.run([sys.executable, "-c", script, json.dumps(prompts), json.dumps(kw)],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(done.stdout)
