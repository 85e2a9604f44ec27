"""Seeded benchmark workloads, shared by every implementation's adapter.

Each builder returns plain Python data (lists of int token ids), so an adapter running
in another virtual environment can rebuild exactly the same workload from the same seed.
Token ids are drawn from a 32k vocabulary.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Iterator

VOCAB = 32_000


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def shared_system_prompt(
    seed: int = 0,
    requests: int = 2000,
    prompts: int = 8,
    prompt_len: int = 1024,
    suffix_len: int = 256,
) -> list[list[int]]:
    """(a) Each request is one of ``prompts`` system prompts plus a unique suffix."""
    rng = random.Random(seed)
    systems = [_tokens(rng, prompt_len) for _ in range(prompts)]
    return [systems[rng.randrange(prompts)] + _tokens(rng, suffix_len) for _ in range(requests)]


def multi_turn_chat(
    seed: int = 0,
    conversations: int = 200,
    turns: int = 8,
    answer_len: int = 128,
    message_len: int = 64,
) -> list[list[int]]:
    """(b) Each turn's prompt is the previous prompt + the previous answer + a new message.
    Turns of different conversations are interleaved round-robin."""
    rng = random.Random(seed)
    prompts: list[list[list[int]]] = []
    for _ in range(conversations):
        conv, history = [], _tokens(rng, message_len)
        for _ in range(turns):
            conv.append(history)
            history = history + _tokens(rng, answer_len) + _tokens(rng, message_len)
        prompts.append(conv)
    return [prompts[c][t] for t in range(turns) for c in range(conversations)]


def eviction_leaves(
    seed: int = 0,
    leaves: int = 5000,
    total_tokens: int = 200_000,
    refills: int = 500,
    refill_tokens: int = 1024,
) -> tuple[list[list[int]], list[list[list[int]]]]:
    """(c) ``leaves`` sequences of equal length under 50 shared 8-token stems, then one
    batch of fresh sequences (``refill_tokens`` in all) to insert before each evict."""
    rng = random.Random(seed)
    leaf_len = total_tokens // leaves
    stems = [_tokens(rng, 8) for _ in range(50)]
    initial = [stems[i % 50] + _tokens(rng, leaf_len - 8) for i in range(leaves)]
    per_batch = max(1, refill_tokens // leaf_len)
    batches = [
        [stems[rng.randrange(50)] + _tokens(rng, leaf_len - 8) for _ in range(per_batch)]
        for _ in range(refills)
    ]
    return initial, batches


def deep_chain(seed: int = 0, tokens: int = 32_768, nodes: int = 256) -> list[list[int]]:
    """(d) Growing prefixes of one long prompt: inserting them in order stores the prompt
    as a chain of ``nodes`` nodes. The last entry is the whole prompt (the query)."""
    rng = random.Random(seed)
    full = _tokens(rng, tokens)
    step = tokens // nodes
    return [full[: step * (i + 1)] for i in range(nodes)]


def request_path(seed: int = 0) -> list[list[int]]:
    """(e) The full request path replays workload (a)'s requests."""
    return shared_system_prompt(seed)


STEP_PHASES = 8  # admit + chunk 1, chunk 2, five decodes, finish
STEP_ADMITS = 8  # requests entering each phase per step: 8 x 8 = 64 requests a step


def scheduler_steps(
    seed: int = 0,
    steps: int = 120,
    prompts: int = 8,
    prompt_len: int = 1024,
    suffix_len: int = 512,
    outputs: int = 6,
) -> tuple[list[array], list[array]]:
    """(g) A continuous-batching scheduler in steady state. ``STEP_ADMITS`` requests (one
    of ``prompts`` system prompts + a unique suffix) arrive every step; request ``i``
    arrives at step ``i // STEP_ADMITS`` and then, one phase a step (`step_phases`):

        age 0   admit (match all but the last prompt token, lock), compute the first half
                of what the cache lacks, cache it (a chunked prefill)
        age 1   compute the second half, cache the prompt; its first output is sampled
        age 2-6 decode: compute the KV of the last sampled token, sample the next
        age 7   finish: cache prompt + outputs, free the rest, release the request

    From step 7 on every step holds 64 requests: 8 admissions, 8 second chunks, 40
    decodes and 8 finishes. Returns (prompts, the ``outputs`` sampled tokens of each), as
    ``array('q')``: no per-token objects for the garbage collector to walk while steps
    are timed (lists of ints would make its full collections cost ~0.1 s here)."""
    rng = random.Random(seed)
    systems = [_tokens(rng, prompt_len) for _ in range(prompts)]
    n = steps * STEP_ADMITS
    reqs = [systems[rng.randrange(prompts)] + _tokens(rng, suffix_len) for _ in range(n)]
    outs = [_tokens(rng, outputs) for _ in range(n)]
    return [array("q", r) for r in reqs], [array("q", o) for o in outs]


def step_phases(step: int, requests: int) -> tuple[range, range, range, range]:
    """Indices of the requests that are (admitted, on their second chunk, decoding,
    finishing) at ``step`` of `scheduler_steps`."""

    def age(lo: int, hi: int) -> range:  # requests of ages lo..hi
        first = max(0, (step - hi) * STEP_ADMITS)
        return range(first, max(first, min(requests, (step - lo + 1) * STEP_ADMITS)))

    return age(0, 0), age(1, 1), age(2, 6), age(7, 7)


def step_batches(reqs: list) -> Iterator[tuple[bool, list, list, list, list]]:
    """Walk `scheduler_steps` step by step over the caller's request objects: yields
    (timed, admitted, second chunks, decoding, finishing) lists; ``timed`` once every
    phase is full (the steady state a benchmark measures)."""
    for step in range(len(reqs) // STEP_ADMITS):
        phases = [[reqs[i] for i in r] for r in step_phases(step, len(reqs))]
        yield (step >= STEP_PHASES - 1, *phases)


def memory_leaves(
    seed: int = 0,
    prefixes: int = 100,
    prefix_len: int = 2000,
    leaves: int = 10_000,
    leaf_len: int = 80,
):
    """(f) ``leaves`` sequences, each one of ``prefixes`` shared prefixes plus unique
    tokens: 100 x 2,000 + 10,000 x 80 = 1M cached tokens. A generator, so the caller holds
    no more than one sequence at a time (RSS growth is then the cache's own)."""
    rng = random.Random(seed)
    stems = [_tokens(rng, prefix_len) for _ in range(prefixes)]
    for i in range(leaves):  # the first token tells leaves of one prefix apart
        yield stems[i % prefixes] + [i // prefixes] + _tokens(rng, leaf_len - 1)


CACHED_TOKENS_F = 100 * 2000 + 10_000 * 80


def chat_args(p: object) -> None:
    """The chat workload's flags (`engine_chats`), on an argparse parser, with the tiny
    models' window, page and prefill chunk."""
    add = p.add_argument  # type: ignore[attr-defined]
    add("--window", type=int, default=64, help="the Gemma-3-like model's sliding window")
    add("--chats", type=int, default=16)
    add("--turns", type=int, default=4)
    add("--system", type=int, default=256, help="tokens of each of the 4 system prompts")
    add("--user", type=int, default=48, help="new tokens a turn")
    add("--new", type=int, default=16, help="generated tokens a turn")
    add("--page", type=int, default=16)
    add("--chunk", type=int, default=256, help="prefill tokens a step")


def engine_chats(
    engine: object, chats: int, turns: int, system: int, user: int, new: int,
    records: list[dict] | None = None,
) -> tuple[int, int, list[list[int]]]:  # fmt: skip
    """Multi-turn chats behind 4 system prompts of ``system`` tokens, served by an
    `Engine`: each round sends every chat's next turn at once (its history, the engine's
    own previous answer, ``user`` new tokens; ``new`` generated). Returns (prompt
    tokens, cached tokens, every turn's output ids). ``records``: each request is
    appended as a token-trace record (its round as its timestamp, and the tokens the
    engine served from its cache as ``cached``)."""
    import torch

    g = torch.Generator().manual_seed(7)
    systems = [torch.randint(3, 384, (system,), generator=g).tolist() for _ in range(4)]
    history = [list(systems[i % 4]) for i in range(chats)]
    prompt = cached = 0
    outputs = []
    for turn in range(turns):
        for h in history:
            h.extend(torch.randint(3, 384, (user,), generator=g).tolist())
        res = engine.generate(history, max_new_tokens=new, chat=False, ignore_eos=True)  # type: ignore[attr-defined]
        prompt += res.stats.prompt_tokens
        cached += res.stats.cached_tokens
        for h, out in zip(history, res.outputs, strict=True):
            if records is not None:
                records.append({"token_ids": list(h), "output_ids": out.token_ids,
                                "timestamp": turn, "cached": out.cached_tokens})  # fmt: skip
            h.extend(out.token_ids)
            outputs.append(out.token_ids)
    return prompt, cached, outputs
