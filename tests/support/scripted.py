"""A scripted model for tests of tool calls: ``radixkv serve`` exactly as the command runs
it (the model folder's real weights compute every token's KV, the real tokenizer, parsers,
streaming, usage and cache), except that each answer's tokens are chosen by a script
instead of sampled: random weights never write a tool call.

Run it as a server process (`scripted_server`) or ``python -m support.scripted SCRIPT
serve-args...`` with ``tests`` on the path. It lives in the tests, never in the package, so
no production command can reach it.

A script (JSON): ``{"rules": [{"when": TEXT, "reply": TEXT}, ...], "default": TEXT}``. A
request's answer is the reply of the rule whose ``when`` occurs latest in its prompt's
text (the most recent thing the conversation said; ties: the first rule), else the
default; the reply's tokens (the real tokenizer's) and then EOS. A prompt that ends with a
forced tool call's opening gets the reply as what follows it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def choose(script: dict[str, Any], prompt: str) -> str:
    """The reply a script gives ``prompt``."""
    best, at = script.get("default", "ok"), -1
    for rule in script.get("rules", ()):
        where = prompt.rfind(rule["when"])
        if where > at:
            best, at = rule["reply"], where
    return best


def install(script_path: str, model: str) -> None:
    """Make every request's tokens the script's (`ModelRunner.sample` replaced)."""
    from radixkv.engine.model_runner import ModelRunner
    from radixkv.tokenizer import load_tokenizer

    script = json.loads(Path(script_path).read_text())
    tokenizer = load_tokenizer(model)
    encode = getattr(tokenizer, "encode_plain", tokenizer.encode)
    eos = tokenizer.eos_token_id
    replies: dict[Any, list[int]] = {}

    def sample(r: Any, logits: Any) -> int:
        if not r.output_ids or r.rid not in replies:
            prompt = tokenizer.decode(list(r.input_ids))
            replies[r.rid] = encode(choose(script, prompt)) + [eos]
        reply = replies[r.rid]
        token = reply[min(len(r.output_ids), len(reply) - 1)]
        if token == eos:
            replies.pop(r.rid, None)
        return token

    ModelRunner.sample = staticmethod(sample)  # type: ignore[method-assign]


def scripted_server(script: dict[str, Any], folder: str, tmp: Path, *args: str,
                    timeout: float = 120) -> Any:  # fmt: skip
    """A `ServerProcess` of ``radixkv serve --model folder args`` answering by ``script``."""
    from radixkv.web.process import ServerProcess

    path = tmp / "script.json"
    path.write_text(json.dumps(script))
    tests = str(Path(__file__).resolve().parents[1])
    launcher = [sys.executable, "-c", f"import sys; sys.path.insert(0, {tests!r}); "
                "from support.scripted import main; sys.exit(main())", str(path)]  # fmt: skip
    return ServerProcess("--model", folder, *args, launcher=launcher, timeout=timeout)


def main() -> int:
    script_path, *argv = sys.argv[1:]
    model = argv[argv.index("--model") + 1]
    install(script_path, model)
    from radixkv.cli import main as cli

    return cli(argv)


if __name__ == "__main__":
    sys.exit(main())
