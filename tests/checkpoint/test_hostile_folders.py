"""A hostile or broken model folder is refused before anything is allocated: one line
``error: --model ...`` naming the file and the field, exit 2, the process's memory
peaking far below what the folder asked for (real ``radixkv serve`` processes, each
reporting its peak resident memory, the kernel's ``VmHWM``, on exit).

What used to happen: a 1.3 KB edit of ``config.json`` over a 2-layer checkpoint reached
3.25 GB before ``size mismatch``; ``num_hidden_layers: 100000`` was still building at
1.9 GB after 60 s; ``config.json`` symlinked to ``/dev/zero`` was read until MemoryError
(7.7 GB); a FIFO hung start-up without a word."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import qwen3_5_folder

from radixkv.engine.models.llama import ModelConfig
from radixkv.engine.weights import random_model
from radixkv.web.process import free_port

PEAK_BYTES = 1 << 30  # the bound: hostile folders are refused under 1 GB


def checkpoint(folder, **config) -> str:
    """Our tiny random Llama (2 layers) saved as a folder, its config edited after."""
    from safetensors.torch import save_file

    model = random_model(ModelConfig(num_hidden_layers=2), seed=1)
    folder.mkdir()
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({**model.config.to_dict(), **config}))
    return str(folder)


def serve(*args: str) -> tuple[int, str, int]:
    """``radixkv serve ARGS`` in a child process: (exit status, stderr, its peak resident
    memory in bytes, which it reports itself on exit: `report_peak`). Bounded in time
    (a hang fails the test)."""
    cmd = [sys.executable, "-m", "radixkv.cli", "serve", "--port", str(free_port()), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"{args}: still running after 180 s")
    return proc.returncode, err, _peak(err)


def _peak(err: str) -> int:
    for line in err.splitlines():
        if line.startswith("radixkv-test-peak-rss:"):
            return int(line.split(":")[1])
    return 0


@pytest.fixture(autouse=True)
def report_peak(monkeypatch):
    """The child prints its own peak resident memory on exit (``VmHWM``), through a
    ``sitecustomize`` on its path: the kernel's accounting of the whole process."""
    import tempfile

    site = tempfile.mkdtemp()
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(
            "import atexit, sys\n"
            "def _peak():\n"
            "    for line in open('/proc/self/status'):\n"
            "        if line.startswith('VmHWM:'):\n"
            "            kb = int(line.split()[1])\n"
            "            sys.stderr.write(f'radixkv-test-peak-rss:{kb * 1024}\\n')\n"
            "atexit.register(_peak)\n"
        )
    monkeypatch.setenv("PYTHONPATH", site + os.pathsep + os.environ.get("PYTHONPATH", ""))


def refused(args: list[str], named: str) -> None:
    status, err, peak = serve(*args)
    skip = ("radixkv-test-peak", "radixkv: ")  # the peak, start-up progress
    lines = [x for x in err.splitlines() if not x.startswith(skip) and "no tokenizer" not in x]
    assert status == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert named in lines[0], lines[0]
    assert 0 < peak < PEAK_BYTES, f"peaked at {peak / 2**20:.0f} MiB"


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        ({"intermediate_size": 1 << 20}, "mlp"),  # 3.25 GB before the size mismatch
        ({"num_hidden_layers": 100000}, "num_hidden_layers"),  # 1.9 GB and building, at 60 s
        ({"hidden_size": 1 << 20, "head_dim": 64}, "embed_tokens"),  # 5.4 GB
        ({"vocab_size": 2_000_000_000}, "embed_tokens"),
        ({"hidden_size": "64"}, "hidden_size"),  # a TypeError with a traceback, exit 1
        ({"rms_norm_eps": 1e400}, "rms_norm_eps"),  # JSON's Infinity
    ],
    ids=["intermediate", "layers", "hidden", "vocab", "type", "infinite"],
)
def test_a_config_that_does_not_fit_its_weights_is_refused_before_allocating(tmp_path, edit, named):
    folder = checkpoint(tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({**config, **edit}))
    refused(["--model", folder], named)


@pytest.mark.slow
def test_config_and_tokenizer_files_must_be_regular_files(tmp_path):
    """A symlink to /dev/zero was read until memory ran out; a FIFO hung start-up."""
    folder = checkpoint(tmp_path / "zero")
    os.remove(f"{folder}/config.json")
    os.symlink("/dev/zero", f"{folder}/config.json")
    refused(["--model", folder], "config.json: not a regular file (a character device)")
    fifo = checkpoint(tmp_path / "fifo")
    os.remove(f"{fifo}/config.json")
    os.mkfifo(f"{fifo}/config.json")
    refused(["--model", fifo], "config.json: not a regular file (a FIFO)")
    tok = checkpoint(tmp_path / "tok")
    os.symlink("/dev/zero", f"{tok}/tokenizer.json")
    refused(["--model", tok], "tokenizer.json: not a regular file")


@pytest.mark.slow
def test_an_absurd_pool_is_refused_naming_its_flag(tmp_path):
    """Only the allocator's refusal stopped --max-checkpoints 1e9 (5,000 GiB of states)
    in the separate pools (in one budget it is a cap and allocates nothing); a budget the
    machine cannot hold is refused naming the flag that sized it."""
    folder = qwen3_5_folder(tmp_path / "q")
    refused(["--model", folder, "--cache-bytes", "off", "--max-checkpoints", "1000000000"],
            "max_checkpoints")  # fmt: skip
    refused(["--model", "random", "--kv-tokens", "100000000000"], "kv_tokens")
    refused(["--model", folder, "--kv-tokens", "100000000000"], "--kv-tokens: ")
    refused(["--model", folder, "--cache-bytes", "4TiB"], "--cache-bytes: ")


# --- each names its file and field --------------------------------------------------------
def run_serve(*args: str) -> str:
    """``radixkv serve ARGS`` in a child process (a folder wrongly taken would serve, and
    the bounded wait fails the test): its one error line."""
    status, err, _ = serve(*args)
    skip = ("radixkv-test-peak", "radixkv: ")
    lines = [x for x in err.splitlines() if not x.startswith(skip) and "no tokenizer" not in x]
    assert status == 2 and len(lines) == 1 and lines[0].startswith("error: --model"), err
    return lines[0]


def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = checkpoint(tmp_path / "nan")
    weights = load_file(f"{folder}/model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"][3, 4] = float("nan")
    save_file(weights, f"{folder}/model.safetensors")
    assert "model.layers.1.mlp.up_proj.weight holds NaN or inf" in run_serve("--model", folder)


@pytest.mark.slow
def test_a_safetensors_header_that_lies_is_refused(tmp_path):
    folder = checkpoint(tmp_path / "lie")
    path = f"{folder}/model.safetensors"
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    name = "model.norm.weight"
    start, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [start, end + 4]  # claims 4 bytes more than its shape
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + data[8 + n :])
    assert "model.norm.weight" in run_serve("--model", folder)
    with open(path, "wb") as f:  # and one whose header claims more bytes than the file
        f.write((1 << 40).to_bytes(8, "little") + b"{}")
    assert "safetensors header" in run_serve("--model", folder)


@pytest.mark.slow
def test_deeply_nested_or_wrongly_typed_json_is_refused_naming_the_file(tmp_path):
    folder = checkpoint(tmp_path / "deep")
    with open(f"{folder}/config.json", "w") as f:
        f.write("[" * 100_000 + "]" * 100_000)
    assert "config.json: JSON nested too deeply" in run_serve("--model", folder)
    with open(f"{folder}/config.json", "w") as f:
        f.write("[1, 2]")
    assert "config.json: must be a JSON object" in run_serve("--model", folder)


@pytest.mark.slow
def test_a_bad_tokenizer_json_is_refused_naming_it(tmp_path):
    folder = checkpoint(tmp_path / "tok")
    with open(f"{folder}/tokenizer.json", "w") as f:
        f.write('{"model": {"type": "nothing"}}')
    assert f"{folder}/tokenizer.json: not a tokenizer" in run_serve("--model", folder)
    with open(f"{folder}/tokenizer.json", "w") as f:
        f.write("{")
    assert f"{folder}/tokenizer.json" in run_serve("--model", folder)


def test_a_well_formed_folder_still_loads_its_weights_exactly(tmp_path):
    """The checks change nothing for a good folder: every weight as saved."""
    from radixkv.engine.weights import load_hf_folder

    folder = checkpoint(tmp_path / "ok")
    model = load_hf_folder(folder)
    want = random_model(ModelConfig(num_hidden_layers=2), seed=1).state_dict()
    for name, t in model.state_dict().items():
        assert torch.equal(t, want[name]), name


# --- the chat template: bounded work and output ------------------------------------------
NS = "{% set ns = namespace(s=messages[0].content, l=[1]) %}"
HOSTILE_TEMPLATES = [
    # nested range(100000) loops grew a request to 7.6 GB
    ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
     "loop steps"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "loop steps"),
    ("{{ 'x' * 1000000000 }}", "a size of 1,000,000,000"),
    ("{{ 'x'.center(1000000000) }}", "a size of 1,000,000,000"),
    ("{{ 'x'|center(1000000000) }}", "a size of 1,000,000,000"),
    ("{{ '%*s' % (1000000000, 'x') }}", "a size of 1,000,000,000"),
    ("{{ '{:>999999999}'.format('x') }}", "a million wide"),
    ("{{ 2 ** 100000 }}", "raised a number"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursed"),
    ("{% for m in messages %}{{ m.content * 3 }}{% endfor %}" * 4, "output went beyond"),
    # issue 59's seven: each reached 2.3-2.6 GB in about a second, or never returned
    ("{% macro f(n) %}{% if n > 0 %}{{ f(n-1) ~ f(n-1) }}{% else %}{{ messages[0].content }}"
     "{% endif %}{% endmacro %}{{ f(40) }}", "a value of|values in all"),
    (NS + "{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "a value of"),
    (NS + "{% for i in range(60) %}{% set ns.s = ns.s.replace('x', 'xx') %}{% endfor %}",
     "a value of"),
    (NS + "{% for i in range(60) %}{% set ns.l = ns.l + ns.l %}{% endfor %}", "a value of"),
    (NS + "{% for i in range(60) %}{% set ns.s = '{}{}'.format(ns.s, ns.s) %}{% endfor %}",
     "a value of"),
    (NS + "{% for i in range(60) %}{% set ns.s = [ns.s, ns.s]|join %}{% endfor %}", "a value of"),
    ("{% macro f(n) %}{% if n > 0 %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(40) }}",
     "loop steps and calls|to render"),
    # and their cousins: one step that multiplies a size, or many small values kept
    (NS + "{% for i in range(60) %}{% set ns.s = ns.s|replace('x', 'xx') %}{% endfor %}",
     "a value of"),
    (NS + "{% for i in range(60) %}{% set ns.s = '%s%s'|format(ns.s, ns.s) %}{% endfor %}",
     "a value of"),
    (NS + "{% for i in range(60) %}{% set ns.s = ns.s.join('abc') %}{% endfor %}", "a value of"),
    (NS + "{{ ns.s.replace('x', ns.s) }}", "a value of"),
    (NS + "{{ ('%s' * 5000) % ((ns.s,) * 5000) }}", "a value of"),
    (NS + "{{ ('{0}' * 5000).format(ns.s) }}", "a value of"),
    (NS + "{{ ('\n' * 100000)|indent(100000) }}", "a value of"),
    (NS + "{% for i in range(100000) %}{% set ns.l = [ns.s ~ i] %}{% endfor %}", "values in all"),
]  # fmt: skip


@pytest.mark.parametrize(("source", "match"), HOSTILE_TEMPLATES)
def test_a_chat_template_is_bounded_in_work_and_output(source, match):
    from radixkv.tokenizer.template import TemplateLimit, output_limit, render

    messages = [{"role": "user", "content": "x" * 200_000}]
    with pytest.raises(TemplateLimit, match=match):
        render(source, output_limit(messages), messages=messages)


def test_an_ordinary_template_renders_as_jinja_does():
    """The loop rewrite is invisible: loop variables, filters, a refusal by the template."""
    from radixkv.tokenizer.template import render

    source = (
        "{% for m in messages %}{% if loop.first %}[{{ loop.length }}]{% endif %}"
        "<{{ m.role }}>{{ m.content|trim }}{% if not loop.last %}|{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    messages = [{"role": "system", "content": " be brief "}, {"role": "user", "content": "hi"}]
    out = render(source, 1 << 20, messages=messages, add_generation_prompt=True)
    assert out == "[2]<system>be brief|<user>hi<assistant>"
    with pytest.raises(ValueError, match="no system"):
        render("{{ raise_exception('no system') }}", 1 << 20, messages=messages)


def template_folder(folder, template: str, extra: dict | None = None) -> str:
    """`checkpoint` with a character-level tokenizer (``extra``: more tokens, by id) and
    ``template`` as its chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = checkpoint(folder)
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate("abcdefghij")},
             **(extra or {})}  # fmt: skip
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tk.save(f"{folder}/tokenizer.json")
    config = {"chat_template": template, "bos_token": "<s>", "eos_token": "</s>"}
    with open(f"{folder}/tokenizer_config.json", "w") as f:
        json.dump(config, f)
    return folder


def test_a_hostile_template_is_a_400_and_the_server_goes_on(tmp_path):
    """Through a real server: the template's folder is the operator's, its work scales
    with what a client sends; either bound gives a 400 naming messages."""
    from radixkv.web.process import ServerProcess

    template = (
        "{% if messages[0].content == 'loop' %}{% for i in range(100000) %}{% for j in "
        "range(100000) %}{% endfor %}{% endfor %}{% endif %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    folder = template_folder(tmp_path / "tpl", template)
    import httpx

    with ServerProcess("--model", folder, "--served-model-name", "m", timeout=120) as srv:
        url = f"{srv.url}/v1/chat/completions"
        body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "abc"}]}
        assert httpx.post(url, json=body, timeout=60).status_code == 200
        body["messages"][0]["content"] = "loop"
        r = httpx.post(url, json=body, timeout=60)
        err = r.json()["error"]
        assert (
            r.status_code == 400 and err["param"] == "messages" and "loop steps" in err["message"]
        )
        assert httpx.get(f"{srv.url}/health").status_code == 200


def test_a_workers_card_naming_a_device_or_a_fifo_is_refused_not_read(tmp_path):
    """A router without --model loads the tokenizer a worker's card names: a source that
    is a device or a folder whose tokenizer.json is a FIFO is refused at once (never a
    read that blocks or never ends), and the router asks for --model."""
    from radixkv.router.fleet import workers_tokenizer

    (tmp_path / "config.json").write_text("{}")
    os.mkfifo(tmp_path / "tokenizer.json")
    for source in ("/dev/zero", str(tmp_path)):
        card = {"radixkv": {"tokenizer": "0123456789abcdef", "tokenizer_source": source}}
        with pytest.raises(ValueError, match="give --model"):
            workers_tokenizer({"http://w": card})


@pytest.mark.slow
def test_template_bombs_in_flight_are_400s_and_a_plain_chat_is_served_beside_them(tmp_path):
    """The seven bombs of issue 59 in one template, chosen by the message: all at once,
    and a plain chat meanwhile. Each bomb is a 400 naming messages within 5 s, the plain
    chat a 200, and the server stays under 1.5 GB."""
    import asyncio
    import time

    import httpx

    from radixkv.web.process import ServerProcess

    bombs = [source for source, _ in HOSTILE_TEMPLATES[10:17]]
    dispatch = "".join(
        f"{{% {'if' if i == 0 else 'elif'} messages[0].content == 'bomb{i}' %}}{b}"
        for i, b in enumerate(bombs)
    )
    template = dispatch + "{% else %}{% for m in messages %}{{ m.content }}{% endfor %}{% endif %}"
    folder = template_folder(tmp_path / "bombs", template)

    async def run(url: str) -> tuple[list, float, int]:
        async with httpx.AsyncClient(timeout=60) as c:

            async def chat(content: str) -> tuple[int, dict, float]:
                start = time.monotonic()
                body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
                r = await c.post(f"{url}/v1/chat/completions", json=body)
                return r.status_code, r.json(), time.monotonic() - start

            tasks = [asyncio.ensure_future(chat(f"bomb{i}")) for i in range(len(bombs))]
            plain = await chat("a plain question")
            return [*(await asyncio.gather(*tasks)), plain]

    with ServerProcess("--model", folder, timeout=120) as srv:
        results = asyncio.run(run(srv.url))
        for status, body, took in results[:-1]:
            assert status == 400 and body["error"]["param"] == "messages", body
            assert took < 5, took
        assert results[-1][0] == 200, results[-1]
        with open(f"/proc/{srv.proc.pid}/status") as f:
            peak = next(int(x.split()[1]) for x in f if x.startswith("VmHWM:")) / 1024
        assert peak < 1536, peak


def test_a_token_the_models_vocabulary_lacks_is_a_400_naming_the_prompt(tmp_path):
    """A tokenizer whose ids run past the model's vocabulary (its ``z`` is 5000): a text
    prompt or a chat holding it is refused naming ``prompt`` or ``messages`` (the
    engine's own check named nothing)."""
    import httpx

    from radixkv.web.process import ServerProcess

    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    folder = template_folder(tmp_path / "vocab", template, {"z": 5000})
    with ServerProcess("--model", folder, timeout=120) as srv:
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "abz", "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert "5000" in r.json()["error"]["message"]
        chat = {"messages": [{"role": "user", "content": "az"}], "max_tokens": 1}
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=chat)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "abc", "max_tokens": 1})
        assert r.status_code == 200
