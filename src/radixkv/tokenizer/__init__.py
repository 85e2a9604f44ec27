"""Tokenizers, apart from the engine: the engine, the router and the simulator all name
and load one here (`load_tokenizer`), so routing a fleet loads no engine.

Modules: ``tokenizers.py`` the interface, Hugging Face's and the byte tokenizer;
``gguf.py`` the BPE a GGUF carries (and SmolLM2's); ``template.py`` chat templates in a
bounded sandbox; ``load.py`` the names. It reads files through `radixkv.checkpoint`.

Owns: turning text into token ids and back. Must not touch: weights, the engine, torch.
"""

from radixkv.tokenizer.gguf import BPETokenizer, smollm2_tokenizer, write_hf_tokenizer
from radixkv.tokenizer.load import BYTE_VOCAB, folder_tokenizer, load_tokenizer
from radixkv.tokenizer.tokenizers import (
    ByteTokenizer,
    HFTokenizer,
    Message,
    NoToolTemplate,
    Tokenizer,
    Tool,
    special_token_id,
    supports_tools,
    tokenizer_fingerprint,
    tokenizer_identity,
    tokenizer_source,
)

__all__ = [
    "BYTE_VOCAB",
    "BPETokenizer",
    "ByteTokenizer",
    "HFTokenizer",
    "Message",
    "NoToolTemplate",
    "Tokenizer",
    "Tool",
    "folder_tokenizer",
    "load_tokenizer",
    "smollm2_tokenizer",
    "special_token_id",
    "supports_tools",
    "tokenizer_fingerprint",
    "tokenizer_identity",
    "tokenizer_source",
    "write_hf_tokenizer",
]
