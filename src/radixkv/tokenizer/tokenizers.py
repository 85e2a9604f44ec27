"""The tokenizer interface and two tokenizers: a Hugging Face checkpoint's own
(``tokenizer.json`` and the chat template of ``tokenizer_config.json``, through the
``tokenizers`` library) and a byte tokenizer for random models.

Owns: `Tokenizer`, `HFTokenizer`, `ByteTokenizer`, and a tokenizer's fingerprint and
source. Must not touch: weights (it loads none), GGUF files (`radixkv.tokenizer.gguf`)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Protocol

Message = dict[str, Any]  # a chat message: role, content, and tool calls or a call's id
Tool = dict[str, Any]  # a tool as templates take it: {"type": "function", "function": {...}}
TOKENIZER_CONFIG_BYTES = 16 << 20  # tokenizer_config.json: its chat template and tokens


class Tokenizer(Protocol):
    eos_token_id: int | None
    # the most characters of text one token covers: a text of n characters has at least
    # n / this tokens, so a server refuses an overlong prompt before tokenizing it
    max_token_chars: int

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def apply_chat_template(
        self, messages: list[Message], tools: list[Tool] | None = None
    ) -> list[int]: ...


class NoToolTemplate(ValueError):
    """The chat template cannot render tools (the server refuses ``tools`` naming it)."""


def supports_tools(tokenizer: Any) -> bool:
    """Whether ``tokenizer``'s chat template renders tools (it reads ``tools``)."""
    return bool(getattr(tokenizer, "supports_tools", False))


def special_token_id(tokenizer: Any, text: str) -> int | None:
    """The id of the single token ``text`` is (a special marker such as ``[TOOL_CALLS]``),
    or None."""
    find = getattr(tokenizer, "token_id", None)
    return find(text) if find is not None else None


def tokenizer_identity(tokenizer: Any) -> bytes:
    """Bytes naming a tokenizer exactly: its own ``identity`` when it has one (a digest
    of its vocabulary, merges and template), else its class name."""
    ident = getattr(tokenizer, "identity", None)
    if isinstance(ident, bytes):
        return ident
    return type(tokenizer).__qualname__.encode()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """`tokenizer_identity` as 16 hex digits: what a server shows in ``/v1/models`` and
    a router compares, so a router never routes with another tokenizer than its
    workers'."""
    return hashlib.blake2b(tokenizer_identity(tokenizer), digest_size=8).hexdigest()


def tokenizer_source(tokenizer: Any) -> str | None:
    """What `load_tokenizer` takes to build ``tokenizer`` again (``byte``, ``smollm2``,
    a checkpoint folder or a ``gguf_tokenizer.json``, as an absolute path), or ``None``
    for one built otherwise. A server shows it in ``/v1/models``, so a router started
    without ``--model`` tokenizes as its workers do."""
    source = getattr(tokenizer, "source", None)
    return source if isinstance(source, str) else None


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; 256 is BOS, 257 EOS. For random models."""

    bos_token_id = 256
    eos_token_id = 257
    max_token_chars = 1
    source = "byte"  # every byte tokenizer splits alike, whatever its vocabulary

    def __init__(self, vocab_size: int = 384) -> None:
        if vocab_size < 258:
            raise ValueError("a byte tokenizer needs vocab_size >= 258")

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    supports_tools = False
    chat_template = None

    def apply_chat_template(
        self, messages: list[Message], tools: list[Tool] | None = None
    ) -> list[int]:
        if tools:
            raise NoToolTemplate("this model's chat template does not render tools")
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return [self.bos_token_id, *self.encode(text)]


class HFTokenizer:
    """A Hugging Face tokenizer: a `tokenizers.Tokenizer` (what ``tokenizer.json`` holds)
    and a chat template rendered as ``transformers`` renders it (Jinja in a sandbox,
    ``add_generation_prompt``, the template's text tokenized without added specials).

    Args:
        tk: the tokenizer.
        template: the Jinja chat template (``None``: prompts are concatenated).
        bos, eos: the special tokens' text (``None``: none).
        identity: bytes naming it exactly (a shared store's model identity takes them).
        add_special_tokens: whether plain prompts get the tokenizer's own specials (a
            BOS, for Llama tokenizers), as ``transformers`` and vLLM encode them.
    """

    def __init__(
        self,
        tk: Any,
        template: str | None,
        bos: str | None,
        eos: str | None,
        identity: bytes,
        add_special_tokens: bool = True,
    ) -> None:
        self._tk, self._template, self._bos, self._eos = tk, template, bos, eos
        self.identity = identity
        self.source: str | None = None  # what load_tokenizer takes (set by the builders)
        self._add_special = add_special_tokens
        self.bos_token_id = tk.token_to_id(bos) if bos else None
        self.eos_token_id = tk.token_to_id(eos) if eos else None
        vocab = tk.get_vocab(with_added_tokens=True)
        # a template that reads `tools` renders them (Qwen, Llama 3, Mistral's do; a
        # plain ChatML one does not, and would drop them silently)
        self.supports_tools = bool(template) and re.search(r"\btools\b", template) is not None
        # a token covers at most its own string's characters of text (byte-level tokens
        # are a character a byte; SentencePiece's a character a character, or more)
        self.max_token_chars = max((len(t) for t in vocab), default=1)

    @classmethod
    def from_folder(cls, folder: str | Path) -> HFTokenizer:
        """``tokenizer.json`` and ``tokenizer_config.json`` (chat template, BOS/EOS) of a
        Hugging Face checkpoint folder.

        Raises:
            FileNotFoundError: no ``tokenizer.json`` there.
        """
        from tokenizers import Tokenizer as TkTokenizer

        from radixkv.checkpoint.files import (
            TOKENIZER_BYTES,
            FolderError,
            parse_json,
            read_bytes,
        )

        folder = Path(folder)
        path = folder / "tokenizer.json"
        raw = read_bytes(path, TOKENIZER_BYTES)
        cfg_path = folder / "tokenizer_config.json"
        cfg_raw = read_bytes(cfg_path, TOKENIZER_CONFIG_BYTES) if cfg_path.exists() else b"{}"
        cfg = parse_json(cfg_raw, cfg_path)
        try:
            tk = TkTokenizer.from_str(raw.decode())
        except Exception as e:  # the tokenizers library's own error type, or a decode
            raise FolderError(f"{path}: not a tokenizer the tokenizers library reads "
                              f"({str(e)[:200]})") from None  # fmt: skip

        def text(tok: Any) -> str | None:
            return tok.get("content") if isinstance(tok, dict) else tok

        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            named = [t for t in template if isinstance(t, dict) and t.get("name") == "default"]
            template = named[0].get("template") if named else None
        if template is not None and not isinstance(template, str):
            raise FolderError(f"{cfg_path}: chat_template must be a string")
        bos, eos = text(cfg.get("bos_token")), text(cfg.get("eos_token"))
        for name, tok in (("bos_token", bos), ("eos_token", eos)):
            if tok is not None and not isinstance(tok, str):
                raise FolderError(f"{cfg_path}: {name} must be a string")
        ident = hashlib.blake2b(raw + b"\0" + cfg_raw, digest_size=16).digest()
        tok = cls(tk, template, bos, eos, b"hf:" + ident)
        tok.source = str(folder.resolve())
        return tok

    def encode(self, text: str) -> list[int]:
        return self._tk.encode(text, add_special_tokens=self._add_special).ids

    def decode(self, ids: list[int]) -> str:
        return self._tk.decode(ids, skip_special_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return self._template

    def encode_plain(self, text: str) -> list[int]:
        """``text``'s ids without the tokenizer's own specials (a BOS): a piece of a
        prompt."""
        return self._tk.encode(text, add_special_tokens=False).ids

    def token_id(self, text: str) -> int | None:
        """The id of the token whose text is ``text`` (None: no such single token)."""
        return self._tk.token_to_id(text)

    def apply_chat_template(
        self, messages: list[Message], tools: list[Tool] | None = None
    ) -> list[int]:
        """Render the checkpoint's chat template (Jinja, as Hugging Face does, in a
        sandbox with bounded work and output: `radixkv.tokenizer.template`) with a
        generation prompt, then tokenize.

        Raises:
            ValueError: the template refused the conversation or failed;
                TemplateLimit (a ValueError) when it went beyond its bounds.
        """
        if tools and not self.supports_tools:
            raise NoToolTemplate("this model's chat template does not render tools")
        if not self._template:
            return self.encode("".join(m["content"] or "" for m in messages))
        from radixkv.tokenizer.template import output_limit, render

        extra = {"tools": tools} if tools else {}
        text = render(
            self._template,
            output_limit(messages, tools),
            messages=messages,
            **extra,
            add_generation_prompt=True,
            bos_token=self._bos or "",
            eos_token=self._eos or "",
        )
        return self._tk.encode(text, add_special_tokens=False).ids

    def save(self, folder: str | Path, model_max_length: int | None = None) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template)
        so ``transformers.AutoTokenizer.from_pretrained(folder)`` and load tools read it."""
        folder = Path(folder)
        self._tk.save(str(folder / "tokenizer.json"))
        cfg: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self._bos,
            "eos_token": self._eos,
            "chat_template": self._template,
            "clean_up_tokenization_spaces": False,
        }
        if model_max_length:
            cfg["model_max_length"] = model_max_length
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
