"""What the SGLang recorders (record_sglang_hybrid_ops.py, record_sglang_swa_ops.py)
share: random prompts over a 4-token vocabulary (so they share prefixes often), and the
fixture file they write."""

from __future__ import annotations

import gzip
import json
import random


def random_prompt(
    rng: random.Random, prompts: list[list[int]], page: int, tail: int, fresh: int
) -> list[int]:
    """An earlier prompt again (15%), an earlier prompt's prefix plus up to ``tail`` new
    tokens (70% of the rest), or up to ``fresh`` new tokens; cut to whole pages."""
    if prompts and rng.random() < 0.15:  # the same prompt again
        return list(rng.choice(prompts))
    if prompts and rng.random() < 0.7:  # share a prefix with an earlier prompt
        base = rng.choice(prompts)
        cut = rng.randint(0, len(base))
        toks = base[:cut] + [rng.randint(0, 3) for _ in range(rng.randint(1, tail))]
    else:
        toks = [rng.randint(0, 3) for _ in range(rng.randint(1, fresh))]
    return toks[: len(toks) - len(toks) % page]


def write_fixture(out: str, cache: str, seqs: list[dict]) -> None:
    """The recorded sequences as gzipped JSON, with what recorded them."""
    doc = dict(sglang="0.5.23", cache=cache, seqs=seqs)
    with open(out, "wb") as f:
        f.write(gzip.compress(json.dumps(doc, separators=(",", ":")).encode()))
    n = sum(len(s["ops"]) for s in seqs)
    print(f"{len(seqs)} sequences, {n} operations -> {out}")
