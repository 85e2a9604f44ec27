"""Qwen2ForCausalLM (Qwen2, Qwen2.5): Llama's decoder with biases on q, k and v, and
optionally sliding-window attention on the layers from ``max_window_layers`` on
(``use_sliding_window``) or as ``layer_types`` says.

Owns: how a Qwen2 ``config.json`` maps onto the shared decoder. Must not touch: the
decoder's layers (``llama.py``).
"""

from __future__ import annotations

from radixkv.engine.models.llama import MODEL_CLASS as _DECODER
from radixkv.engine.models.llama import ModelConfig as _Base
from radixkv.engine.models.llama import layer_windows

ARCHITECTURE = "Qwen2ForCausalLM"
WINDOW_FIELDS = {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}
FIXED = {"hidden_act": ("silu",)}


class ModelConfig(_Base):
    @classmethod
    def from_dict(cls, d: dict) -> _Base:  # type: ignore[override]
        """Every field honored, neutral, or refused, naming it.

        Raises:
            UnsupportedModel: a field radixkv does not implement for Qwen2.
        """
        windows = layer_windows(d, ARCHITECTURE)
        return _Base.from_family_dict(d, ARCHITECTURE, WINDOW_FIELDS, FIXED, qkv_bias=True,
                                      windows=windows)  # fmt: skip


MODEL_CLASS = _DECODER
