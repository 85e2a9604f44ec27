"""Tokenizers: the checkpoint's own byte-level BPE (built with the ``tokenizers`` library
from the vocabulary and merges a GGUF carries, chat template included) and a byte
tokenizer for random models."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Protocol

Message = dict[str, str]


class Tokenizer(Protocol):
    eos_token_id: int | None
    # the most bytes of text one token covers: a text of n bytes has >= n / this tokens,
    # so a server refuses an overlong prompt before tokenizing it
    max_token_bytes: int

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def apply_chat_template(self, messages: list[Message]) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; 256 is BOS, 257 EOS. For random models."""

    bos_token_id = 256
    eos_token_id = 257
    max_token_bytes = 1

    def __init__(self, vocab_size: int = 384) -> None:
        if vocab_size < 258:
            raise ValueError("a byte tokenizer needs vocab_size >= 258")

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[Message]) -> list[int]:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return [self.bos_token_id, *self.encode(text)]


class BPETokenizer:
    """A GPT-2 style byte-level BPE built from a GGUF's ``tokenizer.ggml.*`` metadata
    (saved as ``gguf_tokenizer.json`` by the weight converter)."""

    def __init__(self, meta_path: str | Path) -> None:
        from tokenizers import AddedToken, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        raw = Path(meta_path).read_bytes()
        # what a shared store's model identity takes from the tokenizer (radixkv.storage)
        self.identity = b"bpe:" + hashlib.blake2b(raw, digest_size=16).digest()
        meta = json.loads(raw)
        tokens: list[str] = meta["tokens"]
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in meta["merges"]]
        tk = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
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
        self._tk = tk
        self.bos_token_id = meta.get("bos_token_id")
        self.eos_token_id = meta.get("eos_token_id")
        self._specials = {vocab[t] for t in control}
        self._template = meta.get("chat_template")
        self._tokens = tokens
        # byte-level tokens are one character a byte; special tokens are literal text
        self.max_token_bytes = max((len(t.encode()) for t in tokens), default=1)

    def encode(self, text: str) -> list[int]:
        return self._tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tk.decode([i for i in ids if i not in self._specials])

    def apply_chat_template(self, messages: list[Message]) -> list[int]:
        """Render the checkpoint's chat template (Jinja, as Hugging Face does) with a
        generation prompt, then tokenize."""
        if not self._template:
            return self.encode("".join(m["content"] for m in messages))
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg: str) -> None:
            raise ValueError(msg)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        text = env.from_string(self._template).render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=self._tokens[self.bos_token_id] if self.bos_token_id is not None else "",
            eos_token=self._tokens[self.eos_token_id] if self.eos_token_id is not None else "",
        )
        return self.encode(text)
