"""Model folders for the tests: tiny random ones written by transformers'
``save_pretrained`` (`folder`), a Llama checkpoint written by hand (`hf_folder`,
`save_checkpoint`), the sliding-window families' configs (`GEMMA`, `MISTRAL`), greedy
decoding with transformers to compare against (`greedy`), and prompts."""

from __future__ import annotations

import json

import torch

from radixkv.engine.models.llama import ModelConfig
from radixkv.engine.weights import random_model


def folder(path, arch: str, **config):
    import transformers

    torch.manual_seed(0)
    name = arch.replace("ForCausalLM", "TextConfig" if arch.startswith("Gemma") else "Config")
    conf = getattr(transformers, name)(
        vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, **config,
    )  # fmt: skip
    model = getattr(transformers, arch)(conf)
    with torch.no_grad():  # random biases and norms, so a dropped one shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.5)
    model.save_pretrained(path)
    return path


def greedy(reference, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        mask = torch.ones(1, len(ids), dtype=torch.long)
        out = reference.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                 attention_mask=mask)  # fmt: skip
    return out[0, len(ids) :].tolist()


GEMMA = ("Gemma3ForCausalLM", {"head_dim": 16, "query_pre_attn_scalar": 12, "sliding_window": 10,
                               "layer_types": ["sliding_attention", "full_attention"]})  # fmt: skip


MISTRAL = ("MistralForCausalLM", {"sliding_window": 12})


def prompts(n=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    stems = [torch.randint(3, 384, (k,), generator=g).tolist() for k in (40, 70)]
    return [stems[i % 2] + torch.randint(3, 384, (5 + 7 * i,), generator=g).tolist()
            for i in range(n)]  # fmt: skip


def hf_folder(path):
    """A Llama checkpoint folder as Hugging Face writes one: config.json, safetensors, a
    byte-level BPE tokenizer.json (with a BOS post-processor) and tokenizer_config.json
    with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    corpus = ["the rivers of europe are long and the danube is one of them"] * 50
    tk.train_from_iterator(corpus, trainer)
    tk.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tk.token_to_id("<s>"))]
    )
    model = random_model(ModelConfig(vocab_size=tk.get_vocab_size()), seed=2)
    save_checkpoint(model, path)
    tk.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
        "eos_token": "</s>", "chat_template": TEMPLATE,
    }))  # fmt: skip
    return path


def middle_tensor(model) -> tuple[str, torch.Tensor]:
    """The middle one of the weights larger than 512 elements: its middle element lies
    beyond any sample of the first and last 256 (what the old fingerprint hashed)."""
    items = [(k, v) for k, v in model.state_dict().items() if v.numel() > 4 * 512]
    return items[len(items) // 2]


def save_checkpoint(model, folder):
    from safetensors.torch import save_file

    folder.mkdir()
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(model.config.to_dict()))


TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
