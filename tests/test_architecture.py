"""The package's import graph, read from the source (nothing is imported):

- no import circles among megarl's modules (module-level and function-local imports together;
  `if TYPE_CHECKING:` blocks excluded, they never run);
- nothing in `megarl.convert` imports `megarl.trainer` (the converter is below the trainer);
- no module imports another module's private (`_name`) names, by `from x import _y` or as
  `module._y`;
- every imported megarl module exists;
- a function-local import of one of megarl's own modules is marked `# deferred: <why>` (on its
  line or the line above): it defers a heavy optional dependency (vLLM, megatron-core,
  Transformer Engine), and says so.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megarl")
MARK = "# deferred:"


@dataclass
class Module:
    name: str
    path: str
    lines: list[str]
    imports: set[str] = field(default_factory=set)
    """megarl modules it imports (module level and function-local)."""
    private: list[str] = field(default_factory=list)
    """`line: what` for each private name it takes from another module."""
    unmarked: list[str] = field(default_factory=list)
    """`line: module` for each function-local megarl import without the marker."""
    missing: list[str] = field(default_factory=list)
    """`line: module` for each import of a megarl module that does not exist."""


def _modules() -> dict[str, Module]:
    out = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                name = rel.removesuffix(".__init__")
                with open(path) as fh:
                    out[name] = Module(name, path, fh.read().splitlines())
    return out


def _resolve(name: str, mods: dict) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _read(mod: Module, mods: dict) -> None:
    tree = ast.parse("\n".join(mod.lines))
    package = mod.name if mod.path.endswith("__init__.py") else mod.name.rpartition(".")[0]
    aliases: dict[str, str] = {}  # local name -> megarl module it is bound to

    def base_of(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = package
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        return base + ("." + node.module if node.module else "")

    def record(node, local: bool) -> None:
        where = f"{os.path.relpath(mod.path, os.path.dirname(ROOT))}:{node.lineno}"
        found = []
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("megarl"):
                    if a.name not in mods:
                        mod.missing.append(f"{where}: {a.name}")
                    found.append(a.name)
                    if a.asname:
                        aliases[a.asname] = a.name
        else:
            base = base_of(node)
            if not base.startswith("megarl"):
                return
            if base not in mods:
                mod.missing.append(f"{where}: {base}")
            for a in node.names:
                full = f"{base}.{a.name}"
                if full in mods:  # a submodule
                    found.append(full)
                    aliases[a.asname or a.name] = full
                else:
                    found.append(base)
                    if a.name.startswith("_") and _resolve(base, mods) != mod.name:
                        mod.private.append(f"{where}: from {base} import {a.name}")
        for target in found:
            r = _resolve(target, mods)
            if r is None or r == mod.name:
                continue
            mod.imports.add(r)
            if local:
                line, above = mod.lines[node.lineno - 1], mod.lines[node.lineno - 2]
                if MARK not in line and MARK not in above:
                    mod.unmarked.append(f"{where}: {target}")

    def visit(node, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                record(child, local)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, True)
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            else:
                visit(child, local)

    visit(tree, False)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and isinstance(node.value, ast.Name)
            and aliases.get(node.value.id, mod.name) != mod.name
        ):
            where = f"{os.path.relpath(mod.path, os.path.dirname(ROOT))}:{node.lineno}"
            mod.private.append(f"{where}: {node.value.id}.{node.attr}")


def _graph() -> dict[str, Module]:
    mods = _modules()
    for m in mods.values():
        _read(m, mods)
    return mods


def _circles(mods: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(mods[v].imports):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(mods):
        if v not in index:
            connect(v)
    return out


def test_no_import_circles():
    assert _circles(_graph()) == []


def test_converter_does_not_import_the_trainer():
    arrows = [
        f"{m.name} -> {t}"
        for m in _graph().values()
        if m.name.startswith("megarl.convert")
        for t in sorted(m.imports)
        if t.startswith("megarl.trainer")
    ]
    assert arrows == []


def test_no_private_names_across_modules():
    assert [p for m in _graph().values() for p in m.private] == []


def test_every_imported_module_exists():
    """(Nothing is imported here, so a stale path after a move would pass the checks above.)"""
    assert [x for m in _graph().values() for x in m.missing] == []


def test_function_local_imports_are_marked():
    assert [u for m in _graph().values() for u in m.unmarked] == []


def test_the_checker_sees_what_it_forbids(tmp_path):
    """The checks above can fail: a circle, a private import and an unmarked local import in a
    made-up package are each found."""
    mods = {
        "megarl.a": Module(
            "megarl.a",
            str(tmp_path / "megarl/a.py"),
            ["from megarl.b import _hidden", "def f():", "    import megarl.b", "import megarl.c"],
        ),
        "megarl.b": Module("megarl.b", str(tmp_path / "megarl/b.py"), ["import megarl.a"]),
    }
    for m in mods.values():
        _read(m, mods)
    assert _circles(mods) == [["megarl.a", "megarl.b"]]
    assert len(mods["megarl.a"].private) == 1
    assert len(mods["megarl.a"].unmarked) == 1
    assert [x.rsplit(" ", 1)[1] for x in mods["megarl.a"].missing] == ["megarl.c"]
