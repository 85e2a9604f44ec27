"""MistralForCausalLM: Llama's decoder with sliding-window attention on every layer when
``sliding_window`` is set (a query sees itself and the ``sliding_window - 1`` tokens
before it, as transformers' mask does).

The KV of tokens outside the window stays in the pool (the prefix cache shares it as
any KV); attention just does not read it.

Owns: how a Mistral ``config.json`` maps onto the shared decoder. Must not touch: the
decoder's layers (``llama.py``).
"""

from __future__ import annotations

from radixkv.engine.models.llama import MODEL_CLASS as _DECODER
from radixkv.engine.models.llama import ModelConfig as _Base
from radixkv.engine.models.llama import layer_windows

ARCHITECTURE = "MistralForCausalLM"
FIXED = {"hidden_act": ("silu",)}


class ModelConfig(_Base):
    @classmethod
    def from_dict(cls, d: dict) -> _Base:  # type: ignore[override]
        """Every field honored, neutral, or refused, naming it.

        Raises:
            UnsupportedModel: a field radixkv does not implement for Mistral.
        """
        windows = layer_windows(d, ARCHITECTURE)
        return _Base.from_family_dict(d, ARCHITECTURE, {"sliding_window", "layer_types"}, FIXED,
                                      windows=windows)  # fmt: skip


MODEL_CLASS = _DECODER
