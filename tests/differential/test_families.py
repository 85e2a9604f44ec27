"""Model families other than Llama, token for token with transformers' own modeling code
on tiny random checkpoints written by ``save_pretrained`` (no download): Qwen2 (q/k/v
biases, and sliding layers from ``max_window_layers``), Qwen3 (q/k norms), Mistral (a
sliding window on every layer). Prompts run well past the window, with the prefix cache
on, chunked prefill, pages 1 and 16; a request that reuses a cached prefix must still
agree with a fresh forward pass."""

from __future__ import annotations

import pytest
import torch
from support.models import folder, greedy

from radixkv.engine.engine import Engine

FAMILIES = [
    ("Qwen2ForCausalLM", {}),
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    ("Qwen3ForCausalLM", {"head_dim": 16}),
    ("Qwen3ForCausalLM", {"head_dim": 16, "use_sliding_window": True, "sliding_window": 20,
                          "layer_types": ["sliding_attention", "full_attention"]}),
    ("MistralForCausalLM", {"sliding_window": 24}),
    ("Gemma3ForCausalLM", {"head_dim": 16, "query_pre_attn_scalar": 12, "sliding_window": 16,
                           "layer_types": ["sliding_attention", "full_attention"]}),
    ("Gemma3ForCausalLM", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 12,
                           "layer_types": ["full_attention", "sliding_attention"],
                           "final_logit_softcapping": 3.0,
                           "rope_parameters": {
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                               "full_attention": {"rope_type": "linear", "rope_theta": 1e6,
                                                  "factor": 8.0}}}),
]  # fmt: skip


@pytest.mark.parametrize(("arch", "config"), FAMILIES, ids=lambda x: str(x)[:40])
@pytest.mark.parametrize("page", [1, 16])
def test_token_for_token_with_transformers(tmp_path, arch, config, page):
    import transformers

    path = folder(tmp_path / "ckpt", arch, **config)
    reference = getattr(transformers, arch).from_pretrained(path).eval()
    engine = Engine(str(path), page_size=page, chunk_size=32)
    assert engine.config.architecture == arch
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 384, (70,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 384, (k,), generator=g).tolist() for k in (5, 17, 40)]
    first = engine.generate(prompts[:1], max_new_tokens=12, chat=False, ignore_eos=True)
    rest = engine.generate(prompts[1:], max_new_tokens=12, chat=False, ignore_eos=True)
    assert rest.stats.cached_tokens > 0  # the later ones reused the first one's KV
    for prompt, out in zip(prompts, first.outputs + rest.outputs, strict=True):
        assert out.token_ids == greedy(reference, prompt, 12)


def test_a_window_changes_what_mistral_computes(tmp_path):
    """The sliding window is honored, not ignored: the same weights with and without it
    disagree past the window, and each agrees with transformers."""
    import json

    import transformers

    path = folder(tmp_path / "w", "MistralForCausalLM", sliding_window=8)
    ids = list(range(3, 80))
    windowed = Engine(str(path)).generate([ids], max_new_tokens=8, chat=False, ignore_eos=True)
    conf = json.loads((path / "config.json").read_text())
    conf["sliding_window"] = None
    (path / "config.json").write_text(json.dumps(conf))
    full = Engine(str(path)).generate([ids], max_new_tokens=8, chat=False, ignore_eos=True)
    assert windowed.outputs[0].token_ids != full.outputs[0].token_ids
    reference = transformers.MistralForCausalLM.from_pretrained(path).eval()
    assert full.outputs[0].token_ids == greedy(reference, ids, 8)


@pytest.mark.parametrize(
    ("arch", "config", "named"),
    [
        ("Qwen3ForCausalLM", {"attention_bias": True}, "attention_bias"),
        ("Qwen2ForCausalLM", {"hidden_act": "gelu"}, "hidden_act"),
        ("Gemma3ForCausalLM", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ("Gemma3ForCausalLM", {"final_logit_softcapping": 0.0}, "final_logit_softcapping"),
        ("Gemma3ForCausalLM", {"rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0}}}, "yarn"),
        ("Qwen3ForCausalLM", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0,
                                                  "rope_theta": 1e4}}, "yarn"),
    ],
)  # fmt: skip
def test_fields_a_family_does_not_implement_are_refused(tmp_path, arch, config, named):
    from radixkv.engine.models import UnsupportedModel

    path = folder(tmp_path / "ckpt", arch, **config)
    with pytest.raises(UnsupportedModel, match=named):
        Engine(str(path))


def test_the_model_identity_covers_the_layer_types(tmp_path):
    """Two checkpoints with the same weights and different windows must never share
    stored KV: the identity hashes the windows."""
    import json

    from radixkv.storage.identity import model_identity

    path = folder(tmp_path / "m", "MistralForCausalLM", sliding_window=8)
    a = Engine(str(path))
    conf = json.loads((path / "config.json").read_text())
    conf["sliding_window"] = 16
    (path / "config.json").write_text(json.dumps(conf))
    b = Engine(str(path))
    assert a.config.windows != b.config.windows
    ids = [model_identity(e.model, torch.float32, 1, e.tokenizer) for e in (a, b)]
    assert ids[0] != ids[1]


@pytest.mark.parametrize(("arch", "config"), FAMILIES, ids=lambda x: str(x)[:40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_equal_transformers(tmp_path, arch, config, dtype):
    """Every position's logits (not only the argmax: a final soft-cap keeps it), the
    prompt run as two chunks through the KV pool, the second reading the first's KV;
    in bfloat16 (weights and KV) to half precision of transformers' float32 ones."""
    import transformers

    from radixkv.engine.models.base import ForwardBatch
    from radixkv.engine.weights import load_hf_folder
    from radixkv.kvcache.memory import KVPool

    path = folder(tmp_path / "ckpt", arch, **config)
    reference = getattr(transformers, arch).from_pretrained(path).eval()
    ours = load_hf_folder(path, dtype)
    c = ours.config
    ids = torch.randint(3, 384, (90,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = reference(ids[None]).logits[0]
    pool = KVPool(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 128, dtype,
                  torch.device("cpu"))  # fmt: skip
    slots = torch.randperm(128)[:90]  # anywhere in the pool
    got = []
    for a, b in ((0, 37), (37, 90)):
        batch = ForwardBatch(ids[a:b], torch.arange(a, b), slots[a:b], [b - a], [slots[:b]])
        got.append(ours(batch, pool, all_logits=True))
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # logits ~0.13 std here: bf16 is off 0.003-0.012
    torch.testing.assert_close(torch.cat(got).float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [0, 5])
def test_decode_attention_in_one_batch_equals_each_sequence_alone(window):
    """One new token per sequence, the contexts of different lengths (one shorter than
    the window), and a prefill chunk among them: the padded single pass for the one-token
    steps (`_attend_decode`) and the chunk's own give each sequence what attending alone
    gives, grouped-query heads and a custom scale included."""
    from radixkv.engine.models.base import ForwardBatch, attend

    torch.manual_seed(0)
    pool_k, pool_v = torch.randn(200, 2, 8), torch.randn(200, 2, 8)

    def read(slots):
        return pool_k[slots], pool_v[slots]

    lens, new = [9, 3, 12, 10, 7], [1, 1, 1, 4, 1]  # a 4-token prefill chunk among them
    slots = [torch.randperm(200)[:n] for n in lens]
    q = torch.randn(sum(new), 4, 8)
    positions = torch.cat([torch.arange(s - n, s) for s, n in zip(lens, new, strict=True)])
    out_slots = torch.cat([s[-n:] for s, n in zip(slots, new, strict=True)])
    batch = ForwardBatch(torch.zeros(sum(new), dtype=torch.long), positions, out_slots, new,
                         slots, list(range(5)))  # fmt: skip
    together = attend(q, batch, read, window, scale=0.3)
    at = 0
    for i, n in enumerate(new):
        one = ForwardBatch(batch.input_ids[at : at + n], positions[at : at + n],
                           out_slots[at : at + n], [n], [slots[i]], [i])  # fmt: skip
        alone = attend(q[at : at + n], one, read, window, scale=0.3)
        torch.testing.assert_close(together[at : at + n], alone, atol=1e-6, rtol=1e-6)
        at += n
