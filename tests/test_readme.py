"""The README's Python snippets run as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_snippets_run(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README should show how to use the cache"
    for block in blocks:
        exec(compile(block, str(README), "exec"), {})
    assert "tensor([100, 101, 102, 103, 104])" in capsys.readouterr().out
