"""``--model PATH`` on an ordinary Hugging Face checkpoint folder: its own tokenizer.json
and chat template, read as ``transformers`` reads them; and the converted SmolLM2 folder
readable by ``transformers.AutoTokenizer`` (what aiperf and guidellm load)."""

from __future__ import annotations

import json
import logging

import pytest
from support.models import hf_folder, save_checkpoint

from radixkv.engine.engine import Engine
from radixkv.engine.models.llama import ModelConfig
from radixkv.engine.weights import random_model
from radixkv.tokenizer import HFTokenizer
from radixkv.web.process import ServerProcess

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three rivers of Europe, 1234 km long?"},
]


def reference_chat_ids(reference, messages) -> list[int]:
    """``transformers``' own rendering and tokenizing of the chat template."""
    out = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_a_hugging_face_folder_brings_its_own_tokenizer_and_template(tmp_path):
    from transformers import AutoTokenizer

    folder = hf_folder(tmp_path / "ckpt")
    engine = Engine(str(folder))
    assert isinstance(engine.tokenizer, HFTokenizer)
    reference = AutoTokenizer.from_pretrained(str(folder))
    text = "the danube is long, 2850 km"
    assert engine.encode(text, chat=False) == reference.encode(text)  # BOS included
    assert engine.encode(MESSAGES) == reference_chat_ids(reference, MESSAGES)
    assert engine.tokenizer.eos_token_id == reference.eos_token_id


def test_serve_a_hugging_face_folder(tmp_path):
    from openai import OpenAI
    from transformers import AutoTokenizer

    folder = hf_folder(tmp_path / "ckpt")
    with ServerProcess("--model", str(folder), "--page-size", "4", timeout=60) as srv:
        client = OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(model="ckpt", messages=MESSAGES, max_tokens=2)
    want = reference_chat_ids(AutoTokenizer.from_pretrained(str(folder)), MESSAGES)
    assert r.usage.prompt_tokens == len(want)


def test_a_folder_without_a_tokenizer_says_so(tmp_path, caplog):
    save_checkpoint(random_model(ModelConfig(), seed=0), tmp_path / "bare")
    with caplog.at_level(logging.WARNING, logger="radixkv.engine"):
        Engine(str(tmp_path / "bare"))
    assert "no tokenizer.json" in caplog.text


def test_the_converted_smollm2_folder_loads_in_transformers():
    from radixkv.checkpoint.sources import smollm2_missing
    from radixkv.engine.weights import smollm2_folder

    if smollm2_missing() is not None:
        pytest.skip(smollm2_missing())
    from transformers import AutoTokenizer

    folder = smollm2_folder()
    reference = AutoTokenizer.from_pretrained(str(folder))
    engine_tok = HFTokenizer.from_folder(folder)
    text = "What is the capital of France? 12345"
    assert engine_tok.encode(text) == reference.encode(text)
    assert engine_tok.apply_chat_template(MESSAGES) == reference_chat_ids(reference, MESSAGES)


def test_smollm2s_tokenizer_is_read_from_its_gguf_alone_and_is_the_converted_ones(
    tmp_path, monkeypatch
):
    """A router names ``smollm2`` without converting its weights: the tokenizer comes
    straight from the GGUF, byte for byte the converted checkpoint's (same fingerprint),
    and no checkpoint folder is written for it."""
    from radixkv.checkpoint.sources import SMOLLM2, smollm2_missing
    from radixkv.engine.weights import smollm2_folder
    from radixkv.tokenizer import BPETokenizer, load_tokenizer, tokenizer_fingerprint

    if smollm2_missing() is not None:
        pytest.skip(smollm2_missing())
    converted = BPETokenizer(smollm2_folder() / "gguf_tokenizer.json")  # the real cache
    monkeypatch.setenv("RADIXKV_CACHE", str(tmp_path))
    tok = load_tokenizer("smollm2")
    assert tok.source == "smollm2"
    assert tokenizer_fingerprint(tok) == tokenizer_fingerprint(converted)
    text = "What is the capital of France? 12345"
    assert tok.encode(text) == converted.encode(text)
    assert not (tmp_path / SMOLLM2).exists()  # no weights converted for it


def test_the_gguf_converters_tokenizer_is_saved_for_transformers(tmp_path):
    """What the SmolLM2 conversion writes (tokenizer.json, tokenizer_config.json), from a
    GGUF-style vocabulary: transformers' AutoTokenizer encodes and templates it as
    radixkv's own tokenizer does."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    from radixkv.tokenizer import BPETokenizer, write_hf_tokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["t h", "th e", "Ġ th", "Ġth e"]
    tokens = [*alphabet, "th", "the", "Ġth", "Ġthe", "<|im_start|>", "<|im_end|>"]
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                "{% endif %}")  # fmt: skip
    meta = {"tokens": tokens, "merges": merges, "token_type": [1] * (len(tokens) - 2) + [3, 3],
            "pre": "smollm", "bos_token_id": len(tokens) - 2, "eos_token_id": len(tokens) - 1,
            "chat_template": template}  # fmt: skip
    (tmp_path / "gguf_tokenizer.json").write_text(json.dumps(meta))
    write_hf_tokenizer(tmp_path, 2048)
    ours = BPETokenizer(tmp_path / "gguf_tokenizer.json")
    reference = AutoTokenizer.from_pretrained(str(tmp_path))
    text = "the theme of the 42 thetas"
    assert reference.encode(text, add_special_tokens=False) == ours.encode(text)
    assert reference_chat_ids(reference, MESSAGES) == ours.apply_chat_template(MESSAGES)
    assert reference.model_max_length == 2048


def test_long_start_up_steps_say_what_they_do(tmp_path, monkeypatch):
    """The CLI shows start-up progress: hashing a checkpoint's weights for the model
    identity prints a line (it used to be silent), which says what the identity is for:
    a server without --storage computes it too (its card shows it to routers)."""

    save_checkpoint(random_model(ModelConfig(), seed=4), tmp_path / "ckpt")
    monkeypatch.setenv("RADIXKV_CACHE", str(tmp_path / "cache"))
    args = ["--model", str(tmp_path / "ckpt"), "--storage", "memory://"]
    with ServerProcess(*args, timeout=60) as srv:
        pass
    assert "radixkv: hashing every weight" in srv.stderr()


def _transformers_folder(path, cls_name: str, **config):
    """A folder written by transformers' own ``save_pretrained`` (tiny, random)."""
    import torch
    import transformers

    torch.manual_seed(0)
    conf = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))(
        vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, **config,
    )  # fmt: skip
    getattr(transformers, cls_name)(conf).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    ("arch", "config", "named"),
    [
        ("Qwen3MoeForCausalLM", {}, "Qwen3MoeForCausalLM"),
        ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "linear"),
        ("LlamaForCausalLM", {"attention_bias": True}, "attention_bias"),
        ("LlamaForCausalLM", {"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_an_architecture_or_config_field_radixkv_does_not_run_is_refused(
    tmp_path, capsys, arch, config, named
):
    """An architecture radixkv does not run is refused naming it (a Mistral folder with a
    sliding window used to load as Llama and attend past its window; Mistral runs now,
    tests/differential/test_families.py); a Llama with a field radixkv does not implement (scaled
    RoPE, biases, another activation) computed something else."""
    from radixkv.cli import main
    from radixkv.engine.models import UnsupportedModel

    folder = _transformers_folder(tmp_path / "ckpt", arch, **config)
    with pytest.raises(UnsupportedModel, match=named):
        Engine(str(folder))
    capsys.readouterr()  # (transformers' own progress bars)
    assert main(["serve", "--model", str(folder), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --model {folder}") and named in err[0]


def test_a_llama_folder_written_by_transformers_runs_its_rope_base(tmp_path):
    """transformers 5 writes the RoPE base under rope_parameters: read, not defaulted."""
    import torch
    from transformers import LlamaForCausalLM

    folder = _transformers_folder(tmp_path / "ckpt", "LlamaForCausalLM",
                                  rope_parameters={"rope_type": "default",
                                                   "rope_theta": 500.0})  # fmt: skip
    engine = Engine(str(folder))
    assert engine.config.rope_theta == 500.0
    reference = LlamaForCausalLM.from_pretrained(folder).eval()
    ids = list(range(3, 40))
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits[0, -1].argmax().item()
    assert engine.generate([ids], max_new_tokens=1, chat=False).outputs[0].token_ids == [want]
