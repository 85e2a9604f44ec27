"""Qwen3ForCausalLM (dense Qwen3): Llama's decoder with an RMSNorm over each head of q
and k before RoPE, and optionally sliding-window layers as Qwen2 has them.

Owns: how a Qwen3 ``config.json`` maps onto the shared decoder. Must not touch: the
decoder's layers (``llama.py``).
"""

from __future__ import annotations

from radixkv.engine.models.llama import MODEL_CLASS as _DECODER
from radixkv.engine.models.llama import ModelConfig as _Base
from radixkv.engine.models.llama import layer_windows
from radixkv.engine.models.qwen2 import WINDOW_FIELDS

ARCHITECTURE = "Qwen3ForCausalLM"
FIXED = {"hidden_act": ("silu",), "attention_bias": (False,)}


class ModelConfig(_Base):
    @classmethod
    def from_dict(cls, d: dict) -> _Base:  # type: ignore[override]
        """Every field honored, neutral, or refused, naming it.

        Raises:
            UnsupportedModel: a field radixkv does not implement for Qwen3.
        """
        windows = layer_windows(d, ARCHITECTURE)
        return _Base.from_family_dict(d, ARCHITECTURE, WINDOW_FIELDS, FIXED, qk_norm=True,
                                      windows=windows)  # fmt: skip


MODEL_CLASS = _DECODER
