"""Memory planned beside the specs: `plan_memory(specs, CacheConfig) -> MemoryPlan`, one
pure function from a model's layer specs and the cache's memory knobs to the size of
everything an engine allocates for its cache, in one of two shapes:

    pools   ``kv_tokens`` of full KV, the sliding layers' window pool (``window_tokens``,
            sized here when not given) and state rows for ``max_checkpoints``;
            ``cache_split="sglang"`` splits ``cache_bytes`` into them by SGLang's ratios
    arena   one arena of ``cache_bytes`` (`radixkv.kvcache.arena`) whose unit is a page
            of ``group`` attention layers: a page of either kind and a checkpoint take
            whole units, capped inside by ``kv_tokens`` / ``window_tokens`` /
            ``max_checkpoints`` when given

Each spec answers its own bytes (`FullAttentionSpec.layer_token_bytes`,
`RecurrentSpec.state_bytes`); ``cache_bytes="auto"`` is resolved here (the bytes the
pools' defaults would take, as one arena). The plan names what each part would take of
the machine (`MemoryPlan.needs`, by the knob that sets it): the engine checks that
before it allocates anything.

Invariants (checked by `tests/kvcache/test_plan.py` against the pools built from it):
the plan's config is resolved (no ``"auto"``, no ``"sglang"`` split left); an arena holds
at least two full pages + one request's window and chunk + one checkpoint; a window pool
holds at least one request's window and chunk; every size is a whole number of pages.

Owns: the sizes and the errors naming a knob that cannot size this model. Must not
touch: tensors, devices, the machine's free memory (`radixkv.engine.machine` reads
``needs``), the model (only its specs come in).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from radixkv.key import as_count
from radixkv.kvcache.arena import layer_group
from radixkv.kvcache.recurrent.manager import RecurrentStates
from radixkv.kvcache.spec import LayerSpecs, SlidingWindowSpec
from radixkv.kvcache.window.slots import window_peak
from radixkv.units import align_down, align_up, div_ceil

CACHE_SPLITS = ("one", "sglang")
DEFAULT_KV_TOKENS = 8192  # without cache_bytes
DEFAULT_CHECKPOINTS = 64  # without cache_bytes
# SGLang's fixed split of one memory (`cache_split="sglang"`): its server arguments'
# defaults ``mamba_full_memory_ratio`` (state pool bytes / full KV bytes) and
# ``swa_full_tokens_ratio`` (window pool tokens / full pool tokens)
SGLANG_STATE_RATIO = 0.9
SGLANG_WINDOW_RATIO = 0.8


@dataclass(frozen=True)
class CacheConfig:
    """The knobs that size a cache's memory, validated. `radixkv.engine.EngineConfig`
    takes them under the same names (its docstring says what each means) and hands them
    here (``EngineConfig.cache_config``)."""

    page_size: int = 1
    chunk_size: int = 512
    max_running: int = 16
    max_context_len: int = 2048
    dtype: torch.dtype = torch.float32
    kv_tokens: int | None = None  # None: DEFAULT_KV_TOKENS; with cache_bytes a cap
    window_tokens: int | None = None  # sliding layers' own pool; None: sized here
    max_checkpoints: int | None = None  # None: 64, or with an arena the budget's
    checkpoint_every: int = 0
    cache_bytes: int | str | None = None  # one budget for every kind; "auto": sized here
    cache_split: str = "one"  # with cache_bytes: "one" arena, or SGLang's fixed "sglang"

    @property
    def pool_tokens(self) -> int:
        """The full KV pool's tokens without an arena (``kv_tokens`` or its default)."""
        return DEFAULT_KV_TOKENS if self.kv_tokens is None else self.kv_tokens

    @property
    def checkpoint_cap(self) -> int | None:
        """Checkpoints held at most: ``max_checkpoints``, its default without an arena,
        ``None`` (the budget's) with one."""
        if self.max_checkpoints is not None:
            return self.max_checkpoints
        return None if self.one_arena else DEFAULT_CHECKPOINTS

    @property
    def one_arena(self) -> bool:
        """Every kind of cache memory draws from one arena of ``cache_bytes``."""
        return self.cache_bytes is not None and self.cache_split == "one"

    def __post_init__(self) -> None:
        for name in ("page_size", "chunk_size", "max_running", "kv_tokens", "max_context_len",
                     "max_checkpoints", "cache_bytes"):  # fmt: skip
            value = getattr(self, name)
            if value is None and name in ("kv_tokens", "max_checkpoints", "cache_bytes"):
                continue
            if name == "cache_bytes" and value == "auto":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self._check_budget()
        if self.pool_tokens < 2 * self.page_size:
            raise ValueError(
                f"kv_tokens must hold at least two pages of {self.page_size} tokens, "
                f"got {self.kv_tokens}"
            )
        as_count(self.checkpoint_every, "checkpoint_every")
        if self.checkpoint_every % self.page_size:
            raise ValueError(f"checkpoint_every must be a multiple of page_size "
                             f"({self.page_size}), got {self.checkpoint_every}")  # fmt: skip
        if self.window_tokens is not None:
            as_count(self.window_tokens, "window_tokens")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {self.dtype!r}")

    def _check_budget(self) -> None:
        """``cache_bytes`` and what goes with it."""
        if self.cache_split not in CACHE_SPLITS:
            raise ValueError(f"cache_split must be one of {CACHE_SPLITS}, got {self.cache_split!r}")
        if self.cache_bytes is None:
            if self.cache_split != "one":
                raise ValueError("cache_split: splits a cache_bytes budget; set cache_bytes")
            return
        if self.cache_split == "sglang" and (self.kv_tokens is not None or self.window_tokens):
            raise ValueError("kv_tokens, window_tokens: with cache_split='sglang' the split "
                             "sizes the pools; give cache_bytes alone")  # fmt: skip
        if self.cache_bytes == "auto" and self.window_tokens:
            raise ValueError("window_tokens: with cache_bytes='auto' the window KV is sized "
                             "in the budget; give a size to cap it inside")  # fmt: skip


@dataclass(frozen=True)
class WindowPlan:
    """Where a model's sliding-window layers keep their KV."""

    layers: tuple[int, ...] = ()  # the sliding layers whose KV lives apart (none: kept whole)
    window: int = 0  # their longest window
    tokens: int = 0  # the window slots' size (with an arena: an index over its pages)
    why_not: str = ""  # why sliding layers stay in the full pool, when they do


@dataclass(frozen=True)
class ArenaPlan:
    """One arena for every kind of cache memory (`radixkv.kvcache.arena`), as sized."""

    units: int  # the arena's units
    unit_bytes: int  # a page of ``group`` attention layers' KV
    group: int  # attention layers a unit spans
    full_columns: int  # units of one full-attention page (0: every layer slides)
    window_columns: int = 0  # units of one window page (0: no window kind)
    window: int = 0  # the sliding layers' longest window
    window_layers: tuple[int, ...] = ()
    state_units: int = 0  # units of one checkpoint
    reserve: int = 0  # units one request's window and a checkpoint need besides its KV
    full_cap: int | None = None  # pages of full KV at most (kv_tokens inside the budget)
    window_cap: int | None = None  # pages of window KV at most (window_tokens)

    @property
    def nbytes(self) -> int:
        return self.units * self.unit_bytes


@dataclass(frozen=True)
class MemoryPlan:
    """What `plan_memory` sized: the shape's parts, and what each takes of the machine."""

    config: CacheConfig  # as resolved: no "auto", no "sglang" split (the pools it became)
    specs: LayerSpecs
    window: WindowPlan
    arena: ArenaPlan | None  # None: separate pools
    full_slots: int  # the full KV allocator's tokens (every layer sliding: an index only)
    full_capacity: int  # the most full KV tokens one request can hold (whole pages)
    checkpoints: int | None  # checkpoints held at most (None: no recurrent layers)
    state_rows: int  # spare rows of the state pool (beside one per running request)
    needs: dict[str, int]  # bytes of each part, by the knob that sets it
    sized_by: str = ""  # the knob a machine that cannot hold ``needs`` names ("": each)

    @property
    def index_slots(self) -> int:
        """Slots the allocators index: the full KV's, and the window's own pool's."""
        return self.full_slots + (self.window.tokens if self.window.layers else 0)

    @property
    def kv_layout(self) -> tuple[tuple[int, ...], int]:
        """Separate pools: the layers whose KV lives in a slot space of its own, and its
        slots (`radixkv.kvcache.memory.KVPool`'s ``window_layers``, ``window_size``)."""
        return self.window.layers, self.window.tokens

    def notes(self) -> list[str]:
        """What the summary says of a layer type the plan did not give its own pool."""
        why = self.window.why_not
        return [f"sliding-window KV: in the full pool ({why})"] if why else []


def plan_memory(specs: LayerSpecs, config: CacheConfig, model: str = "this model") -> MemoryPlan:
    """Every size of a cache for a model of ``specs`` under ``config`` (``model``: its
    name, for errors). O(layers).

    Raises:
        ValueError: a knob this model cannot be sized by, naming it (a budget too small
            for one request, a window pool below one request's window and chunk,
            ``window_tokens`` or ``checkpoint_every`` on a model without those layers).
    """
    if config.checkpoint_every and specs.recurrent is None:
        raise ValueError(f"checkpoint_every: {model} has no recurrent layers to checkpoint")
    cfg = _split(specs, _auto(specs, config, model))
    table = request_table(cfg)
    per_layer = specs.layer_token_bytes(cfg.dtype)
    if cfg.one_arena:
        try:
            arena = _plan_arena(specs, cfg)
        except ValueError as e:  # "auto" was sized by kv_tokens: name that
            if config.cache_bytes != "auto":
                raise
            raise ValueError(f"kv_tokens: {cfg.pool_tokens:,} tokens size the budget "
                             f"(--cache-bytes auto): {str(e).removeprefix('cache_bytes: ')}"
                             ) from None  # fmt: skip
        p, size = cfg.page_size, arena.units * cfg.page_size
        window = WindowPlan(arena.window_layers, arena.window, size if arena.window_columns else 0)
        if arena.full_columns:
            capacity = (arena.units - arena.reserve) // arena.full_columns * p
            if arena.full_cap is not None:
                capacity = min(capacity, arena.full_cap * p)
            full_slots = size
        else:  # every layer slides: full slots index tokens and hold no KV
            full_slots = capacity = _index_tokens(cfg, size)
        needs = {f"cache_bytes={arena.nbytes:,}": arena.nbytes, **table}
        sized_by = "cache_bytes"
    else:
        arena, window = None, _plan_windows(specs, cfg, model)
        full_slots, capacity = cfg.pool_tokens, align_down(cfg.pool_tokens, cfg.page_size)
        needs = {
            f"kv_tokens={cfg.pool_tokens:,}":
                (specs.kv_layers - len(window.layers)) * per_layer * cfg.pool_tokens,
            f"window_tokens={window.tokens:,}": len(window.layers) * per_layer * window.tokens,
            **table,
        }  # fmt: skip
        sized_by = ""
    checkpoints, rows = None, 0
    if specs.recurrent is not None:
        checkpoints, rows = _states(cfg)
        if arena is not None and checkpoints is None:
            checkpoints = max(1, arena.units // arena.state_units)
        needs[f"max_checkpoints={cfg.checkpoint_cap or 0:,} (recurrent states)"] = (
            cfg.max_running + rows) * specs.recurrent.state_bytes  # fmt: skip
    return MemoryPlan(cfg, specs, window, arena, full_slots, capacity, checkpoints, rows,
                      needs, sized_by)  # fmt: skip


def _auto(specs: LayerSpecs, cfg: CacheConfig, model: str) -> CacheConfig:
    """``cache_bytes="auto"`` resolved: on a model with sliding-window or recurrent
    layers, the bytes of the separate pools ``kv_tokens`` (or its default) implies (its
    full KV, the window pool `_plan_windows` would size, 64 checkpoints) as one budget;
    on any other model the plain pool of ``kv_tokens``."""
    if cfg.cache_bytes != "auto":
        return cfg
    pools = dataclasses.replace(cfg, cache_bytes=None, cache_split="one")
    plan = _plan_windows(specs, pools, model)
    if not plan.layers and specs.recurrent is None:
        return pools
    per_layer = specs.layer_token_bytes(cfg.dtype)
    full = (specs.kv_layers - len(plan.layers)) * per_layer * pools.pool_tokens
    window = len(plan.layers) * per_layer * plan.tokens
    # (sized for the default count: a max_checkpoints given is a cap inside the budget)
    states = DEFAULT_CHECKPOINTS * specs.recurrent.state_bytes if specs.recurrent else 0
    return dataclasses.replace(cfg, cache_bytes=full + window + states, kv_tokens=None)


def _split(specs: LayerSpecs, cfg: CacheConfig) -> CacheConfig:
    """With ``cache_split="sglang"``, ``cache_bytes`` split by SGLang's fixed ratios into
    ``kv_tokens``, ``window_tokens`` and ``max_checkpoints`` (recurrent states take
    ``mamba_full_memory_ratio`` x the full KV's bytes; window KV
    ``swa_full_tokens_ratio`` x the full KV's tokens); any other ``cfg`` as it is."""
    if cfg.cache_bytes is None or cfg.cache_split != "sglang":
        return cfg
    assert isinstance(cfg.cache_bytes, int)
    sliding = _sliding(specs, cfg)
    per_layer = specs.layer_token_bytes(cfg.dtype)
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


def _sliding(specs: LayerSpecs, cfg: CacheConfig) -> SlidingWindowSpec | None:
    """The sliding layers whose KV lives apart (none with ``window_tokens=0``)."""
    return specs.window_limited(cfg.max_context_len) if cfg.window_tokens != 0 else None


def _plan_windows(specs: LayerSpecs, cfg: CacheConfig, model: str) -> WindowPlan:
    """Whether (and how large) a window slot space for the sliding layers, without an
    arena: ``window_tokens``, or sized for one request computing a chunk and every other
    one's last window (a quarter of ``kv_tokens`` at least, ``kv_tokens`` at most)."""
    sliding = specs.window_limited(cfg.max_context_len)
    asked = cfg.window_tokens
    if sliding is None:
        if asked:
            raise ValueError(f"window_tokens: {model} has no sliding-window layer shorter "
                             f"than max_context_len={cfg.max_context_len}")  # fmt: skip
        return WindowPlan()
    if asked == 0:
        return WindowPlan(why_not="window_tokens=0")
    layers, window, p = sliding.layers, sliding.window, cfg.page_size
    peak = window_peak(window, p, cfg.chunk_size)  # one request alone
    size = asked
    if size is None:
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


def _plan_arena(specs: LayerSpecs, cfg: CacheConfig) -> ArenaPlan:
    """The arena of ``cfg.cache_bytes``: its unit, and how many units each kind's page
    or checkpoint takes. A model whose every attention layer slides (Mistral) has no
    full-attention pages: the arena holds its window pages (and checkpoints)."""
    assert isinstance(cfg.cache_bytes, int)
    p, sliding = cfg.page_size, _sliding(specs, cfg)
    wl = sliding.layers if sliding is not None else ()
    full = specs.kv_layers - len(wl)
    layer_page = p * specs.layer_token_bytes(cfg.dtype)
    state_bytes = specs.recurrent.state_bytes if specs.recurrent else 0
    group = layer_group(full, len(wl), layer_page, state_bytes)
    unit = group * layer_page
    fc, wc = full // group, len(wl) // group
    state = div_ceil(state_bytes, unit) if specs.recurrent else 0
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
    full_cap, window_cap = _caps(cfg, peak // wc * p if peak else 0)
    window = sliding.window if sliding is not None else 0
    return ArenaPlan(cfg.cache_bytes // unit, unit, group, fc, wc, window, wl, state,
                     peak + state, full_cap, window_cap)  # fmt: skip


def _caps(cfg: CacheConfig, window_least: int) -> tuple[int | None, int | None]:
    """``kv_tokens`` and ``window_tokens`` as caps inside a budget, in pages.

    Raises:
        ValueError: a window cap under one request's window and chunk."""
    p, full, window = cfg.page_size, cfg.kv_tokens, cfg.window_tokens or None
    if window is not None and window < window_least:
        raise ValueError(f"window_tokens: {window} tokens cap the window KV below one "
                         f"request's window and chunk ({window_least})")  # fmt: skip
    return (full // p if full else None), (window // p if window else None)


def _index_tokens(cfg: CacheConfig, arena_tokens: int) -> int:
    """The full slots of a model whose every layer slides, under one arena: an index
    of tokens the tree holds, no KV behind them. ``kv_tokens`` when given (a cap), else
    room for every running request's context and four times the tokens the arena's
    pages could hold (a node whose window was evicted costs only its index)."""
    p = cfg.page_size
    if cfg.kv_tokens:
        return align_down(cfg.kv_tokens, p)
    return align_up(cfg.max_running * cfg.max_context_len + 4 * arena_tokens, p)


def request_table(cfg: CacheConfig) -> dict[str, int]:
    """The running requests' slot table (`ReqToTokenPool`: host memory, 8 bytes a slot),
    by the knobs that size it: one of a plan's ``needs``."""
    return {f"max_running={cfg.max_running} x max_context_len={cfg.max_context_len:,}":
            8 * cfg.max_running * cfg.max_context_len}  # fmt: skip


def _states(cfg: CacheConfig) -> tuple[int | None, int]:
    """Checkpoints held at most (``None``: as many as the arena holds) and the state
    pool's spare rows: every checkpoint and a pending snapshot per running request, or
    with an arena (whose units hold the checkpoints) the pending snapshots only."""
    cap = cfg.checkpoint_cap
    if cfg.one_arena:
        every = cfg.chunk_size // cfg.checkpoint_every if cfg.checkpoint_every else 0
        return cap, 2 * cfg.max_running + every
    assert cap is not None
    return cap, RecurrentStates.spare_rows(cfg.max_running, cap)


__all__ = ["CACHE_SPLITS", "DEFAULT_CHECKPOINTS", "DEFAULT_KV_TOKENS", "SGLANG_STATE_RATIO",
           "SGLANG_WINDOW_RATIO", "ArenaPlan", "CacheConfig", "MemoryPlan", "WindowPlan",
           "plan_memory", "request_table"]  # fmt: skip
