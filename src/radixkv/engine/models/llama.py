"""A Llama-architecture model in plain PyTorch whose attention reads and writes K/V through
the `KVPool` by slot index.

The same decoder runs the families that differ from Llama only in a few switches
(``qwen2.py``: q/k/v biases; ``qwen3.py``: per-head q/k RMSNorm; ``mistral.py``:
sliding-window attention): `ModelConfig`'s variant fields, which a Llama ``config.json``
cannot set (`FIXED` refuses them there) and each family's ``from_dict`` sets.

A forward pass takes a *ragged batch*: the new tokens of several sequences laid end to
end (prefill chunks of any length, decode steps of one token). Each sequence's new K/V
are written to its ``out_slots`` first; its attention then gathers K/V for *all* of its
context slots (a cached prefix computed by another request included), so prefill
computes only the uncached suffix. Parameter names follow Hugging Face's
``LlamaForCausalLM``, so its state dicts load as they are.

Owns: Llama's hyper-parameters, layers and forward pass. Must not touch: the KV pool's
layout (it reads and writes by slot), the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import nn

from radixkv.engine.models.base import (
    ForwardBatch,
    GatedMLP,
    RMSNorm,
    UnsupportedModel,
    attend,
    check_fields,
    last_rows,
    rope_theta,
    rotate_half,
)
from radixkv.kvcache.memory import KVPool
from radixkv.kvcache.spec import LayerSpecs

ARCHITECTURE = "LlamaForCausalLM"


# config.json fields Llama has that radixkv runs only at these values
FIXED = {
    "hidden_act": ("silu",),
    "attention_bias": (False,),
    "mlp_bias": (False,),
    "sliding_window": (None,),
    "use_sliding_window": (False,),
    "layer_types": (None,),
}


@dataclass
class ModelConfig:
    """The Llama hyper-parameters (Hugging Face ``config.json`` names)."""

    vocab_size: int = 384
    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # the variants (set by the other families' from_dict, never by a Llama config.json)
    qkv_bias: bool = False  # biases on q, k and v (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    # per layer: how many tokens back a query sees, itself included (0: all); Mistral's
    # and Qwen's sliding_window on the layers their config names
    windows: tuple[int, ...] = ()
    architecture: str = ARCHITECTURE

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        self.windows = tuple(self.windows) or (0,) * self.num_hidden_layers
        if len(self.windows) != self.num_hidden_layers:
            raise ValueError("windows must give one window per layer")

    def layer_specs(self) -> LayerSpecs:
        """Full attention, and the sliding layers its windows name (`radixkv.kvcache.spec`)."""
        return LayerSpecs.attention(self.windows, self.num_key_value_heads, self.head_dim)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """A Hugging Face ``config.json`` of a Llama: every field honored, neutral, or
        refused (`radixkv.engine.models.base.check_fields`).

        Raises:
            UnsupportedModel: a field Llama as radixkv runs it does not implement.
        """
        return cls.from_family_dict(d, ARCHITECTURE, set(), FIXED)

    @classmethod
    def from_family_dict(
        cls, d: dict, architecture: str, honored: set[str], fixed: dict, **variant: object
    ) -> ModelConfig:
        """A ``config.json`` of a Llama-like family: its own fields (``honored``, those
        in ``fixed`` at the values listed) plus Llama's, every other field refused."""
        names = {f.name for f in fields(cls)} - VARIANT_FIELDS
        check_fields(d, architecture, names | honored | {"rope_parameters", "rope_scaling"},
                     fixed)  # fmt: skip
        kwargs = {k: v for k, v in d.items() if k in names and v is not None}
        kwargs["rope_theta"] = rope_theta(d, architecture, cls.rope_theta)
        eos = kwargs.get("eos_token_id")
        if isinstance(eos, list):
            kwargs["eos_token_id"] = eos[0]
        return cls(**kwargs, **variant, architecture=architecture)  # type: ignore[arg-type]

    def to_dict(self) -> dict:
        """A Llama's ``config.json``; for the other families every field, variants
        included (what the model identity hashes: the layer types are part of it)."""
        if self.architecture != ARCHITECTURE:
            return {f.name: getattr(self, f.name) for f in fields(self)}
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in VARIANT_FIELDS}
        return {**out, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}


VARIANT_FIELDS = frozenset({"qkv_bias", "qk_norm", "windows", "architecture"})


def variant_config(
    architecture: str, honored: set[str], fixed: dict, **variant: bool
) -> type[ModelConfig]:
    """The config class of a family that is this decoder with ``variant`` switched on
    (``qkv_bias``, ``qk_norm``), its windows read by `layer_windows`, its own
    ``config.json`` fields ``honored`` (those in ``fixed`` at the values listed) and
    every other field refused, naming it."""

    class FamilyConfig(ModelConfig):
        @classmethod
        def from_dict(cls, d: dict) -> ModelConfig:
            windows = layer_windows(d, architecture)
            return ModelConfig.from_family_dict(d, architecture, honored, fixed,
                                                windows=windows, **variant)  # fmt: skip

    FamilyConfig.__qualname__ = FamilyConfig.__name__ = f"{architecture}Config"
    return FamilyConfig


def layer_windows(d: dict, architecture: str) -> tuple[int, ...]:
    """Per layer, the sliding window a Mistral / Qwen ``config.json`` asks for (0: full
    attention): ``layer_types`` when given, else Qwen's ``use_sliding_window`` from
    layer ``max_window_layers`` on, else Mistral's ``sliding_window`` on every layer.

    A sliding layer with ``sliding_window`` null sees everything, as in transformers
    (Qwen3 writes ``layer_types`` but nulls the window without ``use_sliding_window``).

    Raises:
        UnsupportedModel: a layer type other than full and sliding attention, or a
            ``sliding_window`` that is not a positive int.
    """
    n = int(d.get("num_hidden_layers", ModelConfig.num_hidden_layers))
    window = d.get("sliding_window")
    types = d.get("layer_types")
    if types is None:
        if "use_sliding_window" in d:  # Qwen2 / Qwen3
            start = int(d.get("max_window_layers", n))
            on = bool(d["use_sliding_window"]) and window is not None
            types = ["sliding_attention" if on and i >= start else "full_attention"
                     for i in range(n)]  # fmt: skip
        else:  # Mistral
            types = ["sliding_attention" if window else "full_attention"] * n
    if not isinstance(types, list) or len(types) != n:
        raise UnsupportedModel(f"{architecture}: layer_types must list one type per layer")
    out = []
    for t in types:
        if t == "full_attention":
            out.append(0)
        elif t == "sliding_attention":
            if window is None:  # transformers: a sliding layer with no window sees all
                out.append(0)
                continue
            if isinstance(window, bool) or not isinstance(window, int) or window < 1:
                raise UnsupportedModel(f"{architecture}: sliding layers need a positive "
                                       f"sliding_window, config.json has {window!r}")  # fmt: skip
            out.append(window)
        else:
            raise UnsupportedModel(f"{architecture}: layer type {t!r} is not implemented "
                                   "by radixkv")  # fmt: skip
    return tuple(out)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.window = cfg.windows[layer_id]
        h, bias = cfg.hidden_size, cfg.qkv_bias
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=bias)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=bias)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        pool: KVPool,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.nh, self.hd)
        k = self.k_proj(x).view(t, self.nkv, self.hd)
        v = self.v_proj(x).view(t, self.nkv, self.hd)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        b = batch.for_layer(self.window)
        pool.write(self.layer_id, b.out_slots, k.to(pool.dtype), v.to(pool.dtype))
        out = attend(q, b, lambda slots: pool.read(self.layer_id, slots), self.window)
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, batch, pool):  # type: ignore[no-untyped-def]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, pool)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama with a slot-indexed KV pool. ``forward`` returns logits of each sequence's
    last new token (``[num_seqs, vocab]``), or of every new token with ``all_logits``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, hd]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: KVPool, all_logits: bool = False) -> torch.Tensor:
        x = self.model.embed_tokens(batch.input_ids)
        cos, sin = self._rope(batch.positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, batch, pool)
        x = self.model.norm(x)
        return self.lm_head(x if all_logits else last_rows(x, batch)).float()


MODEL_CLASS = LlamaForCausalLM
