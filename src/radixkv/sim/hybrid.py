"""Prefix caching for hybrid models, simulated: a trace replayed through the real radix
tree with its recurrent-state and sliding-window components, under a byte budget, for
several caching policies side by side.

A model spec (`ModelSpec`, or a preset of `PRESETS`, or a JSON file with its fields)
says what a cached token and a checkpoint cost: full-attention layers and their KV bytes
a token, sliding-window layers and their window, recurrent layers and their state bytes.
A capacity in bytes holds the full KV, the window KV and the checkpoints together.

Policies (`POLICIES`), each as the system it is named after caches, on the same
requests (prompt units, output units, and where known a chat template's boundary):

    radixkv   what radixkv's engine serves (`radixkv.kvcache.arena`): checkpoints
              where the engine takes them (each prompt's end, where the same prompt
              sent again starts, the last page its output reached, the branch point
              where a request leaves a cached path, the boundaries the server knows:
              the end of a system message; each in whole arena units); window KV kept
              while there is room, the windows no match can end at evicted first; one
              budget, evicting dead KV first (past a path's last checkpoint, useless to
              the recurrent layers), then the lowest utility (recency + prefill FLOPs
              saved per byte) among checkpoints and leaves. With room to spare and
              requests in arrival order it hits exactly where the engine does
              (tests/sim/test_serve_replay.py); under pressure it is a model of the
              engine's on-demand eviction (`radixkv.sim.serve_replay` is the engine).
    marconi   Marconi (MLSys 2025), its published simulator's V2 replayed by its own
    sglang+   rules (`radixkv.sim.marconi`), and its two baselines: SGLang+ (V1, LRU
    vllm+     leaves) and vLLM+ (a state every 32 tokens). Their rows equal Marconi's
              published results on its trace. Its tree knows no windows: a window
              layer's KV counts as attention KV kept whole.
    sglang    SGLang's unified cache: the same admission (leaf states, branching
              seqlen), separate pools (states: ``mamba_full_memory_ratio`` 0.9 of the
              full KV's bytes; window KV: ``swa_full_tokens_ratio`` 0.8 of its tokens),
              each evicting least recently used: whole leaves, and a leaf whose state
              is evicted goes with it; window KV kept until evicted. Equal to SGLang's
              own `UnifiedRadixCache` within 0.004 on Marconi's trace
              (benchmarks/peer_sglang_hybrid.py).
    vllm      vLLM's ``--mamba-cache-mode align``: the attention block inflated until
              a page holds a layer's state (`ModelSpec.vllm_block`), states only on that
              grid (a prompt's last full block, blocks finished while decoding), hits in
              whole blocks. With recurrent layers (and no window) it is vLLM's block
              pool itself (`radixkv.sim.vllm_pool`: duplicate blocks, the free queue's
              order), equal to vLLM's own `KVCacheManager` on Marconi's trace and a
              synthetic chat (benchmarks/peer_vllm_hybrid.py); with windows the tree:
              blocks evicted least recently used, a state padded to the block's page in
              every layer (`ModelSpec.vllm_checkpoint`), window KV kept until evicted.

Every engine's policy (radixkv, sglang, vllm) caches a request's prompt and its output
but the last token, whose KV is never computed; by default (``accounting="served"``) a
request's new KV counts against the budget before it runs, as an engine holds it while
it runs; ``"after"`` fits the budget after each request instead, as Marconi's simulator
(and so its rows) count.

Owns: the replay, the budgets and the accounting. Must not touch: the components'
internals (it drives them through their API).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from radixkv.key import RadixKey
from radixkv.kvcache.budget import HybridBudget
from radixkv.kvcache.plan import SGLANG_STATE_RATIO, SGLANG_WINDOW_RATIO
from radixkv.kvcache.recurrent.component import StateCheckpoints
from radixkv.kvcache.spec import prefill_flops
from radixkv.kvcache.window.component import WindowKV
from radixkv.sim import marconi
from radixkv.sim.traces import SimRequest, Trace
from radixkv.sim.vllm_pool import VllmAlignPool
from radixkv.tree import RadixCache
from radixkv.units import div_ceil

KERNEL_BLOCK = 16  # vLLM's attention kernel block alignment (FlashAttention's 16)
SPEC_MAX = 1 << 50  # a spec's sizes and counts: beyond, no model (10^400 overflowed floats)


@dataclass(frozen=True)
class ModelSpec:
    """What caching costs for one model (bytes; all layers of a kind together).

    Attributes:
        full_layers: full-attention layers.
        kv_bytes: K and V bytes of one token in one attention layer.
        window_layers, window: sliding-window layers and their window (tokens).
        recurrent_layers, state_bytes: recurrent layers and one layer's state bytes
            (conv and SSM / DeltaNet state) in one checkpoint.
        params, attn_dim: parameters and attention width (heads x head dim), for the
            prefill FLOPs a hit saves.
    """

    name: str
    full_layers: int
    kv_bytes: int
    window_layers: int = 0
    window: int = 0
    recurrent_layers: int = 0
    state_bytes: int = 0
    params: float = 1e9
    attn_dim: int = 4096

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ValueError(f"model spec: name must be a string, got {self.name!r:.40}")
        for f in ("full_layers", "kv_bytes", "window_layers", "window", "recurrent_layers",
                  "state_bytes", "attn_dim"):  # fmt: skip
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < SPEC_MAX:
                raise ValueError(f"model spec {self.name}: {f} must be an int in [0, 2**50), "
                                 f"got {v!r:.40}")  # fmt: skip
        p = self.params
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p < SPEC_MAX:
            raise ValueError(f"model spec {self.name}: params must be a number in (0, 2**50), "
                             f"got {p!r:.40}")  # fmt: skip
        if self.full_layers < 1 or self.kv_bytes < 1:
            raise ValueError(f"model spec {self.name}: needs full_layers and kv_bytes >= 1")
        if bool(self.window_layers) != bool(self.window):
            raise ValueError(f"model spec {self.name}: window_layers and window go together")
        if bool(self.recurrent_layers) != bool(self.state_bytes):
            raise ValueError(f"model spec {self.name}: recurrent_layers and state_bytes go "
                             "together")  # fmt: skip

    @property
    def full_kv(self) -> int:
        """Full-attention KV bytes a token."""
        return self.full_layers * self.kv_bytes

    @property
    def window_kv(self) -> int:
        """Window-layer KV bytes a token."""
        return self.window_layers * self.kv_bytes

    @property
    def checkpoint(self) -> int:
        """Bytes of one checkpoint (every recurrent layer's state)."""
        return self.recurrent_layers * self.state_bytes

    def flops(self, tokens: int) -> float:
        """Prefill FLOPs of a prefix of ``tokens``: the weights' and the attention's."""
        return prefill_flops(tokens, self.params, self.attn_dim, self.full_layers,
                             self.window_layers, self.window)  # fmt: skip

    def arena_checkpoint(self, page: int) -> int:
        """Bytes a checkpoint takes in the engine's arena (`radixkv.kvcache.arena`):
        whole units, a unit being one page of K and V over its layer group."""
        from radixkv.kvcache.arena import layer_group

        layer_page = page * self.kv_bytes
        g = layer_group(self.full_layers, self.window_layers, layer_page, self.checkpoint)
        return div_ceil(self.checkpoint, g * layer_page) * g * layer_page

    def vllm_block(self) -> int:
        """vLLM's attention block under ``--mamba-cache-mode align``: the smallest
        multiple of the kernel block whose page (one layer's KV for the block) holds one
        layer's state (``_align_hybrid_block_size``); the kernel block without one."""
        if not self.recurrent_layers:
            return KERNEL_BLOCK
        return KERNEL_BLOCK * div_ceil(self.state_bytes, KERNEL_BLOCK * self.kv_bytes)

    def vllm_checkpoint(self) -> int:
        """Bytes a state takes in vLLM's align mode: each recurrent layer's state in a
        page of the attention block's size (one block per layer group, the state padded
        to it), as its one block pool holds it."""
        page = self.vllm_block() * self.kv_bytes
        return self.recurrent_layers * max(page, self.state_bytes)

    @classmethod
    def from_json(cls, path: str | Path) -> ModelSpec:
        """A spec from a JSON object with these fields (unknown fields refused).

        Raises:
            ValueError: naming the field or the file.
        """
        from radixkv.checkpoint.files import read_json

        data = read_json(path)  # bounded, a regular file, a JSON object, not too deep
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"model spec {path}: unknown fields {sorted(unknown)}")
        data.setdefault("name", Path(path).stem)
        return cls(**data)

    @classmethod
    def from_folder(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> ModelSpec:
        """The spec of a model folder radixkv serves, from its ``config.json`` alone (the
        model built on the meta device, no weights read), in the bytes the engine holds
        at ``dtype`` (``radixkv serve``'s float32 by default): its full-attention and
        sliding layers' KV a token (the longest window, when they differ), its recurrent
        layers' state row (float32, as the engine keeps it), its parameters.

        Raises:
            ValueError (UnsupportedModel, FolderError): an architecture radixkv does not
                serve, a bad config, or a model without a full-attention layer (the
                simulator's byte budget counts a cached token's full KV).
        """
        from radixkv.checkpoint.files import read_json
        from radixkv.engine.models import architecture_of, config_from_dict, family

        folder = Path(path)
        raw = read_json(folder / "config.json")
        fam, cfg = family(architecture_of(raw)), config_from_dict(raw)
        with torch.device("meta"):
            model = fam.MODEL_CLASS(cfg)
        specs = cfg.layer_specs()
        full, sliding, state = specs.full, specs.window, specs.recurrent
        if full is None:
            raise ValueError(f"model spec {folder}: {cfg.architecture} has no full-attention "
                             "layer; the hybrid simulator counts a token's full KV")  # fmt: skip
        return cls(
            name=folder.name, full_layers=len(full.layers),
            kv_bytes=full.token_bytes(dtype) // len(full.layers),
            window_layers=len(sliding.layers) if sliding else 0,
            window=sliding.window if sliding else 0,
            recurrent_layers=state.layers if state else 0,
            state_bytes=state.layer_bytes if state else 0,
            params=float(sum(p.numel() for p in model.parameters())),
            attn_dim=cfg.num_attention_heads * cfg.head_dim,
        )  # fmt: skip


PRESETS = {
    # 8 gated full-attention + 24 Gated DeltaNet layers (3:1); 4 KV heads x 256, bf16;
    # a DeltaNet layer's state 32 heads x 128 x 128 fp32 + its short conv: 528 tokens
    # of one layer's KV, the block vLLM computes for Qwen3.5-4B
    "qwen3.5-4b": ModelSpec("qwen3.5-4b-like", 8, 4096, recurrent_layers=24,
                            state_bytes=528 * 4096, params=4e9, attn_dim=16 * 256),
    # 4 attention + 24 Mamba2 layers; 8 KV heads x 128, bf16; a Mamba2 state 128 heads x
    # 64 x 128 fp32 + conv
    "nemotron-h": ModelSpec("nemotron-h-like", 4, 4096, recurrent_layers=24,
                            state_bytes=1040 * 4096, params=8e9, attn_dim=32 * 128),
    # 5 sliding (window 1,024) : 1 global, 48 layers; 8 KV heads x 256, bf16
    "gemma-3": ModelSpec("gemma-3-like", 8, 8192, window_layers=40, window=1024,
                         params=12e9, attn_dim=16 * 256),
}  # fmt: skip


def model_spec(name: str) -> ModelSpec:
    """A preset by name, a JSON file, or a model folder (`ModelSpec.from_folder`).

    Raises:
        ValueError: none of them, or a bad one.
    """
    if name in PRESETS:
        return PRESETS[name]
    if Path(name).is_file():
        return ModelSpec.from_json(name)
    if Path(name).is_dir():
        return ModelSpec.from_folder(name)
    raise ValueError(f"model_spec: {name!r} is not a preset ({', '.join(PRESETS)}), a "
                     "JSON file nor a model folder")  # fmt: skip


POLICIES = ("radixkv", *marconi.POLICIES, "sglang", "vllm")
SESSION = "session"  # radixkv's budget in the session order (named, not in POLICIES)
# when a request's new KV counts against the budget: "served", from before it runs (the
# engine holds it while it runs: room is made first); "after", once it is cached (the
# budget fit after each request, as Marconi's simulator counts: a running request may
# overflow the budget)
ACCOUNTING = ("served", "after")
SCHEDULES = ("fcfs", "lpm")  # the order requests are served in (the engine's schedule_policy)


@dataclass
class HybridResult:
    trace: str
    model: str
    policy: str
    capacity_bytes: int
    requests: int
    prompt_tokens: int
    hit_tokens: int
    token_hit_rate: float
    flops_saved: float  # prefill FLOPs the hits saved / all prompts' prefill FLOPs
    mean_bytes: dict[str, float] = field(default_factory=dict)  # full, window, states
    checkpoints: int = 0  # checkpoints taken
    block_tokens: int = 0  # the grid hits land on (vllm), else the page
    refused: int = 0  # requests the pool could not hold (vllm: it would not start; serve:
    # the engine refused it, as `radixkv serve` does): each a miss
    cached: list[int] = field(default_factory=list)  # each request's hit tokens, trace order

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Slots:
    """Counts what a component frees (the simulator has no pools)."""

    def __init__(self) -> None:
        self.freed = 0

    def free(self, t: torch.Tensor) -> None:
        self.freed += len(t)


class _Sim:
    """One policy's cache over a trace."""

    def __init__(
        self, trace: Trace, spec: ModelSpec, cap: int, policy: str, accounting: str = "served",
        every_pages: int = 0,
    ) -> None:  # fmt: skip
        self.trace, self.spec, self.cap = trace, spec, cap
        self.accounting, self.sessions = accounting, None
        # the session order is radixkv's engine with its budget in the stamped order
        ordered, policy = ("priority", "radixkv") if policy == SESSION else ("greedy-dual", policy)
        self.policy = policy
        self.unit = trace.block_size  # tokens a unit
        grid = spec.vllm_block() if policy == "vllm" else self.unit
        self.page = max(1, grid // self.unit) if policy == "vllm" else 1
        states = 1 << 30  # the budget below is what bounds them
        if policy == "sglang" and spec.checkpoint:
            full_share = cap / (1 + SGLANG_STATE_RATIO)
            states = max(1, int(cap - full_share) // spec.checkpoint)
        # radixkv's checkpoints take whole arena units, as the engine stores them
        self.ckpt = spec.checkpoint
        if policy == "radixkv":
            self.ckpt = spec.arena_checkpoint(self.unit)
        elif policy == "vllm":  # padded to vLLM's page, in every layer
            self.ckpt = spec.vllm_checkpoint()
        self.state = StateCheckpoints(
            states, _Slots(), "utility" if policy == "radixkv" else "lru",
            prefill_flops=lambda units: spec.flops(units * self.unit), state_bytes=self.ckpt,
            every_pages=every_pages,
            on_evict=self._drop_stateless_leaves if policy == "sglang" else None,
        )  # fmt: skip
        comps: list[Any] = [self.state] if spec.recurrent_layers else []
        self.window = None
        if spec.window_layers:
            self.window = WindowKV(div_ceil(spec.window, self.unit), _Slots(), "all")
            comps.append(self.window)
        # SGLang frees whole leaves (its evict overshoots by up to a leaf); the others trim
        mode = "leaf" if policy == "sglang" else "precise"
        # (with neither a state nor a window the budget frees through the tree's own
        # order: the stamps' there too)
        tree_order = "priority" if ordered == "priority" else "lru"
        self.cache = RadixCache(self.page, eviction_policy=tree_order, eviction_mode=mode,
                                components=tuple(comps))  # fmt: skip
        # a hit's worth: the tokens it saves (the budget's default), as in the engine
        self.budget = HybridBudget(
            self.cache, self.state if spec.recurrent_layers else None, self.window,
            token_bytes=self.unit * spec.full_kv, window_bytes=self.unit * spec.window_kv,
            order=ordered,
        )  # fmt: skip
        if ordered == "priority":
            from radixkv.sim.sessions import StampedSessions

            self.sessions = StampedSessions(self.cache)
        self.next_slot = 0
        self.checkpoints = 0
        self.bytes_sum = {"full": 0.0, "window": 0.0, "states": 0.0}

    # --- bytes --------------------------------------------------------------------------
    def held(self) -> dict[str, int]:
        return self.budget.held()

    def _slot(self) -> int:
        self.next_slot += 1
        return self.next_slot

    # --- one request --------------------------------------------------------------------
    def serve(self, req: SimRequest, outputs: bool) -> int:
        if self.sessions is not None:
            self.sessions.arrive(req)
        P = req.num_prompt_units
        units = req.units[: self.trace.cached_units(req, outputs)]
        key = RadixKey(np.asarray(units, dtype=np.int64))
        prompt = key[: max(P - 1, 0) if P * self.unit > req.prompt_tokens - 1 else P]
        _, last, hit, full = self.cache.match_parts(prompt)  # one walk: the hit, the branch
        if hit and self.spec.recurrent_layers:
            self.state.used(last)
        self.cache.inc_lock_ref(last)
        positions = self._positions(req, full, hit, outputs)
        served, n = self.accounting == "served", len(units)
        held = n  # pages it holds at its peak: with its last, partial one
        if served:  # room for its KV before it runs, as the engine's arena makes it
            held = max(n, div_ceil(req.prompt_tokens + max(req.output_tokens - 1, 0), self.unit))
            self._fit(held - hit)
        mark = last  # where a match can end: its deepest checkpoint (the session's stamp)
        for pos, kind in positions:  # its KV to each checkpoint, then the checkpoint
            node = mark = self._insert(key[:pos], kind)
            if served:  # locked while it runs; the KV past it is still the request's
                self.cache.inc_lock_ref(node)
                self.cache.dec_lock_ref(last)
                last = node
                self._fit(held - pos, 1 if self.spec.recurrent_layers else 0)
            self._checkpoint(node, kind)
        end = self._insert(key[:n], None)  # (past its last checkpoint: dead KV, step 1's)
        if not self.spec.recurrent_layers:  # (a match can end anywhere on its path)
            mark = end
        self.cache.dec_lock_ref(last)
        if self.sessions is not None and mark is not self.cache.root:
            self.sessions.served(req, mark)
        self._fit()
        for k, v in self.held().items():
            self.bytes_sum[k] += v
        return hit

    def cached_prefix(self, req: SimRequest, kv: bool = False) -> int:
        """Units of the request's prompt a match would serve now (what the engine's
        ``lpm`` schedule ranks waiting requests by); ``kv``: the KV held, whether or not
        a state is there to resume from. No change to the cache."""
        key = RadixKey(np.asarray(req.units[: req.num_prompt_units], dtype=np.int64))
        return self.cache.match_len(key, full=kv)

    def _positions(
        self, req: SimRequest, full: int, hit: int, outputs: bool
    ) -> list[tuple[int, str]]:
        """Where this policy takes checkpoints (units, increasing), and why."""
        P = min(req.num_prompt_units, req.prompt_tokens // self.unit)  # whole pages
        n = self.trace.cached_units(req, outputs) if outputs else P
        if not self.spec.recurrent_layers:  # a window kept at the boundaries
            if self.policy != "radixkv" or self.window is None:
                return []
            return [(b, "boundary") for b in req.boundaries if hit < b <= n]
        if self.policy == "radixkv":  # as the engine (`radixkv.kvcache.recurrent`): the
            # component's plan, where the same prompt sent again starts, the last page a
            # decode step reached
            marks = dict(self.state.plan(P, full, hit, req.boundaries))
            marks.setdefault((req.prompt_tokens - 1) // self.unit, "resend")
            if n * self.unit > req.prompt_tokens:
                marks.setdefault(n, "end")
        elif self.policy == "vllm":  # the grid: the prompt's last full block, decode blocks
            g = self.page
            marks = dict.fromkeys({P - P % g} | set(range(P - P % g + g, n + 1, g)), "end")
        else:  # the sequence's end (the output's, when cached), the branch point
            marks = {n: "end"}
            if full > hit:
                marks[full] = "branch"
        return sorted((p, k) for p, k in marks.items() if hit < p <= n and p % self.page == 0)

    def _insert(self, key: RadixKey, kind: str | None) -> Any:
        extras = None
        if self.window is not None:
            n = len(key)
            extras = {"window": np.arange(self.next_slot, self.next_slot + n, dtype=np.int64)}
            self.next_slot += n
        node = self.cache.insert_node(key, extras=extras).last_node
        if kind == "boundary" and self.window is not None and node is not self.cache.root:
            self.window.mark(node)
        return node

    def _checkpoint(self, node: Any, kind: str) -> None:
        if (
            self.spec.recurrent_layers
            and node is not self.cache.root
            and node.parent is not None  # (evicted while the request ran: none)
            and self.state.add(node, self._slot(), kind=kind)
        ):
            self.checkpoints += 1

    def _drop_stateless_leaves(self, gone: list[Any]) -> None:
        """SGLang's state pool evicting a leaf's state evicts the leaf with it (its KV
        past the last state is dead to the recurrent layers); an inner node's state
        goes alone. ``gone``: the checkpoints the state pool just evicted (its
        ``on_evict``)."""
        for node in {id(c.node): c.node for c in gone}.values():
            if (node.parent is not None and not node.children and not node.lock_ref
                    and not self.state.checkpoints(node)):  # fmt: skip
                self.cache.evict_leaf(node)

    # --- the budget ---------------------------------------------------------------------
    def _fit(self, units: int = 0, checkpoints: int = 0) -> None:
        """Evict until what is held, plus ``units`` new units and ``checkpoints`` new
        checkpoints a request is about to hold, fits the capacity (each policy in its
        own order; SGLang's in its separate pools)."""
        spec, u = self.spec, self.unit
        if self.policy == "sglang":
            full_cap = self.cap / (1 + (SGLANG_STATE_RATIO if spec.checkpoint else 0))
            if self.window is not None:
                # the window pool holds 0.8 of the full pool's tokens
                tokens = full_cap / (spec.full_kv + SGLANG_WINDOW_RATIO * spec.window_kv)
                over = (self.window.held_units() + units) * u - int(SGLANG_WINDOW_RATIO * tokens)
                if over > 0:
                    self.window.evict(div_ceil(over, u))
                full_cap = tokens * spec.full_kv
            over = (self.cache.total_size() + units) * u * spec.full_kv - full_cap
            if over > 0:
                self.cache.evict(div_ceil(int(over), u * spec.full_kv))
            return  # (its state pool evicts as a checkpoint is added)
        unit_bytes = u * (spec.full_kv + spec.window_kv)
        need = units * unit_bytes + checkpoints * self.ckpt
        for _ in range(1 << 20):
            over = sum(self.held().values()) + need - self.cap
            if over <= 0 or not self.cache.evictable_size():
                return
            if self.policy == "vllm":
                self.cache.evict(max(1, div_ceil(over, unit_bytes)))
            else:  # as the engine's arena: windows no match end needs go first
                if self.window is not None:
                    self.window.evict_spare(div_ceil(over, u * spec.window_kv))
                self.budget.fit(max(self.cap - need, 0))
                return


class _MarconiSim:
    """Marconi's own policies (`radixkv.sim.marconi`) behind the replay's interface: a
    lookup of the whole prompt, then an insert of prompt + output (or the prompt), in
    units of the trace (tokens at page 1, as Marconi's results are)."""

    def __init__(self, trace: Trace, spec: ModelSpec, cap: int, policy: str) -> None:
        self.spec, self.unit = spec, trace.block_size
        self.page = max(1, marconi.VLLM_BLOCK // self.unit) if policy == "vllm+" else 1
        self.cache = marconi.MarconiCache(
            policy, cap, spec.checkpoint, self.unit * (spec.full_kv + spec.window_kv),
            marconi.Flops.of(spec), block=self.page,
        )  # fmt: skip
        self.bytes_sum = {"full": 0.0, "window": 0.0, "states": 0.0}

    @property
    def checkpoints(self) -> int:
        return self.cache.created

    def serve(self, req: SimRequest, outputs: bool) -> int:
        P = req.num_prompt_units
        units = np.asarray(req.units if outputs else req.units[:P], dtype=np.int64)
        hit = self.cache.lookup(units[:P])
        self.cache.insert(units, P)
        c, tokens = self.cache, self.cache.tokens * self.unit
        self.bytes_sum["full"] += tokens * self.spec.full_kv
        self.bytes_sum["window"] += tokens * self.spec.window_kv
        self.bytes_sum["states"] += c.nodes * c.state_bytes
        return hit


def lpm_order(trace: Trace, sim: Any) -> Iterator[SimRequest]:
    """The trace's requests in the order the engine's default ``lpm`` schedule serves
    them one at a time: requests with the same timestamp arrive together, and each time
    the one with the longest cached prefix goes next (the earliest among ties); the next
    group arrives when they are done. O(group size ^ 2) matches a group."""
    for _, group in itertools.groupby(trace.requests, key=lambda r: r.timestamp):
        waiting = list(group)
        while waiting:
            best = max(range(len(waiting)), key=lambda i: (sim.cached_prefix(waiting[i]), -i))
            yield waiting.pop(best)


def simulate_hybrid(
    trace: Trace, spec: ModelSpec, capacity_bytes: int, policy: str, cache_outputs: bool = True,
    accounting: str = "served", schedule: str = "fcfs",
    on_request: Callable[[SimRequest, int, int | None], None] | None = None,
    checkpoint_every: int = 0,
) -> HybridResult:  # fmt: skip
    """Replay ``trace`` through one policy's cache of ``capacity_bytes``; ``accounting``
    (`ACCOUNTING`) for the engines' policies (Marconi's keep their own); ``schedule``:
    ``fcfs`` (the trace's order) or ``lpm`` (`lpm_order`, for the engines' policies).
    ``on_request(req, hit_tokens, kv_tokens)``, after each request: its hit, and for the
    tree rows the tokens of its prompt the cache held before it ran (KV, whether or not
    a state was there to resume from; None for the other rows). ``checkpoint_every``: the
    ``radixkv`` policy also checkpoints every this many tokens, as the engine does."""
    if policy not in (*POLICIES, SESSION):
        raise ValueError(f"policy: unknown {policy!r}; valid: {', '.join((*POLICIES, SESSION))}")
    if accounting not in ACCOUNTING:
        raise ValueError(f"accounting: unknown {accounting!r}; valid: {', '.join(ACCOUNTING)}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: unknown {schedule!r}; valid: {', '.join(SCHEDULES)}")
    _check_every(checkpoint_every, policy, spec, trace.block_size)
    if policy in marconi.POLICIES:
        sim: Any = _MarconiSim(trace, spec, capacity_bytes, policy)
    elif policy == "vllm" and spec.recurrent_layers and not spec.window_layers:
        sim = VllmAlignPool(trace, spec, capacity_bytes)  # its block pool, block for block
    else:
        sim = _Sim(trace, spec, capacity_bytes, policy, accounting,
                   checkpoint_every // trace.block_size)  # fmt: skip
    hit_tokens = prompt_tokens = 0
    saved = total = 0.0
    lpm = schedule == "lpm" and policy not in marconi.POLICIES
    where = {id(r): i for i, r in enumerate(trace.requests)}
    cached = [0] * len(trace.requests)
    for req in lpm_order(trace, sim) if lpm else trace.requests:
        held = sim.cached_prefix(req, kv=True) if on_request and isinstance(sim, _Sim) else None
        hit = sim.serve(req, cache_outputs)
        tokens = trace.hit_tokens(req, hit)
        cached[where[id(req)]] = tokens
        if on_request is not None:
            on_request(req, tokens, None if held is None else trace.hit_tokens(req, held))
        hit_tokens += tokens
        prompt_tokens += req.prompt_tokens
        saved += spec.flops(tokens)
        total += spec.flops(req.prompt_tokens)
    n = max(len(trace.requests), 1)
    return HybridResult(
        trace=trace.name, model=spec.name, policy=policy, capacity_bytes=capacity_bytes,
        requests=len(trace.requests), prompt_tokens=prompt_tokens, hit_tokens=hit_tokens,
        token_hit_rate=hit_tokens / prompt_tokens if prompt_tokens else 0.0,
        flops_saved=saved / total if total else 0.0,
        mean_bytes={k: v / n for k, v in sim.bytes_sum.items()},
        checkpoints=sim.checkpoints,
        block_tokens=sim.page * sim.unit,
        refused=getattr(sim, "refused", 0), cached=cached,
    )  # fmt: skip


def window_bytes_per_token(trace: Trace, spec: ModelSpec, retain: str) -> float:
    """KV bytes a cached token costs with window freeing (``ends``) or without (``all``),
    everything cached (no budget): the Gemma-like target's measure."""
    unit = trace.block_size
    window = WindowKV(div_ceil(spec.window, unit), _Slots(), retain)
    cache = RadixCache(1, eviction_mode="precise", components=(window,))
    nxt = 0
    for req in trace.requests:
        key = RadixKey(np.asarray(req.units, dtype=np.int64))
        extras = {"window": np.arange(nxt, nxt + len(key), dtype=np.int64)}
        nxt += len(key)
        cache.insert_node(key, extras=extras)
    tokens = cache.total_size() * unit
    held = tokens * spec.full_kv + window.held_units() * unit * spec.window_kv
    return held / tokens if tokens else 0.0


UNBOUNDED = 1 << 62  # a capacity in bytes no trace fills


def _check_every(every: int, policy: str, spec: ModelSpec, block: int) -> None:
    """``checkpoint_every``: the engine's knob, so radixkv's policy alone takes it."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ValueError(f"checkpoint_every must be a non-negative int, got {every!r}")
    for bad, why in (
        (policy != "radixkv", f": the radixkv policy's (the engine's), not {policy}'s"),
        (not spec.recurrent_layers, f": {spec.name} has no recurrent layers to checkpoint"),
        (every % block, f" must be a multiple of the trace's block size ({block}), got {every}"),
    ):
        if every and bad:
            raise ValueError("checkpoint_every" + why)


def sweep_hybrid(
    trace: Trace,
    spec: ModelSpec,
    capacities: list[int],
    policies: list[str],
    cache_outputs: bool = True,
    progress: Any = None,
    accounting: str = "served",
) -> list[HybridResult]:
    """Every policy at every capacity (bytes), capacity-major."""
    for p in policies:
        if p not in POLICIES:
            raise ValueError(f"policy: unknown {p!r}; valid: {', '.join(POLICIES)}")
    results = []
    for cap in capacities:
        for p in policies:
            results.append(simulate_hybrid(trace, spec, cap, p, cache_outputs, accounting))
            if progress is not None:
                progress(results[-1])
    return results


def fmt_bytes(n: float) -> str:
    if n >= UNBOUNDED:
        return "inf"
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}B"


__all__ = [
    "ACCOUNTING",
    "POLICIES",
    "PRESETS",
    "SCHEDULES",
    "UNBOUNDED",
    "HybridResult",
    "ModelSpec",
    "lpm_order",
    "model_spec",
    "simulate_hybrid",
    "sweep_hybrid",
    "window_bytes_per_token",
]
