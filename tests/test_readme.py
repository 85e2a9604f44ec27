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


def test_import_radixkv_is_light():
    """The claim in radixkv/__init__.py: torch and numpy load on first use, not on import."""
    import subprocess
    import sys

    code = (
        "import sys, radixkv; assert 'torch' not in sys.modules and 'numpy' not in sys.modules;"
        "radixkv.RadixCache; assert 'torch' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
