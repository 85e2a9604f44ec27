"""Each family declares one spec per layer type (`radixkv.kvcache.spec`), and the bytes a
spec names are the bytes the engine allocates: the KV pool's per token, full and
sliding, and a recurrent model's state row."""

from __future__ import annotations

import pytest
import torch

import radixkv
from radixkv.engine.engine import Engine
from radixkv.engine.models import config_from_dict, family
from radixkv.kvcache.spec import LayerSpecs, RecurrentSpec

CONFIGS = {
    "llama": {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 3},
    "mistral": {"architectures": ["MistralForCausalLM"], "num_hidden_layers": 2,
                "sliding_window": 24},
    "qwen2-window": {"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 3,
                     "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 6, "head_dim": 16,
               "sliding_window": 16},
    "qwen3.5": {"architectures": ["Qwen3_5ForCausalLM"], "num_hidden_layers": 8},
}  # fmt: skip
# per config: (full layers, sliding layers, window, recurrent layers)
EXPECTED = {
    "llama": ((0, 1, 2), (), 0, 0),
    "mistral": ((), (0, 1), 24, 0),
    "qwen2-window": ((0,), (1, 2), 8, 0),
    "gemma3": ((5,), (0, 1, 2, 3, 4), 16, 0),
    "qwen3.5": ((0, 1), (), 0, 6),  # every 4th layer full attention: two, pool places 0, 1
}


@pytest.mark.parametrize("name", CONFIGS)
def test_each_family_declares_its_layer_types(name):
    specs = config_from_dict(CONFIGS[name]).layer_specs()
    full, sliding, window, recurrent = EXPECTED[name]
    assert (specs.full.layers if specs.full else ()) == full
    assert (specs.window.layers if specs.window else ()) == sliding
    assert (specs.window.window if specs.window else 0) == window
    assert (specs.recurrent.layers if specs.recurrent else 0) == recurrent
    assert specs.kv_layers == len(full) + len(sliding)


@pytest.mark.parametrize("name", ["llama", "qwen2-window", "gemma3", "qwen3.5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_specs_bytes_are_what_the_engine_allocates(name, dtype):
    cfg = config_from_dict(CONFIGS[name])
    specs = cfg.layer_specs()
    engine = Engine(family(cfg.architecture).MODEL_CLASS(cfg), dtype=dtype, kv_tokens=256,
                    max_context_len=128, max_running=2, chunk_size=32)  # fmt: skip
    kv = engine.kv
    if specs.window is not None and specs.window.window < 128:  # apart, in its own pool
        assert kv.window_layers == specs.window.layers
        assert kv.window_bytes_per_token() == specs.window.token_bytes(dtype)
    assert kv.bytes_per_token() == specs.full.token_bytes(dtype)
    assert kv.num_layers == specs.kv_layers
    if specs.recurrent is not None:
        states = engine.model.states
        row = sum(t[:, 0].numel() * t.element_size() for t in (states.conv, states.ssm))
        assert engine.recurrent.row_size == row == specs.recurrent.state_bytes
    else:
        assert engine.recurrent is None


def test_a_window_as_long_as_every_request_is_full_attention():
    specs = LayerSpecs.attention((0, 64), kv_heads=2, head_dim=8)
    assert specs.window_limited(64) is None and specs.window_limited(65) == specs.window
    state = RecurrentSpec(3, ((4, 2), (2, 2, 2)), torch.float32)
    assert state.layer_bytes == (8 + 8) * 4 and state.state_bytes == 3 * 64


def test_the_cache_runtimes_names_work_from_radixkv_itself():
    from radixkv import kvcache

    for name in kvcache.__all__:
        assert getattr(radixkv, name) is getattr(kvcache, name), name
