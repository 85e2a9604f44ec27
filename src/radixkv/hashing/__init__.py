"""How a prefix is named: three names, each for one job.

========================  ==============================  ==================================
name                      where                           why this one
========================  ==============================  ==================================
page hash, BLAKE2b-128    the shared store's and the      collision-resistant: a collision
(`page_hash`, 16 bytes    host tier's page keys; KV       would serve another prefix's KV,
a page, chained)          events without token ids        or, in an event, could be built
                          (``--kv-events-mode hashes``,   by a tenant; a 128-bit one-way
                          the first 8 bytes on the wire)  digest gives no tokens away
event hash, 64-bit        KV events with token ids        fast (a page of 16 tokens in
(`event_hashes`,          (vLLM's wire, the default),     ~0.2 µs, in numpy batches) and
multilinear, chained)     the router's index of them      enough: the tokens travel beside
                                                          it, so a collision can only
                                                          misroute (the engine still
                                                          computes the right KV)
interned id (an int,      inside the router's index       one key space for workers that
`radixkv.router.index`)   only                            hash differently (radixkv,
                                                          vLLM): each worker's hash maps
                                                          to an id while some worker holds
                                                          the page; never leaves the router
========================  ==============================  ==================================

Both chains start from the namespace (a request's ``cache_salt`` / ``extra_key``), so
two tenants' equal prompts never share a name. ``docs/hashing.md`` says the same with
the numbers.

Modules: ``strong.py`` the BLAKE2b chain, ``fast.py`` the 64-bit chain.

Owns: the hash functions. Must not touch: the tree, the events or the store, which keep,
carry and key by these names.
"""

from radixkv.hashing.fast import (
    EVENT_HASH_BYTES,
    chain_runs,
    chain_states,
    event_hashes,
    last_state,
    published,
    root_state,
)
from radixkv.hashing.strong import HASH_BYTES, chain_hashes, hash_ints, page_hash

__all__ = [
    "EVENT_HASH_BYTES",
    "HASH_BYTES",
    "chain_hashes",
    "chain_runs",
    "chain_states",
    "event_hashes",
    "hash_ints",
    "last_state",
    "page_hash",
    "published",
    "root_state",
]
