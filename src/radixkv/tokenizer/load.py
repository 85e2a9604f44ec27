"""The one place a tokenizer is named, for the engine, the router and the simulator:
``byte``, ``smollm2``, ``auto``, a checkpoint folder or a ``gguf_tokenizer.json``.

Owns: resolving a tokenizer's name. Must not touch: weights (it loads none).
"""

from __future__ import annotations

import logging
from pathlib import Path

from radixkv.checkpoint.sources import smollm2_missing
from radixkv.tokenizer.gguf import BPETokenizer, smollm2_tokenizer
from radixkv.tokenizer.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer

BYTE_VOCAB = 384  # the tiny random model's vocabulary: the byte tokenizer's ids and more


def folder_tokenizer(folder: str | Path, vocab_size: int | None = None) -> Tokenizer:
    """A checkpoint folder's tokenizer: its ``tokenizer.json`` (Hugging Face), else the
    GGUF converter's, else a byte tokenizer, with a warning saying so."""
    folder = Path(folder)
    if (folder / "tokenizer.json").exists():
        return HFTokenizer.from_folder(folder)
    if (folder / "gguf_tokenizer.json").exists():
        return BPETokenizer(folder / "gguf_tokenizer.json")
    logging.getLogger("radixkv.engine").warning(
        "%s has no tokenizer.json: using a byte tokenizer (token ids are UTF-8 bytes), which "
        "is not this checkpoint's", folder
    )  # fmt: skip
    return ByteTokenizer(max(BYTE_VOCAB, vocab_size or BYTE_VOCAB))


def load_tokenizer(name: str | Path) -> Tokenizer:
    """The one place a tokenizer is named, for the engine, the router and the simulator,
    without loading weights: ``byte`` / ``random`` (UTF-8 bytes), ``smollm2``, ``auto``
    (SmolLM2 when it is installed, else bytes), a checkpoint folder, or a
    ``gguf_tokenizer.json`` the weight converter wrote.

    Raises:
        ModuleNotFoundError: ``smollm2`` asked for and not installed (the message says
            what to install). ValueError: none of those.
    """
    if name in ("byte", "random"):
        return ByteTokenizer(BYTE_VOCAB)
    if name in ("auto", "smollm2"):
        why_not = smollm2_missing()
        if why_not is None:
            return smollm2_tokenizer()
        if name == "smollm2":
            raise ModuleNotFoundError(why_not)
        return ByteTokenizer(BYTE_VOCAB)
    path = Path(name)
    if (path / "config.json").exists():
        return folder_tokenizer(path)
    if path.is_file():
        try:
            return BPETokenizer(path)
        except (ValueError, KeyError, OSError) as e:
            raise ValueError(f"{name}: not a gguf_tokenizer.json ({e})") from None
    raise ValueError(
        f"{name!r} is not byte, random, auto, smollm2, a checkpoint folder or a gguf_tokenizer.json"
    )
