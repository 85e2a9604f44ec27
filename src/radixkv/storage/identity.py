"""A model's identity for a shared KV store: 16 bytes that change when anything that
shapes a page's bytes changes.

What goes in (`model_identity`): a digest of every byte of every weight (BLAKE2b-256 over
each tensor's name, dtype, shape and raw bytes, as the engine holds them: after the
conversion to its dtype), the model config, the tokenizer's own identity (its vocabulary
and merges file, or its kind), the dtype, the KV page layout and the page size. Two
checkpoints that differ in one weight element anywhere (a fine-tune, an edit, another
quantization) get different identities, so neither is ever served the other's pages.

Hashing every weight costs about a second per GB, so for a model loaded from checkpoint
files the weight digest is cached in ``cache_dir()/identity-cache.json``, keyed by each
file's path, size, modification time (ns) and inode, plus the dtype: a changed file is
hashed again; start-up with unchanged files reads the cache.

Owns: the identity's digest and its cache. Must not touch: the engine (it reads a model
and a tokenizer it is given).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixkv.tokenizer.tokenizers import tokenizer_identity

if TYPE_CHECKING:
    import torch

log = logging.getLogger("radixkv.storage")
startup = logging.getLogger("radixkv.startup")  # start-up progress (the CLI shows it)
IDENTITY_VERSION = b"radixkv-identity-v1"
KV_LAYOUT = "pages[page][k|v][layer][token][kv_head][head_dim]"  # what the tier writes
CACHE_FILE = "identity-cache.json"
CACHE_ENTRIES = 64  # digests kept (one per checkpoint and dtype)


def weights_digest(model: torch.nn.Module) -> bytes:
    """BLAKE2b-256 over every tensor of ``model.state_dict()``: name, dtype, shape and
    every byte of its data, in order."""
    import torch

    h = hashlib.blake2b(digest_size=32)
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.digest()


def _files_key(files: Sequence[str | Path], dtype: torch.dtype) -> str:
    parts = [str(dtype)]
    for f in sorted(Path(x).resolve() for x in files):
        st = f.stat()
        parts.append(f"{f}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}")
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).hexdigest()


def cached_weights_digest(
    model: torch.nn.Module,
    dtype: torch.dtype,
    files: Sequence[str | Path] | None,
    cache_dir: Path | None = None,
) -> bytes:
    """`weights_digest`, reused from the cache while ``files`` (the checkpoint files the
    weights were loaded from) are unchanged. Without files (a random or given model),
    or when the cache cannot be read or written, it is computed."""
    if not files or cache_dir is None:
        return weights_digest(model)
    try:
        key = _files_key(files, dtype)
    except OSError:
        return weights_digest(model)
    path = cache_dir / CACHE_FILE
    try:
        cache = json.loads(path.read_text())
        if not isinstance(cache, dict):
            cache = {}
    except (OSError, ValueError):
        cache = {}
    hit = cache.get(key)
    if isinstance(hit, str) and len(hit) == 64:
        return bytes.fromhex(hit)
    startup.info(
        "hashing every weight for the model identity (what /v1/models shows a "
        "router, and what a store's pages are keyed by; once per checkpoint)"
    )
    digest = weights_digest(model)
    cache.pop(key, None)
    cache[key] = digest.hex()
    while len(cache) > CACHE_ENTRIES:
        cache.pop(next(iter(cache)))
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{CACHE_FILE}.{os.getpid()}")
        tmp.write_text(json.dumps(cache))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("cannot cache the model identity in %s: %s", path, e)
    return digest


def model_identity(
    model: torch.nn.Module,
    dtype: torch.dtype,
    page_size: int,
    tokenizer: Any = None,
    files: Sequence[str | Path] | None = None,
    cache_dir: Path | None = None,
) -> bytes:
    """16 bytes naming what a stored page's bytes mean (see the module docstring).

    Args:
        model: the model as the engine runs it (its weights in ``dtype``).
        tokenizer: the engine's tokenizer (token ids are what pages are keyed by).
        files: the checkpoint files the weights came from, to cache the weight digest.
        cache_dir: where that cache lives (``None``: no cache).
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(IDENTITY_VERSION)
    h.update(cached_weights_digest(model, dtype, files, cache_dir))
    config = getattr(model, "config", None)
    h.update(repr(getattr(config, "to_dict", lambda: config)()).encode())
    h.update(f"|dtype={dtype}|page={page_size}|layout={KV_LAYOUT}|".encode())
    h.update(hashlib.blake2b(tokenizer_identity(tokenizer), digest_size=16).digest())
    return h.digest()
