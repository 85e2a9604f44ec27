"""Model families, one module each, chosen by ``config.json``'s ``architectures`` through
one registry.

    llama.py   LlamaForCausalLM (Llama 2/3, SmolLM2, TinyLlama, ...), and the decoder
               the next three share
    qwen2.py   Qwen2ForCausalLM (Qwen2, Qwen2.5: q/k/v biases)
    qwen3.py   Qwen3ForCausalLM (dense Qwen3: q/k norms)
    mistral.py MistralForCausalLM (sliding-window attention)
    gemma3.py  Gemma3ForCausalLM (Gemma 3 text: local and global layers)
    qwen3_5.py Qwen3_5ForCausalLM (Qwen3.5 text: Gated DeltaNet + gated attention)
    base.py    the ragged batch, shared layers, the strict config reader

A family module has ``ARCHITECTURE`` (the name in ``config.json``), ``ModelConfig`` (its
hyper-parameters; ``from_dict`` honors or refuses every field; ``layer_specs`` what each
layer type keeps in the cache, `radixkv.kvcache.spec`) and the model class.
An architecture not here is refused at start with one line naming it: never loaded as
another one.

Owns: the registry. Must not touch: any family's layers.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from radixkv.engine.models.base import ForwardBatch, UnsupportedModel

FAMILIES = {
    "LlamaForCausalLM": "radixkv.engine.models.llama",
    "Qwen2ForCausalLM": "radixkv.engine.models.qwen2",
    "Qwen3ForCausalLM": "radixkv.engine.models.qwen3",
    "MistralForCausalLM": "radixkv.engine.models.mistral",
    "Gemma3ForCausalLM": "radixkv.engine.models.gemma3",
    "Qwen3_5ForCausalLM": "radixkv.engine.models.qwen3_5",
}
# what a config without ``architectures`` (a bare PretrainedConfig) names by model_type
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
}


def architecture_of(config: dict[str, Any]) -> str:
    """The architecture a ``config.json`` names (``architectures[0]``, else by
    ``model_type``).

    Raises:
        UnsupportedModel: it names none, or several.
    """
    archs = config.get("architectures")
    if isinstance(archs, list) and len(archs) == 1 and isinstance(archs[0], str):
        return archs[0]
    if archs:
        raise UnsupportedModel(f"config.json names architectures {archs!r}: radixkv runs one")
    kind = config.get("model_type")
    if kind in MODEL_TYPES:
        return MODEL_TYPES[kind]
    raise UnsupportedModel(f"config.json names no architecture (model_type {kind!r})")


def family(architecture: str) -> ModuleType:
    """The module of a supported architecture.

    Raises:
        UnsupportedModel: radixkv does not run it (the message lists what it runs).
    """
    module = FAMILIES.get(architecture)
    if module is None:
        raise UnsupportedModel(
            f"architecture {architecture} is not supported by radixkv (it runs: "
            f"{', '.join(FAMILIES)})"
        )
    return importlib.import_module(module)


def config_from_dict(config: dict[str, Any]) -> Any:
    """The family's config for a ``config.json``, every field honored or refused, and
    every field the config class declares of the type it declares (`check_types`)."""
    cls = family(architecture_of(config)).ModelConfig
    check_types(config, cls)
    try:
        return cls.from_dict(config)
    except (TypeError, OverflowError) as e:  # a nested value of the wrong kind
        raise UnsupportedModel(f"config.json: {e}") from None


# a size beyond this is no model's (a 10^400 would overflow every allocation)
MAX_CONFIG_INT = 1 << 40


def check_types(config: dict[str, Any], cls: type) -> None:
    """Refuse a ``config.json`` value of another type than its field's in ``cls`` (a
    dataclass): an int (never a bool) of magnitude below `MAX_CONFIG_INT` for ``int``,
    a finite number for ``float``, a bool for ``bool``; ``None`` where the type allows
    it; a list of ints for a ``*_token_id`` (several end tokens).

    Raises:
        UnsupportedModel: naming the field, its value and the type wanted.
    """
    import dataclasses
    import math

    for f in dataclasses.fields(cls):
        if f.name not in config:
            continue
        v, kind = config[f.name], str(f.type).replace(" ", "")
        if v is None and "None" in kind.split("|"):
            continue
        base = kind.split("|")[0]
        if base == "int":
            ids = v if f.name.endswith("_token_id") and isinstance(v, list) and v else [v]
            ok = all(type(x) is int and abs(x) < MAX_CONFIG_INT for x in ids)
        elif base == "float":
            ok = type(v) in (int, float) and math.isfinite(v) and abs(v) < MAX_CONFIG_INT
        elif base == "bool":
            ok = type(v) is bool
        else:
            continue
        if not ok:
            raise UnsupportedModel(f"config.json: {f.name} must be {kind.replace('|', ' or ')}"
                                   f" (of magnitude below 2**40), got {v!r:.60}")  # fmt: skip


__all__ = [
    "FAMILIES",
    "ForwardBatch",
    "UnsupportedModel",
    "check_types",
    "config_from_dict",
    "family",
]
