"""The layers point down only: what each part of the package may import, checked over
every import statement of the source (top-level and inside functions alike), and no module
imports itself back through others (a cycle), whether at the top or inside a function.

Imports under ``if TYPE_CHECKING:`` are annotations only (never executed): they are
allowed to point anywhere inside a part and are not counted as cycles."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "radixkv"
# each part, and the parts above it it must never import
EVERYTHING = ("engine", "server", "router", "storage", "sim", "cli", "web", "bench", "tree",
              "kvcache", "tokenizer", "events", "hashing")  # fmt: skip
FORBIDDEN = {
    "checkpoint": EVERYTHING,
    # (below everything but checkpoint: the engine, the router and the simulator use it)
    "tokenizer": tuple(p for p in EVERYTHING if p != "tokenizer"),
    "tree": ("engine", "server", "router", "storage", "sim", "cli", "web", "bench", "kvcache"),
    "key": ("engine", "server", "router", "storage", "sim", "cli", "web", "bench", "tree"),
    "hashing": EVERYTHING,  # (below the tree: it names prefixes for the tree, events, store)
    "kvcache": ("engine", "server", "router", "storage", "sim", "cli", "web", "bench"),
    "events": ("engine", "server", "router", "storage", "sim", "cli", "web", "bench"),
    "storage": ("engine", "server", "router", "sim", "cli", "web", "bench"),
    "engine": ("server", "router", "sim", "cli", "web", "bench"),
    "web": ("engine", "server", "router", "sim", "cli", "bench"),
    "router": ("engine", "server", "sim", "cli", "bench"),  # a fleet's router loads no engine
    "server": ("router", "sim", "cli", "bench"),
    "bench": ("server", "router", "engine", "sim", "cli"),
    "sim": ("server", "cli", "bench", "web"),
}
MAX_FUNCTION_LINES = 80  # tests excepted
LONG_MODULE = 700  # lines; a longer module says why it is one idea


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


def test_the_tests_mirror_every_part_of_the_source():
    """tests/ has a folder of tests for each part of src/radixkv (a package, or a
    module at the top: key.py, events.py, units.py), so a part's tests are where its
    code is."""
    parts = {_part(m) for m in _modules()} - {"__init__"}
    tests = SRC.parents[1] / "tests"
    missing = sorted(p for p in parts if not any((tests / p).glob("test_*.py")))
    assert not missing, f"no tests/<part>/ for: {missing}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_each_module_imports_only_layers_below_it(path):
    banned = set(FORBIDDEN.get(_part(path), ())) - {_part(path)}
    assert not _imports(path) & banned, f"{path.name} imports {sorted(_imports(path) & banned)}"


def test_each_module_says_what_it_owns_and_a_long_one_why_it_is_one_idea():
    """Every module says what it owns and must not touch; one over `LONG_MODULE` lines
    says at its top why it is one idea (``One idea:``), not a rule bent to fit."""
    for path in _modules():
        doc = " ".join((ast.get_docstring(ast.parse(path.read_text())) or "").split())
        where = path.relative_to(SRC)
        assert "Owns" in doc and "Must not touch" in doc, f"{where}: what does it own?"
        lines = len(path.read_text().splitlines())
        assert lines <= LONG_MODULE or "One idea:" in doc, f"{where}: {lines} lines, why?"


def _long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Functions (nested ones within their outer one) longer than ``limit`` lines."""
    return [
        f"{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > limit
    ]


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_no_function_is_longer_than_80_lines(path):
    assert not _long_functions(path), f"{path.relative_to(SRC)}: {_long_functions(path)}"


def test_the_length_checker_sees_a_long_function(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n" + "    x = 1\n" * 80)
    assert _long_functions(bad) == ["f: 81 lines"]


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


def test_the_checker_sees_a_private_name_taken(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from radixkv.key import RadixKey, _to_token_array\n"
                   "k = RadixKey._view\n")  # fmt: skip
    assert _foreign_privates(bad) == ["from radixkv.key import _to_token_array",
                                      "RadixKey._view"]  # fmt: skip


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in _modules()}


def _runtime_imports(path: Path) -> set[str]:
    """The radixkv modules ``path`` imports when it runs (at the top or inside a function;
    not under ``if TYPE_CHECKING:``), each resolved to a module of the source: ``from
    radixkv.tree import X`` is the package ``radixkv.tree`` unless ``X`` is a module."""
    tree = ast.parse(path.read_text())
    annotations_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for inner in ast.walk(stmt)
    }

    def resolve(name: str) -> str:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        return name

    out = set()
    for node in ast.walk(tree):
        if id(node) in annotations_only:
            continue
        if isinstance(node, ast.Import):
            out.update(resolve(a.name) for a in node.names if a.name.startswith("radixkv"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("radixkv"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in MODULES else resolve(node.module))
    out.discard(_module_name(path) if path.is_relative_to(SRC) else "")
    out.discard("")
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    scc = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        scc.append(w)
                        if w == v:
                            break
                    if len(scc) > 1:
                        found.append(sorted(scc))
    return found


def test_no_import_cycles_even_inside_functions():
    graph = {name: _runtime_imports(path) for name, path in MODULES.items()}
    assert _cycles(graph) == []


def test_the_cycle_checker_sees_a_cycle_hidden_in_a_function(tmp_path):
    a = tmp_path / "a.py"
    a.write_text("def f():\n    from radixkv.storage.store import open_store\n")
    assert _runtime_imports(a) == {"radixkv.storage.store"}
    assert _cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}) == [["x", "y", "z"]]
    typing_only = tmp_path / "b.py"
    typing_only.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                           "    from radixkv.tree.core import RadixCache\n")  # fmt: skip
    assert _runtime_imports(typing_only) == set()


def test_routing_a_fleet_loads_no_engine():
    """The router and ``radixkv route`` import no module of the engine (its tokenizers
    live in `radixkv.tokenizer`)."""
    code = ("import sys, radixkv.router.proxy, radixkv.router.fleet, radixkv.cli.route\n"
            "print(sorted(m for m in sys.modules if m.startswith('radixkv.engine')))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# Private names of other libraries read on purpose, and why.
FOREIGN_PRIVATE_READS = {
    # redis-py's Connection keeps its socket there and has no public one: page reads go
    # straight from it into the caller's buffers (`RedisStore.get_into`)
    ("storage/store.py", "_sock"),
}
NAMED_TUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}


def _strings(node: ast.AST) -> list[str]:
    return [
        c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)
    ]


def _on_self(node: ast.Attribute) -> bool:
    return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")


def _own_names(tree: ast.AST) -> set[str]:
    """The attribute names a module defines itself: its classes' methods, class
    attributes and ``__slots__``, and what it assigns to ``self.x`` / ``cls.x``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    names.add(stmt.name)
                elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    names.add(stmt.target.id)
                elif isinstance(stmt, ast.Assign):
                    names.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
                    if any(isinstance(t, ast.Name) and t.id == "__slots__" for t in stmt.targets):
                        names.update(_strings(stmt.value))
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _on_self(node):
            names.add(node.attr)
    return names


def _private_reads(path: Path) -> list[str]:
    """``x._name`` where ``x`` is not ``self`` / ``cls`` and no class of this module
    defines ``_name``: a read of another module's (or library's) private state through
    an instance."""
    tree = ast.parse(path.read_text())
    own = _own_names(tree)
    where = str(path.relative_to(SRC)) if path.is_relative_to(SRC) else path.name
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or _on_self(node):
            continue
        name = node.attr
        if (name.startswith("_") and not name.startswith("__") and name not in NAMED_TUPLE_API
                and name not in own and (where, name) not in FOREIGN_PRIVATE_READS):  # fmt: skip
            out.append(f"{ast.unparse(node)} (line {node.lineno})")
    return out


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_no_module_takes_or_reads_another_modules_private_names(path):
    """Neither imports another module's ``_name`` nor reads ``x._name`` of another's."""
    taken = _foreign_privates(path) + _private_reads(path)
    assert not taken, f"{path.relative_to(SRC)}: {taken}"


def test_the_checker_sees_private_state_read_through_an_instance(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("class A:\n    def __init__(self):\n        self._mine = 1\n"
                   "    def f(self, cache, other):\n        return other._mine + cache._heap\n"
                   "def g(pool):\n    return pool.rows._np\n")  # fmt: skip
    assert sorted(_private_reads(bad)) == ["cache._heap (line 5)", "pool.rows._np (line 7)"]


# A layer type's own names, and the memory shape's: an `if` (or a comprehension's filter)
# that reads one of them outside the type's home (or `radixkv.kvcache.shapes`) branches on
# the layer type, or on which memory shape is in use.
LAYER_TYPE_NAMES = {"window", "recurrent", "states", "state", "sliding", "window_layers",
                    "recurrent_layers", "window_columns", "why_not_window",
                    "arena", "one_arena", "cache_split"}  # fmt: skip
TYPE_CHECKED = ("engine", "server", "sim", "cli")  # outside engine/models: each type's layers
# modules that still branch on a layer type, and why
TYPE_BRANCHES_LEFT = {
    "sim/hybrid.py": "the budget model, beside the engine's replay (#62 item 4)",
    "sim/vllm_pool.py": "vLLM's hybrid allocator, replayed as vLLM sizes it (a peer row)",
    "sim/spec_model.py": "a spec as a model: it builds each type's layers, as engine/models",
}


def _type_branches(path: Path) -> list[str]:
    """The tests of ``if``, ``while``, ``x if c else y`` and comprehension filters that
    read a layer type's name (an attribute, a name or a string), and imports of a type's
    package."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            ("radixkv.kvcache.window", "radixkv.kvcache.recurrent")
        ):
            out.append(f"import {node.module} (line {node.lineno})")
        tests = [node.test] if isinstance(node, ast.If | ast.IfExp | ast.While) else []
        tests += node.ifs if isinstance(node, ast.comprehension) else []
        for t in tests:
            for sub in ast.walk(t):
                name = (sub.attr if isinstance(sub, ast.Attribute) else
                        sub.id if isinstance(sub, ast.Name) else
                        sub.value if isinstance(sub, ast.Constant) else None)  # fmt: skip
                if name in LAYER_TYPE_NAMES:
                    out.append(f"{ast.unparse(t)[:60]} (line {t.lineno})")
                    break
    return out


def _type_checked() -> list[Path]:
    return [p for p in _modules() if _part(p) in TYPE_CHECKED and "models" not in p.parts
            and str(p.relative_to(SRC)) not in TYPE_BRANCHES_LEFT]  # fmt: skip


@pytest.mark.parametrize("path", _type_checked(), ids=lambda p: str(p.relative_to(SRC)))
def test_the_engine_the_server_and_the_simulator_branch_on_no_layer_type_or_shape(path):
    """Each layer type's part of a report, a step or the memory is its manager's hook
    (`radixkv.kvcache.managers`), and what differs between the memory shapes is the
    shape's (`radixkv.kvcache.shapes`); the engine, the server and the simulator loop
    over the managers and ask the shape, naming none."""
    assert not _type_branches(path), f"{path.relative_to(SRC)}: {_type_branches(path)}"


def test_the_type_branch_checker_sees_one(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from radixkv.kvcache.window.slots import WindowSlots\n"
                   "def f(e):\n    if e.window is not None:\n        return 1\n"
                   "    x = 2 if e.arena is None else 3\n"
                   "    return [m for m in e.mgr.managers if m.kind == 'states']\n")  # fmt: skip
    assert len(_type_branches(bad)) == 4
    for module in TYPE_BRANCHES_LEFT:
        assert _type_branches(SRC / module), f"{module} is clean now: take it off the list"
