"""MistralForCausalLM: Llama's decoder with sliding-window attention on every layer when
``sliding_window`` is set (a query sees itself and the ``sliding_window - 1`` tokens
before it, as transformers' mask does).

The KV of tokens outside the window stays in the pool (the prefix cache shares it as
any KV); attention just does not read it.

Owns: how a Mistral ``config.json`` maps onto the shared decoder. Must not touch: the
decoder's layers (``llama.py``).
"""

from __future__ import annotations

from radixkv.engine.models.llama import MODEL_CLASS, variant_config

ARCHITECTURE = "MistralForCausalLM"
ModelConfig = variant_config(ARCHITECTURE, {"sliding_window", "layer_types"},
                             {"hidden_act": ("silu",)})  # fmt: skip

__all__ = ["ARCHITECTURE", "MODEL_CLASS", "ModelConfig"]
