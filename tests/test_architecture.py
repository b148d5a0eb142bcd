"""The package's import graph, read from the source (nothing is imported):

- no import circles among megarl's modules (module-level, function-local and `if
  TYPE_CHECKING:` imports together: a cycle of annotations is a cycle of design), nor among its
  packages (`megarl.models`, `megarl.convert`, ...);
- nothing in `megarl.convert` imports `megarl.trainer` (the converter is below the trainer);
- no module imports another module's private (`_name`) names, by `from x import _y` or as
  `module._y`;
- every imported megarl module exists;
- a function-local import of one of megarl's own modules is marked `# deferred: <why>` (on its
  line or the line above): it defers a heavy optional dependency (vLLM, megatron-core,
  Transformer Engine), and says so;
- the rollout's parts keep their layers (`ROLLOUT_LAYERS`); the trainer, the CLI and the config
  reach the rollout through its package API only; nothing in the rollout imports that API;
- no module of `megarl.rollout` or `megarl.distributed` keeps mutable state at module level
  (no `global`, no module-level container that is changed), and none of the rollout's files is
  longer than `MAX_ROLLOUT_LINES`.

A package's lazily exported names (`_LAZY = {name: module}` in its `__init__`) count as imports
of those modules.
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
            else:
                visit(child, local)

    visit(tree, False)
    for node in tree.body:  # lazy exports: `_LAZY = {"name": "megarl.x.y", ...}`
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets)
            and isinstance(node.value, ast.Dict)
        ):
            for v in node.value.values:
                target = _resolve(v.value, mods) if isinstance(v, ast.Constant) else None
                if target is None:
                    mod.missing.append(f"{mod.name}._LAZY: {ast.unparse(v)}")
                elif target != mod.name:
                    mod.imports.add(target)
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


def _packages(mods: dict[str, Module]) -> dict[str, Module]:
    """The graph of megarl's packages (`megarl.x`): x -> y when a module of x imports one of y."""
    out: dict[str, Module] = {}
    for m in mods.values():
        a = ".".join(m.name.split(".")[:2])
        out.setdefault(a, Module(a, "", []))
        for t in m.imports:
            b = ".".join(t.split(".")[:2])
            out.setdefault(b, Module(b, "", []))
            if a != b:
                out[a].imports.add(b)
    return out


def test_no_circles_among_packages():
    """e.g. models -> convert -> checkpoint -> models would close one."""
    assert _circles(_packages(_graph())) == []


BASE = {
    "megarl.rollout.api",
    "megarl.rollout.config",
    "megarl.rollout.samples",
    "megarl.rollout.seeds",
    "megarl.rollout.sync.stats",
}
"""The rollout's records and settings: they import nothing else of the rollout."""

ROLLOUT_LAYERS = {
    "engine": {"engine"},
    "sync": {"sync", "engine"},
    "multi_turn": {"multi_turn"},
    "agents": {"agents", "multi_turn"},
    "metrics": {"metrics", "multi_turn"},
    "placement": {"placement", "engine", "sync", "multi_turn", "agents", "metrics"},
    "build": {"build", "engine", "multi_turn", "placement"},
    "judge": {"judge", "engine"},
}
"""What each part of the rollout (a folder, or a module beside them) may import besides
`BASE`: the engine knows no placement and no weight transfer; multi-turn knows no engine (it
generates through a protocol) and no agents; only the placement puts the parts together, and
`build` makes the placement a run asks for."""

API_ONLY = ("megarl.trainer", "megarl.cli", "megarl.config")
"""They reach the rollout through `megarl.rollout` (its `__init__`) alone."""


def _part(name: str) -> str | None:
    """The rollout part `name` belongs to (megarl.rollout.<part>[...]), None outside it."""
    parts = name.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "rollout" else None


def _rollout_arrows(mods: dict[str, Module]) -> list[str]:
    bad = []
    for m in mods.values():
        if m.name.startswith("megarl.rollout"):
            for t in sorted(m.imports):
                if not t.startswith("megarl.rollout") or t in BASE:
                    continue
                if t == "megarl.rollout":
                    bad.append(f"{m.name} -> {t} (the API is for the rollout's users)")
                elif m.name in BASE:
                    bad.append(f"{m.name} -> {t} (a record imports no part)")
                elif (part := _part(m.name)) is not None and _part(t) not in ROLLOUT_LAYERS[part]:
                    bad.append(f"{m.name} -> {t}")
        elif m.name.startswith(API_ONLY):
            bad += [
                f"{m.name} -> {t}" for t in sorted(m.imports) if t.startswith("megarl.rollout.")
            ]
    return bad


def test_the_rollout_parts_keep_their_layers_and_users_take_its_api():
    parts = {_part(n) for n in _graph() if _part(n) is not None and n not in BASE}
    assert parts == set(ROLLOUT_LAYERS), "a new part of the rollout needs its rule here"
    assert _rollout_arrows(_graph()) == []


MUTATORS = {"append", "extend", "insert", "update", "setdefault", "pop", "popitem", "clear",
            "add", "discard", "remove"}  # fmt: skip
STATELESS = ("megarl.rollout", "megarl.distributed")


def _module_state(mod: Module) -> list[str]:
    """`global` statements, and module-level containers (dict, list, set) changed anywhere in
    the module, as 'path:line: name'."""
    tree = ast.parse("\n".join(mod.lines))
    where = os.path.relpath(mod.path, os.path.dirname(ROOT))
    containers = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        value = getattr(node, "value", None)
        mutable = isinstance(value, (ast.Dict, ast.List, ast.Set)) or (
            isinstance(value, ast.Call) and ast.unparse(value.func) in ("dict", "list", "set")
        )
        if mutable:
            containers |= {t.id for t in targets if isinstance(t, ast.Name)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found += [f"{where}:{node.lineno}: global {n}" for n in node.names]
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if not isinstance(node, ast.AugAssign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Subscript) and ast.unparse(t.value) in containers:
                    found.append(f"{where}:{node.lineno}: {ast.unparse(t.value)}[...] changed")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in MUTATORS
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id in containers
        ):
            found.append(f"{where}:{node.lineno}: {node.func.value.id}.{node.func.attr}()")
    return found


def test_no_module_level_state_in_the_rollout_and_the_job():
    """Lifetimes are owned (the job, the engine ranks, a run's rollout), never kept in a
    module."""
    mods = _graph()
    assert [
        f for m in mods.values() if m.name.startswith(STATELESS) for f in _module_state(m)
    ] == []


MAX_ROLLOUT_LINES = 450


def test_the_rollout_files_stay_small():
    sizes = {m.name: len(m.lines) for m in _graph().values() if m.name.startswith("megarl.rollout")}
    assert {n: k for n, k in sizes.items() if k > MAX_ROLLOUT_LINES} == {}


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
    """The checks above can fail: a circle (one through a TYPE_CHECKING import, one through a
    lazy export), a private import, an unmarked local import, a rollout part importing a part
    above it, the trainer importing a rollout module, module-level state and a package circle
    in made-up modules are each found."""

    def module(name: str, lines: list[str]) -> Module:
        return Module(name, str(tmp_path / (name.replace(".", "/") + ".py")), lines)

    mods = {
        "megarl.a": module(
            "megarl.a",
            ["from megarl.b import _hidden", "def f():", "    import megarl.b", "import megarl.c"],
        ),
        "megarl.b": module("megarl.b", ["import megarl.a"]),
        "megarl.t": module("megarl.t", ["if TYPE_CHECKING:", "    import megarl.u"]),
        "megarl.u": module("megarl.u", ["import megarl.t"]),
        "megarl.p": module("megarl.p", ["_LAZY = {'f': 'megarl.q'}"]),
        "megarl.q": module("megarl.q", ["import megarl.p"]),
        "megarl.rollout.engine.x": module(
            "megarl.rollout.engine.x", ["from megarl.rollout.placement.y import Y"]
        ),
        "megarl.rollout.placement.y": module("megarl.rollout.placement.y", []),
        "megarl.trainer.z": module("megarl.trainer.z", ["import megarl.rollout.engine.x"]),
        "megarl.distributed.s": module(
            "megarl.distributed.s", ["_CACHE = {}", "def f():", "    _CACHE['k'] = 1"]
        ),
        "megarl.models.m": module("megarl.models.m", ["import megarl.convert.c"]),
        "megarl.convert.c": module("megarl.convert.c", ["import megarl.checkpoint.k"]),
        "megarl.checkpoint.k": module("megarl.checkpoint.k", ["import megarl.models.m"]),
    }
    for m in mods.values():
        _read(m, mods)
    assert _circles(mods) == [
        ["megarl.a", "megarl.b"],
        ["megarl.checkpoint.k", "megarl.convert.c", "megarl.models.m"],
        ["megarl.p", "megarl.q"],
        ["megarl.t", "megarl.u"],
    ]
    assert ["megarl.checkpoint", "megarl.convert", "megarl.models"] in _circles(_packages(mods))
    assert len(mods["megarl.a"].private) == 1
    assert len(mods["megarl.a"].unmarked) == 1
    assert [x.rsplit(" ", 1)[1] for x in mods["megarl.a"].missing] == ["megarl.c"]
    assert _rollout_arrows(mods) == [
        "megarl.rollout.engine.x -> megarl.rollout.placement.y",
        "megarl.trainer.z -> megarl.rollout.engine.x",
    ]
    assert len(_module_state(mods["megarl.distributed.s"])) == 1
