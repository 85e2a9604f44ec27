"""A model that is only its cache's shape: a `ModelSpec` (a preset, a JSON file) as the
layer specs an engine sizes and manages its cache from, for replays through the engine
itself (`radixkv.sim.serve_replay`, index-only) where no model folder exists.

Byte for byte: the engine holds the KV at ``DTYPE`` (one byte), so one attention layer's
K and V of a token are ``kv_bytes`` (one head of ``kv_bytes / 2``), and a recurrent
layer's state row ``state_bytes``: the spec's own sizes. The model never runs; a replay
replaces its runner.

Owns: the spec's model. Must not touch: the engine (it is built as any model is).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from radixkv.kvcache.spec import LayerSpecs, RecurrentSpec

DTYPE = torch.float8_e4m3fn  # the KV dtype a spec model is replayed at (one byte: the
# spec's bytes; a floating dtype, as a model moves only to those)


@dataclass(frozen=True)
class SpecConfig:
    """What the engine reads of a model's config."""

    architecture: str
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    specs: LayerSpecs

    def layer_specs(self) -> LayerSpecs:
        return self.specs

    def state_spec(self) -> RecurrentSpec | None:
        return self.specs.recurrent


def layer_specs(spec: Any) -> LayerSpecs:
    """A `ModelSpec`'s layer specs at `DTYPE`.

    Raises:
        ValueError: an odd ``kv_bytes`` (K and V of a token are two equal halves).
    """
    if spec.kv_bytes % 2:
        raise ValueError(f"model spec {spec.name}: kv_bytes must be even (K and V), got "
                         f"{spec.kv_bytes}")  # fmt: skip
    state = None
    if spec.recurrent_layers:
        state = RecurrentSpec(spec.recurrent_layers, ((spec.state_bytes,),), DTYPE)
    windows = [0] * spec.full_layers + [spec.window] * spec.window_layers
    return LayerSpecs.attention(windows, 1, spec.kv_bytes // 2, state)


class SpecModel(torch.nn.Module):
    """A `ModelSpec`'s model: its config, no weights, never run."""

    def __init__(self, spec: Any, vocab_size: int) -> None:
        super().__init__()
        specs = layer_specs(spec)
        self.config = SpecConfig(f"spec:{spec.name}", 1, spec.kv_bytes // 2, vocab_size, specs)

    def use_states(self, pool: Any) -> None:
        """Nothing to run on the pool's rows (a replay copies no state)."""

    def forward(self, *_: Any) -> torch.Tensor:
        raise RuntimeError("a spec model only has a shape; replay it (radixkv.sim.serve_replay)")
