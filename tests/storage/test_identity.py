"""The model identity a shared store keys pages by (`radixkv.storage.identity`)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from support.models import middle_tensor, save_checkpoint

from radixkv.engine.models.llama import ModelConfig
from radixkv.engine.weights import load_hf_folder, random_model
from radixkv.storage.identity import CACHE_FILE, model_identity, weights_digest
from radixkv.tokenizer import ByteTokenizer


def ident(model, **kw):
    args = dict(dtype=torch.float32, page_size=4, tokenizer=ByteTokenizer())
    args.update(kw)
    return model_identity(model, args["dtype"], args["page_size"], args["tokenizer"])


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_one_weight_element_anywhere_changes_the_identity(where):
    model = random_model(ModelConfig(), seed=0)
    before = ident(model)
    name, t = middle_tensor(model)
    flat = t.view(-1)
    i = {"first": 0, "middle": flat.numel() // 2, "last": flat.numel() - 1}[where]
    with torch.no_grad():
        flat[i] += 1e-3  # a fine-tune's size of change, in one element
    assert ident(model) != before, f"{name}[{i}]"


def test_everything_that_shapes_a_page_is_in_the_identity():
    model = random_model(ModelConfig(), seed=0)
    base = ident(model)
    assert ident(model) == base  # deterministic
    assert ident(random_model(ModelConfig(), seed=0)) == base  # same weights, another object
    assert ident(random_model(ModelConfig(), seed=1)) != base
    assert ident(model, page_size=8) != base
    assert ident(model, dtype=torch.bfloat16) != base

    class OtherTokenizer(ByteTokenizer):
        identity = b"bpe:another vocabulary"

    assert ident(model, tokenizer=OtherTokenizer()) != base
    cfg = ModelConfig(rope_theta=20000.0)
    other_cfg = random_model(cfg, seed=0)  # the same weights, another RoPE base
    assert ident(other_cfg) != base


def test_the_weight_digest_is_cached_while_the_files_are_unchanged(tmp_path):
    save_checkpoint(random_model(ModelConfig(), seed=3), tmp_path / "ckpt")
    model = load_hf_folder(tmp_path / "ckpt")
    cache = tmp_path / "cache"

    def identity():
        return model_identity(model, torch.float32, 4, ByteTokenizer(), model.source_files, cache)

    first = identity()
    stored = json.loads((cache / CACHE_FILE).read_text())
    assert list(stored.values()) == [weights_digest(model).hex()]
    # unchanged files: the cached digest is used, not a new pass over the weights (shown
    # by planting another digest under the same key)
    key = next(iter(stored))
    (cache / CACHE_FILE).write_text(json.dumps({key: "ab" * 32}))
    assert identity() != first
    # a checkpoint file rewritten (new size or mtime): hashed again, the right identity
    f = tmp_path / "ckpt" / "model.safetensors"
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert identity() == first
    assert len(json.loads((cache / CACHE_FILE).read_text())) == 2
