"""Qwen3ForCausalLM (dense Qwen3): Llama's decoder with an RMSNorm over each head of q
and k before RoPE, and optionally sliding-window layers as Qwen2 has them.

Owns: how a Qwen3 ``config.json`` maps onto the shared decoder. Must not touch: the
decoder's layers (``llama.py``).
"""

from __future__ import annotations

from radixkv.engine.models.llama import MODEL_CLASS, variant_config
from radixkv.engine.models.qwen2 import WINDOW_FIELDS

ARCHITECTURE = "Qwen3ForCausalLM"
FIXED = {"hidden_act": ("silu",), "attention_bias": (False,)}
ModelConfig = variant_config(ARCHITECTURE, WINDOW_FIELDS, FIXED, qk_norm=True)

__all__ = ["ARCHITECTURE", "MODEL_CLASS", "ModelConfig"]
