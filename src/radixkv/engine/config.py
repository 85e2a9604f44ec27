"""`EngineConfig`: every knob of the engine in one validated dataclass.

Owns: the engine's knobs and their validation. Must not touch: building anything."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from radixkv.key import as_bool, as_count
from radixkv.kvcache.plan import (  # noqa: F401  (the memory knobs' home; kept importable here)
    CACHE_SPLITS,
    DEFAULT_CHECKPOINTS,
    DEFAULT_KV_TOKENS,
    SGLANG_STATE_RATIO,
    SGLANG_WINDOW_RATIO,
    CacheConfig,
)
from radixkv.storage import WRITE_POLICIES
from radixkv.tree.policy import POLICIES

SCHEDULE_POLICIES = ("fcfs", "lpm")


@dataclass
class EngineConfig:
    """How an `Engine` runs. The memory knobs (``page_size``, ``chunk_size``,
    ``max_running``, ``max_context_len``, ``dtype``, ``kv_tokens``, ``window_tokens``,
    ``max_checkpoints``, ``checkpoint_every``, ``cache_bytes``, ``cache_split``) are
    validated and sized by `radixkv.kvcache.plan` (``cache_config``, `plan_memory`).

    Attributes:
        prefix_cache: reuse cached prefixes (False: a disabled cache, all recomputed).
        page_size: KV page size in tokens.
        schedule_policy: ``fcfs``, or ``lpm`` (longest cached prefix first).
        chunk_size: prefill tokens per step, all requests together.
        max_running: requests running at once (rows of the request table).
        kv_tokens: KV pool size in tokens (``None``: 8192). With a ``cache_bytes``
            size: the most tokens of full-attention KV the budget holds (a cap; at
            full, it frees its own least recently used leaves); with ``"auto"``: what
            sizes the budget.
        cache_bytes: one byte budget for the whole cache (`radixkv.kvcache.arena`):
            full-attention KV, sliding-window KV and recurrent-state checkpoints draw
            from one arena of this many bytes, evicted in the simulator's ``radixkv``
            order. ``"auto"``: on a hybrid model, the bytes the separate pools would
            take (``kv_tokens`` or its default of full KV, the window pool that
            implies, 64 checkpoints), in one arena; on any other model the plain pool
            of ``kv_tokens`` (``radixkv serve``'s default). ``None``: the separate
            pools of ``kv_tokens``, ``window_tokens`` and ``max_checkpoints``.
        cache_split: with ``cache_bytes``: ``one`` (the arena) or ``sglang`` (the same
            bytes split by SGLang's fixed ratios into the separate pools, for
            comparison).
        max_context_len: longest prompt + output of one request.
        eviction_policy: the cache's eviction policy.
        device, dtype: where and how the model and the KV live.
        check_memory: run ``check_memory``, ``check_integrity`` and the lock ledger
            (``check_locks``) after every step.
        seed: seed of the random weights (``model="random"``).
        storage: a shared page store (``redis://...``, ``file:///DIR``, ``memory://``):
            prompt pages the device cache lacks are read from it, finished requests'
            pages written to it per ``write_policy``.
        host_tokens: KV tokens of a host-memory tier: pages the device evicts are copied
            there and loaded back when a prompt needs them.
        write_policy: ``write_through``, ``write_through_selective`` or ``write_back``.
        prefetch_within: with ``eviction_policy="session"`` and a tier (``host_tokens`` or
            ``storage``): the pages a waiting agent session's last path left below the
            device are loaded back when it is predicted back within this many seconds,
            evicting only what returns later: while no request runs (the server calls
            `Engine.idle`), and a chunk's worth before a busy step when no request
            waits, leaving the running requests their room (`radixkv.engine.ahead`).
            ``None``: off.
        storage_max_bytes: the most bytes a ``file://`` store's folder holds (the least
            recently used pages go first; ``None``: what it holds at start plus half its
            disk's free space); other stores are sized in themselves.
        max_checkpoints: recurrent-state checkpoints the prefix cache holds at most
            (Qwen3.5 and other models with recurrent layers: each is one state of every
            recurrent layer; the least recently used goes first). ``None``: 64, or
            with ``cache_bytes`` as many as the budget holds (a number: a cap).
        checkpoint_every: also checkpoint every this many tokens of a long prefill (a
            multiple of ``page_size``; 0: never), so a prefix shared by requests that
            go on past it hits from the second request, before any branch point is
            known (vLLM's align mode keeps a state on such a grid, of its block size).
        max_retained_tokens: prompt-cache retention (`radixkv.kvcache.retention`): the most
            tokens one namespace (a ``cache_salt``) keeps retained on request; ``None``:
            an eighth of ``kv_tokens``; 0: retention off. All namespaces together keep
            at most twice this or a quarter of ``kv_tokens``, whichever is more, shared
            fairly (a client can choose many salts; another's pins are taken only from
            a namespace over its share).
        window_tokens: the sliding-window layers' KV pool in tokens, on a model that has
            them (Gemma 3, Mistral, Qwen with ``use_sliding_window``): their KV lives in
            a slot space of its own, a running request keeps only its last window and
            the prefix cache only the windows a match can end at
            (`radixkv.kvcache.window.slots`). ``None``: sized at start (a quarter of
            ``kv_tokens``, at least every running request's last window and one
            chunk, at most ``kv_tokens``; kept in the full pool when even that is less
            than one request needs, or with host / store tiers, which store whole
            pages); 0: keep the sliding layers' KV in the full pool, unfreed. A pool
            too small for every running request's window costs preemptions, not
            progress (`radixkv.engine.scheduler`). With a ``cache_bytes`` size: the
            most tokens of window KV the budget holds (a cap: at full, its spare
            windows go first, then its least recently used).
        served_log: a file each finished request is appended to (its tokens, the step
            it arrived at), for ``radixkv simulate --format served`` to replay
            (`radixkv.engine.served_log`); it holds the prompts' token ids: created 0600.
        storage_secret: a secret shared by the engines of one store: every page carries
            a MAC under it and a page whose MAC fails is a counted miss. ``None``:
            ``RADIXKV_STORAGE_SECRET`` from the environment, if set.
    """

    prefix_cache: bool = True
    page_size: int = 1
    schedule_policy: str = "lpm"
    chunk_size: int = 512
    max_running: int = 16
    kv_tokens: int | None = None  # None: DEFAULT_KV_TOKENS; with cache_bytes a cap
    max_context_len: int = 2048
    eviction_policy: str = "lru"
    device: str | torch.device = "cpu"
    dtype: torch.dtype = torch.float32
    check_memory: bool = False
    seed: int = 0
    storage: str | None = None  # a shared page store URL (radixkv.storage)
    host_tokens: int = 0  # a host-memory tier below the device pool
    write_policy: str = "write_through"
    storage_secret: str | None = None
    storage_max_bytes: int | None = None  # a file store's size cap (LRU by mtime)
    max_checkpoints: int | None = None  # checkpoints held (None: 64, or the budget)
    checkpoint_every: int = 0  # tokens; recurrent models also checkpoint on this grid
    max_retained_tokens: int | None = None  # per namespace; None: kv_tokens // 8
    window_tokens: int | None = None  # sliding layers' own pool; None: sized at start
    cache_bytes: int | str | None = None  # one budget for every kind; "auto": sized
    # as the separate pools' defaults would be (radixkv.kvcache.arena)
    cache_split: str = "one"  # with cache_bytes: "one" arena, or SGLang's fixed "sglang"
    served_log: str | None = None  # a file each finished request is logged to, for replay
    prefetch_within: float | None = None  # s: a waiting agent's pages back before it returns

    @property
    def cache_config(self) -> CacheConfig:
        """The memory knobs, validated (`radixkv.kvcache.plan`: what sizes the cache)."""
        return CacheConfig(**{f.name: getattr(self, f.name) for f in fields(CacheConfig)})

    @property
    def pool_tokens(self) -> int:
        """The full KV pool's tokens without an arena (``kv_tokens`` or its default)."""
        return self.cache_config.pool_tokens

    @property
    def checkpoint_cap(self) -> int | None:
        """Checkpoints held at most (`CacheConfig.checkpoint_cap`)."""
        return self.cache_config.checkpoint_cap

    @property
    def one_arena(self) -> bool:
        """Every kind of cache memory draws from one arena of ``cache_bytes``."""
        return self.cache_config.one_arena

    def __post_init__(self) -> None:
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}"
            )
        if self.eviction_policy not in POLICIES:
            raise ValueError(
                f"eviction_policy must be one of {tuple(POLICIES)}, got {self.eviction_policy!r}"
            )
        self.cache_config  # noqa: B018  (validates the memory knobs)
        if self.max_retained_tokens is not None:
            as_count(self.max_retained_tokens, "max_retained_tokens")
        as_bool(self.prefix_cache, "prefix_cache")
        as_bool(self.check_memory, "check_memory")
        as_count(self.seed, "seed")
        if self.served_log is not None and (not isinstance(self.served_log, str)
                                            or not self.served_log):  # fmt: skip
            raise ValueError("served_log must be a file path (a non-empty string)")
        if (self.storage is not None or self.host_tokens) and not self.prefix_cache:
            raise ValueError("storage and host_tokens need the prefix cache (prefix_cache=True)")
        as_count(self.host_tokens, "host_tokens")
        self._check_load_ahead()
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"write_policy must be one of {WRITE_POLICIES}, got {self.write_policy!r}"
            )
        if self.storage_secret is not None and (
            not isinstance(self.storage_secret, str) or not self.storage_secret
        ):
            raise ValueError("storage_secret must be a non-empty string")
        if self.storage_max_bytes is not None:
            as_count(self.storage_max_bytes, "storage_max_bytes")
            if self.storage is None or not self.storage.startswith("file://"):
                raise ValueError("storage_max_bytes: only a file:// store takes a size cap "
                                 "(size Redis with its maxmemory)")  # fmt: skip

    def _check_load_ahead(self) -> None:
        t = self.prefetch_within
        if t is None:
            return
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise ValueError(f"prefetch_within must be a number of seconds > 0, got {t!r}")
        if self.eviction_policy != "session":
            raise ValueError("prefetch_within needs the session eviction policy (its "
                             "predictions say which session returns when)")  # fmt: skip
        if self.storage is None and not self.host_tokens:
            raise ValueError("prefetch_within needs a tier to load from (a host tier or "
                             "a store)")  # fmt: skip
