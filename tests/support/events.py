"""What a tree's servable pages are, recomputed from scratch: what KV events with
windows apart must tell; and a router's index fed an engine's events through the wire."""

from __future__ import annotations

from typing import Any

import numpy as np

from radixkv import RadixCache, RadixKey
from radixkv.hashing.fast import event_hashes
from radixkv.tree import chain_hashes


def servable_blocks(cache: RadixCache, strong: bool) -> set[int]:
    """Brute force: every page end of the tree where a match may end, hashed."""
    page, out = cache.page_size, set()
    for node in cache.iter_nodes():
        path, x = [], node
        while x is not cache.root:
            path.append(x)
            x = x.parent
        runs = [np.frombuffer(n.key_bytes, dtype=np.int64) for n in reversed(path)]
        tokens = np.concatenate(runs)
        start = len(tokens) - len(node)
        for end in range(start + page, len(tokens) + 1, page):
            key = RadixKey(tokens[:end], node.extra_key)
            if cache.match_len(key) == end:
                if strong:
                    h = chain_hashes(tokens[:end], node.extra_key, page, end // page)[-1]
                    out.add(int.from_bytes(h[:8], "big"))
                else:
                    out.add(event_hashes(tokens[:end], node.extra_key, page, end // page)[-1])
    return out


def apply_to_index(batches: list, index: Any, worker: str = "w") -> None:
    """An engine's published batches, encoded and decoded as the wire carries them,
    validated and applied to a router's ``index`` (`radixkv.router.index.KvIndex`) for
    ``worker``, then checked; ``batches`` is emptied."""
    from radixkv.events import decode_batch, encode_batch

    for batch in batches:
        batch = decode_batch(encode_batch(batch))
        index.validate(worker, batch)
        index.apply(worker, batch)
    batches.clear()
    index.check()
