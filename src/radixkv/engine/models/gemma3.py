"""Gemma3ForCausalLM (Gemma 3 text): sliding-window and global attention layers as
``layer_types`` says (five local to one global in the released models), each type with
its own RoPE base (and the global one's linear scaling), q/k RMSNorm, Gemma's norms
(``x * (1 + w)`` in float32) around both the attention and the MLP, the embedding scaled
by ``sqrt(hidden_size)``, ``query_pre_attn_scalar`` as the attention scale, GELU (tanh),
optional final-logit soft-capping (attention-logit soft-capping is refused: transformers'
Gemma 3 does not apply it). Parameter names follow transformers' ``Gemma3ForCausalLM``,
so its state dicts load as they are.

Window layers read and write their KV through ``ForwardBatch.for_layer``: in a slot space
of their own when the engine frees their KV outside the window
(`radixkv.kvcache.window.slots`), else beside the global layers'; attention reads only the
window either way.

Owns: Gemma 3's hyper-parameters, layers and forward pass. Must not touch: the KV pool's
layout (it reads and writes by slot), the cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import torch
from torch import nn

from radixkv.engine.models.base import (
    CenteredRMSNorm,
    ForwardBatch,
    GatedMLP,
    UnsupportedModel,
    attend,
    check_fields,
    last_rows,
    rotate_half,
)
from radixkv.kvcache.memory import KVPool
from radixkv.kvcache.spec import LayerSpecs

ARCHITECTURE = "Gemma3ForCausalLM"
LAYER_TYPES = ("sliding_attention", "full_attention")
FIXED = {
    "hidden_activation": ("gelu_pytorch_tanh",),
    "hidden_act": ("gelu_pytorch_tanh", None),
    "use_bidirectional_attention": (False, None),
    # transformers' Gemma3Attention never applies it (the released models leave it null):
    # refused rather than honored differently from the reference
    "attn_logit_softcapping": (None,),
}
# config.json fields read into something else than a same-named field
DERIVED = {"rope_parameters", "rope_scaling", "rope_theta", "rope_local_base_freq",
           "layer_types", "_sliding_window_pattern", "sliding_window_pattern"}  # fmt: skip


@dataclass
class ModelConfig:
    """Gemma 3's hyper-parameters (transformers' ``config.json`` names, plus
    ``windows`` and per-layer-type RoPE read from them)."""

    vocab_size: int = 384
    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    query_pre_attn_scalar: float = 16
    sliding_window: int = 4096
    attention_bias: bool = False
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 131072
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    windows: tuple[int, ...] = ()  # per layer: the window, 0 for a global layer
    # per layer type: (RoPE base, linear scaling factor)
    rope: tuple[tuple[float, float], tuple[float, float]] = ((10000.0, 1.0), (1e6, 1.0))
    architecture: str = ARCHITECTURE

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        self.windows = tuple(self.windows) or (self.sliding_window,) * self.num_hidden_layers
        if len(self.windows) != self.num_hidden_layers:
            raise ValueError("windows must give one window per layer")
        # a zero or negative one would divide by zero or flip the logits' order
        if not self.query_pre_attn_scalar > 0:
            raise UnsupportedModel(f"{ARCHITECTURE}: query_pre_attn_scalar must be positive, "
                                   f"config.json has {self.query_pre_attn_scalar!r}")  # fmt: skip
        cap = self.final_logit_softcapping
        if cap is not None and not cap > 0:
            raise UnsupportedModel(f"{ARCHITECTURE}: final_logit_softcapping must be positive "
                                   f"or null, config.json has {cap!r}")  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """Every field honored, neutral, or refused, naming it.

        Raises:
            UnsupportedModel: a field or value radixkv does not implement for Gemma 3.
        """
        names = {f.name for f in fields(cls)} - {"windows", "rope", "architecture"}
        check_fields(d, ARCHITECTURE, names | DERIVED, FIXED)
        kw: dict[str, Any] = {k: v for k, v in d.items() if k in names and v is not None}
        kw["final_logit_softcapping"] = d.get("final_logit_softcapping")
        if isinstance(kw.get("eos_token_id"), list):
            kw["eos_token_id"] = kw["eos_token_id"][0]
        n = int(d.get("num_hidden_layers", cls.num_hidden_layers))
        window = d.get("sliding_window", cls.sliding_window)
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise UnsupportedModel(f"{ARCHITECTURE}: sliding_window must be a positive int, "
                                   f"config.json has {window!r}")  # fmt: skip
        types = d.get("layer_types")
        if types is None:  # transformers' rule from the pattern
            every = int(d.get("sliding_window_pattern", d.get("_sliding_window_pattern", 6)))
            types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
        if not isinstance(types, list) or len(types) != n or not set(types) <= set(LAYER_TYPES):
            raise UnsupportedModel(f"{ARCHITECTURE}: layer_types must list {n} of {LAYER_TYPES}, "
                                   f"config.json has {types!r}")  # fmt: skip
        kw["windows"] = tuple(window if t == "sliding_attention" else 0 for t in types)
        kw["rope"] = rope_per_type(d)
        return cls(**kw)

    def layer_specs(self) -> LayerSpecs:
        """Its global layers and its sliding ones (`radixkv.kvcache.spec`)."""
        return LayerSpecs.attention(self.windows, self.num_key_value_heads, self.head_dim)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _rope_one(params: dict, where: str) -> tuple[float, float]:
    params = dict(params)
    kind = params.pop("rope_type", params.pop("type", "default"))
    theta = float(params.pop("rope_theta"))
    factor = 1.0
    if kind == "linear":
        factor = float(params.pop("factor"))
    elif kind != "default":
        raise UnsupportedModel(f"{ARCHITECTURE}: config.json asks for rope_type {kind!r} "
                               f"({where}); radixkv implements default and linear")  # fmt: skip
    if params:
        raise UnsupportedModel(f"{ARCHITECTURE}: config.json's RoPE parameters {sorted(params)} "
                               f"({where}) are not implemented by radixkv")  # fmt: skip
    return theta, factor


class RopePerType(NamedTuple):
    """(base, linear factor) of the rotary embedding for each kind of layer."""

    sliding: tuple[float, float]
    full: tuple[float, float]


def rope_per_type(d: dict) -> RopePerType:
    """(base, linear factor) for sliding and for global layers: transformers 5's
    ``rope_parameters`` by layer type, or the older ``rope_theta`` (global),
    ``rope_local_base_freq`` (sliding) and ``rope_scaling`` (global only)."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and set(params) <= set(LAYER_TYPES) and params:
        local = params.get("sliding_attention") or {"rope_theta": 10000.0}
        glob = params.get("full_attention") or {"rope_theta": 1e6}
        return RopePerType(_rope_one(local, "sliding_attention"), _rope_one(glob, "full_attention"))
    glob = {"rope_theta": d.get("rope_theta", 1e6), **(d.get("rope_scaling") or {})}
    if isinstance(params, dict):
        glob.update(params)
    local = {"rope_theta": d.get("rope_local_base_freq", 10000.0)}
    return RopePerType(_rope_one(local, "sliding_attention"), _rope_one(glob, "full_attention"))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.window = cfg.windows[layer_id]
        self.scale = cfg.query_pre_attn_scalar**-0.5
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=bias)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=bias)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=bias)
        self.q_norm = CenteredRMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = CenteredRMSNorm(self.hd, cfg.rms_norm_eps)

    def forward(self, x, rope, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:  # type: ignore[no-untyped-def]
        t = x.shape[0]
        cos, sin = rope[0 if self.window else 1]
        q = self.q_norm(self.q_proj(x).view(t, self.nh, self.hd))
        k = self.k_norm(self.k_proj(x).view(t, self.nkv, self.hd))
        v = self.v_proj(x).view(t, self.nkv, self.hd)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        b = batch.for_layer(self.window)
        pool.write(self.layer_id, b.out_slots, k.to(pool.dtype), v.to(pool.dtype))
        read = lambda slots: pool.read(self.layer_id, slots)  # noqa: E731
        return self.o_proj(attend(q, b, read, self.window, self.scale))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg, layer_id)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, "gelu_tanh")
        self.input_layernorm = CenteredRMSNorm(h, eps)
        self.post_attention_layernorm = CenteredRMSNorm(h, eps)
        self.pre_feedforward_layernorm = CenteredRMSNorm(h, eps)
        self.post_feedforward_layernorm = CenteredRMSNorm(h, eps)

    def forward(self, x, rope, batch, pool):  # type: ignore[no-untyped-def]
        a = self.self_attn(self.input_layernorm(x), rope, batch, pool)
        x = x + self.post_attention_layernorm(a)
        m = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(m)


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = CenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Gemma3ForCausalLM(nn.Module):
    """Gemma 3 (text) with a slot-indexed KV pool; ``forward`` as Llama's."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Gemma3Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        hd = cfg.head_dim
        for name, (theta, factor) in zip(("inv_freq_local", "inv_freq_global"), cfg.rope,
                                         strict=True):  # fmt: skip
            inv = 1.0 / (theta ** (torch.arange(0, hd, 2).float() / hd)) / factor
            self.register_buffer(name, inv, persistent=False)

    def _rope(self, positions: torch.Tensor, inv: torch.Tensor, dtype: torch.dtype):  # type: ignore[no-untyped-def]
        freqs = positions.float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: KVPool, all_logits: bool = False) -> torch.Tensor:
        x = self.model.embed_tokens(batch.input_ids)
        # the scale rounded to the weights' dtype first, as transformers does
        x = x * torch.tensor(math.sqrt(self.config.hidden_size), dtype=x.dtype)
        rope = (self._rope(batch.positions, self.inv_freq_local, x.dtype),
                self._rope(batch.positions, self.inv_freq_global, x.dtype))  # fmt: skip
        for layer in self.model.layers:
            x = layer(x, rope, batch, pool)
        x = self.model.norm(x)
        logits = self.lm_head(x if all_logits else last_rows(x, batch)).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = cap * torch.tanh(logits / cap)
        return logits


MODEL_CLASS = Gemma3ForCausalLM
