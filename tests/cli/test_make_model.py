"""``radixkv make-model``: a tiny random folder of every family radixkv serves, with its
tokenizer and chat template, that the engine loads and caches (a newcomer had to write
one with save_pretrained and borrow SmolLM2's tokenizer to try a hybrid model)."""

from __future__ import annotations

import openai
import pytest

from radixkv.cli import main
from radixkv.cli.make_model import FAMILIES
from radixkv.engine.engine import Engine
from radixkv.web.process import ServerProcess

SYSTEM = {"role": "system", "content": "You answer in one short sentence. " * 4}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_is_written_loaded_and_cached(tmp_path, family, capsys):
    folder = tmp_path / family
    assert main(["make-model", family, str(folder)]) == 0
    assert f"serve it with: radixkv serve --model {folder}" in capsys.readouterr().out
    engine = Engine(str(folder), kv_tokens=4096, page_size=16)
    chats = [[SYSTEM, {"role": "user", "content": q}] for q in ("a colour?", "a fruit?")]
    res = engine.generate(chats, max_new_tokens=4)
    assert res.outputs[0].cached_tokens == 0 and res.outputs[1].cached_tokens >= 128


def test_the_folder_serves_chat_through_the_openai_client(tmp_path):
    folder = tmp_path / "q"
    assert main(["make-model", "qwen3.5", str(folder)]) == 0
    with ServerProcess("--model", str(folder), "--served-model-name", "q", timeout=120) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        usage = [
            client.chat.completions.create(
                model="q", messages=[SYSTEM, {"role": "user", "content": q}], max_tokens=4
            ).usage
            for q in ("a colour?", "a fruit?")
        ]
    assert usage[1].prompt_tokens_details.cached_tokens >= 128


def test_a_folder_in_use_is_refused(tmp_path, capsys):
    (tmp_path / "x").write_text("mine")
    assert main(["make-model", "llama", str(tmp_path)]) == 2
    assert "is not an empty folder" in capsys.readouterr().err


def test_the_same_command_again_leaves_its_folder_and_another_is_refused(tmp_path, capsys):
    """A README block runs twice: make-model on the folder it wrote, with the same family
    and seed, changes nothing and exits 0; another family or seed there is refused."""
    folder = tmp_path / "m"
    assert main(["make-model", "llama", str(folder)]) == 0
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    assert main(["make-model", "llama", str(folder)]) == 0
    assert "already holds a tiny random llama (seed 0)" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before
    for other in (["qwen2", str(folder)], ["llama", str(folder), "--seed", "1"]):
        assert main(["make-model", *other]) == 2
        assert "is not an empty folder" in capsys.readouterr().err


def test_a_context_long_enough_for_an_agent(tmp_path, capsys):
    """--context sets max_position_embeddings (an agent's prompt is 20k-900k tokens) and
    says how to serve it; the same folder with another context is refused."""
    import json

    folder = tmp_path / "long"
    assert main(["make-model", "qwen3", str(folder), "--context", "65536"]) == 0
    assert json.loads((folder / "config.json").read_text())["max_position_embeddings"] == 65536
    assert f"radixkv serve --model {folder} --max-context-len 65536" in capsys.readouterr().out
    assert main(["make-model", "qwen3", str(folder)]) == 2  # 8192: not what is there
    with pytest.raises(SystemExit) as refused:  # argparse's own refusal
        main(["make-model", "qwen3", str(tmp_path / "x"), "--context", "16"])
    assert refused.value.code == 2
    assert "--context: must be tokens >= 64" in capsys.readouterr().err
