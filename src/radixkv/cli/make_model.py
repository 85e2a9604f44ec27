"""``radixkv make-model``: a tiny random checkpoint folder of any family radixkv serves,
written by transformers' own ``save_pretrained``, with a byte-level tokenizer and a
ChatML chat template, so a hybrid model (or any other) can be tried in seconds with no
download: ``radixkv make-model qwen3.5 /tmp/q && radixkv serve --model /tmp/q``.

The weights are random (the text is gibberish): the folder exercises everything a real
one does (the architecture's layers, the cache's components, the chat template), which
is what it is for.

Owns: the subcommand. Must not touch: loading (the engine reads the folder as any other).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from radixkv.cli.common import CliError, number

HELP = "write a tiny random model folder of a family radixkv serves (no download)"
SIZES = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=8192)  # fmt: skip
# family -> (transformers' model class, its config class, what differs from SIZES)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", {"num_hidden_layers": 2}),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {"num_hidden_layers": 2}),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {"num_hidden_layers": 2}),
    "mistral": ("MistralForCausalLM", "MistralConfig",
                {"num_hidden_layers": 2, "sliding_window": 64}),
    # 5 sliding (window 64) : 1 global, Gemma 3's pattern
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig",
               {"num_hidden_layers": 6, "sliding_window": 64, "query_pre_attn_scalar": 16,
                "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}),
    # 3 Gated DeltaNet : 1 gated attention, Qwen3.5's pattern
    "qwen3.5": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig",
                {"num_hidden_layers": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                 "linear_num_key_heads": 2, "linear_num_value_heads": 4}),
}  # fmt: skip
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, and tools as Qwen's templates render them (Hermes-style: the tools as JSON in
# the system turn, a call as <tool_call> JSON, a result as <tool_response> in a user
# turn); without tools it renders exactly as plain ChatML does
CHATML = (
    "{%- if tools %}<|im_start|>system\n{% if messages and messages[0].role == 'system' %}"
    "{{ messages[0].content }}\n\n{% endif %}# Tools\n\nYou may call one or more functions "
    "to assist with the user query.\n\nYou are provided with function signatures within "
    "<tools></tools> XML tags:\n<tools>{% for t in tools %}{{ '\\n' }}{{ t | tojson }}"
    "{% endfor %}{{ '\\n' }}</tools>\n\nFor each function call, return a json object with "
    "function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' and loop.first and tools %}"
    "{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% if m.content %}{{ m.content }}\n{% endif %}"
    "{% for c in m.tool_calls %}{% if not loop.first %}{{ '\\n' }}{% endif %}<tool_call>\n"
    "{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{% if c.function.arguments is string %}{{ c.function.arguments }}"
    "{% else %}{{ c.function.arguments | tojson }}{% endif %}}\n</tool_call>{% endfor %}"
    "<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "make-model", parents=[common], help=HELP,
        description="Write a tiny random checkpoint folder (config.json, model.safetensors, "
        "tokenizer.json, tokenizer_config.json with a ChatML template) of a family radixkv "
        "serves, with transformers' own save_pretrained. Needs transformers and tokenizers "
        "(the dev extra).",
    )  # fmt: skip
    p.add_argument("family", choices=list(FAMILIES), help="the architecture")
    p.add_argument("folder", help="where to write it (must not exist, or be empty; one "
                   "this command wrote with the same family and seed is left as it is)")
    p.add_argument("--seed", type=number(int, 0, "a non-negative integer"), default=0)
    p.add_argument("--context", type=number(int, 64, "tokens >= 64", 1 << 20), default=8192,
                   metavar="TOKENS",
                   help="the longest prompt + output the model is made for "
                   "(max_position_embeddings); serve it with --max-context-len TOKENS, e.g. "
                   "65536 for an agent's prompt [8192]")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    folder = Path(args.folder)
    if folder.is_symlink() and not folder.exists():
        raise CliError(f"folder: {folder} is a link to nothing ({os.readlink(folder)})")
    context = args.context
    made = {"family": args.family, "seed": args.seed, "context": context}
    if _made_here(folder) == made:  # the same command ran before: the folder is as it
        print(f"{folder} already holds a tiny random {args.family} (seed {args.seed}); "
              f"serve it with: {_serve_hint(folder, context)}")  # fmt: skip
        return 0
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise CliError(f"folder: {folder} exists and is not an empty folder")
    try:  # first: a path that cannot be a folder (under a file, unwritable) says so now
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CliError(f"folder: cannot create {folder}: {e.strerror or e}") from None
    print(f"writing a tiny random {args.family} to {folder} (transformers' save_pretrained)...",
          flush=True)  # fmt: skip
    try:
        import torch
        import transformers
    except ModuleNotFoundError as e:
        raise CliError(f"needs {e.name} (the dev extra): pip install 'radixkv[dev]'") from None
    model_cls, config_cls, own = FAMILIES[args.family]
    torch.manual_seed(args.seed)
    ids = {"bos_token_id": 256 + SPECIALS.index("<|endoftext|>"),
           "eos_token_id": 256 + SPECIALS.index("<|im_end|>")}  # fmt: skip
    sizes = {**SIZES, "max_position_embeddings": context}
    config = getattr(transformers, config_cls)(**sizes, **own, **ids, tie_word_embeddings=False)
    model = getattr(transformers, model_cls)(config)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    (folder / STAMP).write_text(json.dumps(made))  # last: a folder half written has none
    print(f"wrote a tiny random {args.family} ({model_cls}, {config.num_hidden_layers} layers) "
          f"to {folder}; serve it with: {_serve_hint(folder, context)}")  # fmt: skip
    return 0


def _serve_hint(folder: Path, context: int) -> str:
    longer = f" --max-context-len {context}" if context > 4096 else ""  # (serve's default)
    return f"radixkv serve --model {folder}{longer}"


STAMP = "radixkv-make-model.json"  # what make-model wrote here: running it again is a no-op


def _made_here(folder: Path) -> dict | None:
    """The family and seed make-model wrote ``folder`` with (None: it did not)."""
    try:
        with open(folder / STAMP, encoding="utf-8") as f:
            made = json.loads(f.read(4096))
    except (OSError, ValueError):
        return None
    return made if isinstance(made, dict) else None


def write_tokenizer(folder: Path) -> None:
    """A byte-level BPE with no merges (every UTF-8 byte a token, ids 0-255) and the
    ChatML specials after them, as ``tokenizer.json``; the template and the specials in
    ``tokenizer_config.json``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    byte_order = sorted(alphabet, key=lambda c: _byte_of(c))
    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(byte_order)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tk.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML,
        "bos_token": None, "eos_token": "<|im_end|>", "clean_up_tokenization_spaces": False,
    }  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _byte_of(char: str) -> int:
    """The byte GPT-2's byte-level alphabet maps to ``char``."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    if ord(char) in printable:
        return ord(char)
    others = [b for b in range(256) if b not in printable]
    return others[ord(char) - 256]
