"""Layer specs: what each layer type of a model keeps in the cache, one spec per type, as
vLLM's v1 KV cache specs. A model's config declares them (``layer_specs()``); the loader
sizes the pools from them, the engine picks the cache parts a model needs from them and
the simulator's byte sizes come from them. Nothing probes a config for its layer types.

    FullAttentionSpec   layers that keep every token's K and V while a prefix is cached
    SlidingWindowSpec   layers that attend to their last ``window`` tokens only: a cached
                        prefix needs only its last window of their KV
    RecurrentSpec       layers with one fixed-size state per sequence (Gated DeltaNet,
                        Mamba): a prefix is reusable only where a checkpoint of it exists

A layer of an attention spec is named by its place in the KV pool (the model's layer
index, or on a hybrid model its place among the attention layers). Bytes are the
engine's: K and V at the KV dtype, a recurrent state at its own dtype.

Owns: the specs and their byte arithmetic. Must not touch: tensors and pools.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FullAttentionSpec:
    """Attention layers whose KV a cached prefix keeps whole."""

    layers: tuple[int, ...]  # places in the KV pool
    kv_heads: int
    head_dim: int

    def layer_token_bytes(self, dtype: torch.dtype) -> int:
        """K and V of one token in one of these layers."""
        return 2 * self.kv_heads * self.head_dim * dtype.itemsize

    def token_bytes(self, dtype: torch.dtype) -> int:
        """K and V of one token over these layers."""
        return len(self.layers) * self.layer_token_bytes(dtype)


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Attention layers that see their last ``window`` tokens (the longest, when the
    layers' windows differ: a prefix keeps that much of each)."""

    window: int = 0


@dataclass(frozen=True)
class RecurrentSpec:
    """``layers`` recurrent layers, each with state tensors of ``shapes`` per sequence."""

    layers: int
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype = torch.float32

    @property
    def layer_bytes(self) -> int:
        return sum(math.prod(s) for s in self.shapes) * self.dtype.itemsize

    @property
    def state_bytes(self) -> int:
        """One sequence's state over every recurrent layer: one checkpoint's bytes."""
        return self.layers * self.layer_bytes


@dataclass(frozen=True)
class LayerSpecs:
    """A model's specs: at most one of each type (``None``: the model has none)."""

    kv_layers: int  # layers with KV in the pool, full and sliding together
    full: FullAttentionSpec | None = None
    window: SlidingWindowSpec | None = None
    recurrent: RecurrentSpec | None = None

    @classmethod
    def attention(
        cls,
        windows: Sequence[int],
        kv_heads: int,
        head_dim: int,
        recurrent: RecurrentSpec | None = None,
    ) -> LayerSpecs:
        """The specs of attention layers whose windows are ``windows`` (one per layer of
        the KV pool, 0 for full attention), beside ``recurrent`` layers if any."""
        full = tuple(i for i, w in enumerate(windows) if not w)
        sliding = tuple(i for i, w in enumerate(windows) if w)
        return cls(
            len(windows),
            FullAttentionSpec(full, kv_heads, head_dim) if full else None,
            SlidingWindowSpec(sliding, kv_heads, head_dim, max(windows)) if sliding else None,
            recurrent,
        )

    def layer_token_bytes(self, dtype: torch.dtype) -> int:
        """K and V of one token in one attention layer (full and sliding layers share
        their heads' shape), 0 on a model without attention."""
        attention = self.full or self.window
        return attention.layer_token_bytes(dtype) if attention is not None else 0

    def window_limited(self, max_context_len: int) -> SlidingWindowSpec | None:
        """The sliding layers, when a request can outgrow their window (a window of
        ``max_context_len`` or more is full attention for every request)."""
        w = self.window
        return w if w is not None and w.window < max_context_len else None


def prefill_flops(
    tokens: float, params: float, attn_dim: int, full_layers: int, window_layers: int = 0,
    window: int = 0,
) -> float:  # fmt: skip
    """Prefill FLOPs of a prefix of ``tokens``: the weights' (2 x params a token) and the
    attention's (2 x width a pair of tokens, a window layer's pairs within its window):
    what a hit there saves (the budget's value of a checkpoint, as Marconi counts)."""
    n = float(tokens)
    attn = full_layers * n * n + window_layers * n * min(n, float(window))
    return 2.0 * params * n + 2.0 * attn_dim * attn


__all__ = ["FullAttentionSpec", "LayerSpecs", "RecurrentSpec", "SlidingWindowSpec",
           "prefill_flops"]  # fmt: skip
