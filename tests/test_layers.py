"""The layers point down only: what each part of the package may import, checked over
every import statement of the source (top-level and inside functions alike)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "radixkv"
# each part, and the parts above it it must never import
FORBIDDEN = {
    "tree": ("engine", "server", "router", "storage", "sim", "cli", "web", "bench", "kvcache"),
    "key": ("engine", "server", "router", "storage", "sim", "cli", "web", "bench", "tree"),
    "policy": ("engine", "server", "router", "storage", "sim", "cli", "web", "bench"),
    "blockhash": ("engine", "server", "router", "storage", "sim", "cli", "web", "bench"),
    "kvcache": ("engine", "server", "router", "storage", "sim", "cli", "web", "bench"),
    "events": ("engine", "server", "router", "storage", "sim", "cli", "web", "bench"),
    "storage": ("engine", "server", "router", "sim", "cli", "web", "bench"),
    "engine": ("server", "router", "sim", "cli", "web", "bench"),
    "web": ("engine", "server", "router", "sim", "cli", "bench"),
    "router": ("server", "sim", "cli", "bench"),
    "server": ("router", "sim", "cli", "bench"),
    "bench": ("server", "router", "engine", "sim", "cli"),
    "sim": ("server", "cli", "bench", "web"),
}
MAX_LINES = 700


def _modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def _part(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0].removesuffix(".py")


def _imports(path: Path) -> set[str]:
    """The radixkv subpackages a module imports (``radixkv.x...`` -> ``x``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "radixkv" and len(parts) > 1:
                out.add(parts[1])
    return out


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_each_module_imports_only_layers_below_it(path):
    banned = set(FORBIDDEN.get(_part(path), ())) - {_part(path)}
    assert not _imports(path) & banned, f"{path.name} imports {sorted(_imports(path) & banned)}"


def test_no_source_module_is_over_700_lines_and_each_says_what_it_owns():
    for path in _modules():
        lines = path.read_text().splitlines()
        assert len(lines) <= MAX_LINES, f"{path.relative_to(SRC)}: {len(lines)} lines"
        doc = " ".join((ast.get_docstring(ast.parse(path.read_text())) or "").split())
        where = path.relative_to(SRC)
        assert "Owns" in doc and "Must not touch" in doc, f"{where}: what does it own?"


def test_the_checker_sees_a_forbidden_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from radixkv.server.app import build_app\n")
    assert _imports(bad) == {"server"}


def _foreign_privates(path: Path) -> list[str]:
    """Private names (``_x``, not dunder) a module takes from another radixkv module: an
    import of one, or an attribute of a name it imported (``RadixKey._view``). Reads of
    another module's objects' private fields through instances are not seen here."""
    out = []
    tree = ast.parse(path.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(
            "radixkv"
        ):  # fmt: skip
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    out.append(f"from {node.module} import {a.name}")
                imported.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            imported.update(a.asname or a.name for a in node.names if a.name.startswith("radixkv"))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in imported and node.attr.startswith("_")
                and not node.attr.startswith("__")):  # fmt: skip
            out.append(f"{node.value.id}.{node.attr}")
    return out


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_no_module_imports_another_modules_private_names(path):
    assert not _foreign_privates(path), f"{path.name}: {_foreign_privates(path)}"


def test_the_checker_sees_a_private_name_taken(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from radixkv.key import RadixKey, _to_token_array\n"
                   "k = RadixKey._view\n")  # fmt: skip
    assert _foreign_privates(bad) == ["from radixkv.key import _to_token_array",
                                      "RadixKey._view"]  # fmt: skip
