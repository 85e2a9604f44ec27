"""Qwen2ForCausalLM (Qwen2, Qwen2.5): Llama's decoder with biases on q, k and v, and
optionally sliding-window attention on the layers from ``max_window_layers`` on
(``use_sliding_window``) or as ``layer_types`` says.

Owns: how a Qwen2 ``config.json`` maps onto the shared decoder. Must not touch: the
decoder's layers (``llama.py``).
"""

from __future__ import annotations

from radixkv.engine.models.llama import MODEL_CLASS, variant_config

ARCHITECTURE = "Qwen2ForCausalLM"
WINDOW_FIELDS = {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}
ModelConfig = variant_config(ARCHITECTURE, WINDOW_FIELDS, {"hidden_act": ("silu",)},
                             qkv_bias=True)  # fmt: skip

__all__ = ["ARCHITECTURE", "MODEL_CLASS", "ModelConfig"]
