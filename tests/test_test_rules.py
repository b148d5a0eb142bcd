"""Rules for the tests themselves, read from their source with `ast`.

No wall-clock bound: a test must not compare a duration it measured (a difference of
`time.time()`, `time.perf_counter()` or `time.monotonic()` readings, or a variable holding one)
against a literal, nor assert on one. On a loaded 2-core machine such a bound fails for the wrong
reason, and a speed target belongs in a benchmark with its floor beside it
(docs/contributing.md). Assert structure instead: the error names the limit, an Event a
sleeping tool sets is still unset, a wave's composition, a fake clock.

What the check follows, within one file: durations bound to names, stored into a list or dict
(`ended[i] = ...`) and iterated over, returned by a function (whole or as an element of a
returned tuple, and through `return other(...)`), unpacked from such a call, and passed to a
function's parameter. A deadline (`time.monotonic() + 600`)
compared with a reading is a bound on a hang, not a duration, and is allowed. It does not
follow a duration through a dict, an attribute or another module.
"""

from __future__ import annotations

import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent
CLOCKS = {"time", "perf_counter", "monotonic", "time_ns", "perf_counter_ns", "monotonic_ns"}


def _is_clock_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    if isinstance(f, ast.Attribute):
        return f.attr in CLOCKS and isinstance(f.value, ast.Name) and f.value.id == "time"
    return isinstance(f, ast.Name) and f.id in CLOCKS - {"time"}


def _is_literal(node: ast.AST) -> bool:
    """A number, or arithmetic on numbers only (`3.0 + 5.0`, `-1`)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    if isinstance(node, ast.UnaryOp):
        return _is_literal(node.operand)
    if isinstance(node, ast.BinOp):
        return _is_literal(node.left) and _is_literal(node.right)
    return False


def _targets(node: ast.AST) -> list[tuple[ast.expr, ast.expr]]:
    """(target, value) pairs of an assignment."""
    if isinstance(node, ast.Assign):
        return [(t, node.value) for t in node.targets]
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
        return [(node.target, node.value)]
    if isinstance(node, ast.NamedExpr):
        return [(node.target, node.value)]
    if isinstance(node, (ast.For, ast.comprehension)):
        return [(node.target, node.iter)]  # an element of a list of durations is one
    return []


class _Module:
    """The durations of one file (module docstring)."""

    def __init__(self, tree: ast.Module):
        self.tree = tree
        self.functions = {
            n.name: n
            for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        }
        self.scopes = [tree, *self.functions.values()]
        self.clock_names: dict[int, set[str]] = {id(s): set() for s in self.scopes}
        self.duration_names: dict[int, set[str]] = {id(s): set() for s in self.scopes}
        self.returns: dict[str, set] = {}  # function -> {"all"} or tuple positions
        self._solve()

    # an expression, read in `scope`
    def is_clock(self, node: ast.AST, scope) -> bool:
        names = self.clock_names[id(scope)]
        return any(
            _is_clock_call(n) or (isinstance(n, ast.Name) and n.id in names) for n in ast.walk(node)
        )

    def is_duration(self, node: ast.AST, scope) -> bool:
        names = self.duration_names[id(scope)]
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and n.id in names:
                return True
            if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub):
                if self.is_clock(n.left, scope) or self.is_clock(n.right, scope):
                    return True
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name):
                if "all" in self.returns.get(n.func.id, ()):
                    return True
        return False

    def _own_nodes(self, scope):
        """The nodes of `scope` outside the functions nested in it."""
        stack = list(ast.iter_child_nodes(scope))
        while stack:
            n = stack.pop()
            yield n
            if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                stack.extend(ast.iter_child_nodes(n))

    def _solve(self) -> None:
        changed = True
        while changed:
            changed = False
            for scope in self.scopes:
                for node in self._own_nodes(scope):
                    changed |= self._assign(node, scope)
                    changed |= self._call(node, scope)
                    changed |= self._return(node, scope)

    def _mark(self, table: dict, scope, name: str) -> bool:
        names = table[id(scope)]
        if name in names:
            return False
        names.add(name)
        return True

    def _assign(self, node, scope) -> bool:
        changed = False
        for target, value in _targets(node):
            if isinstance(target, ast.Name):
                if self.is_clock(value, scope):
                    changed |= self._mark(self.clock_names, scope, target.id)
                if self.is_duration(value, scope):
                    changed |= self._mark(self.duration_names, scope, target.id)
            elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
                if self.is_duration(value, scope):  # a list or dict of durations
                    changed |= self._mark(self.duration_names, scope, target.value.id)
            elif isinstance(target, ast.Tuple) and isinstance(value, ast.Call):
                f = value.func
                positions = self.returns.get(f.id, ()) if isinstance(f, ast.Name) else ()
                for i, elt in enumerate(target.elts):
                    if isinstance(elt, ast.Name) and i in positions:
                        changed |= self._mark(self.duration_names, scope, elt.id)
        return changed

    def _call(self, node, scope) -> bool:
        """A duration passed to a function of this file makes its parameter one."""
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            return False
        fn = self.functions.get(node.func.id)
        if fn is None:
            return False
        params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
        changed = False
        for i, arg in enumerate(node.args):
            if i < len(params) and self.is_duration(arg, scope):
                changed |= self._mark(self.duration_names, fn, params[i])
        for kw in node.keywords:
            if kw.arg in params + [a.arg for a in fn.args.kwonlyargs]:
                if self.is_duration(kw.value, scope):
                    changed |= self._mark(self.duration_names, fn, kw.arg)
        return changed

    def _return(self, node, scope) -> bool:
        if not (isinstance(node, ast.Return) and node.value is not None):
            return False
        if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return False
        out = self.returns.setdefault(scope.name, set())
        before = set(out)
        value = node.value
        if isinstance(value, ast.Tuple):
            out |= {i for i, e in enumerate(value.elts) if self.is_duration(e, scope)}
        elif isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
            out |= self.returns.get(value.func.id, set())
            if self.is_duration(value, scope):
                out.add("all")
        elif self.is_duration(value, scope):
            out.add("all")
        return out != before

    def violations(self) -> list[tuple[int, str]]:
        found = []
        for scope in self.scopes:
            for node in self._own_nodes(scope):
                if isinstance(node, ast.Assert) and self.is_duration(node.test, scope):
                    found.append((node.lineno, "an assert on a measured duration"))
                elif isinstance(node, ast.Compare):
                    sides = [node.left, *node.comparators]
                    if any(self.is_duration(s, scope) for s in sides) and any(
                        _is_literal(s) for s in sides
                    ):
                        found.append((node.lineno, "a measured duration against a literal"))
        first: dict[int, str] = {}
        for line, what in found:  # an assert's own comparison: named once, as the assert
            if what.startswith("an assert") or line not in first:
                first[line] = what
        return sorted(first.items())


def wall_clock_bounds(source: str) -> list[tuple[int, str]]:
    """(line, what) of each wall-clock bound in a test file's source."""
    return _Module(ast.parse(source)).violations()


def test_no_test_bounds_the_wall_clock():
    found = []
    for path in sorted(TESTS.glob("*.py")):
        for line, what in wall_clock_bounds(path.read_text()):
            found.append(f"tests/{path.name}:{line}: {what}")
    assert found == [], "\n".join(found)


MADE_UP = """
import time
from time import perf_counter


def _cli(*args):
    t0 = time.perf_counter()
    proc = run(args)
    return proc, time.perf_counter() - t0


def _check(proc, seconds, *needles):
    assert proc.returncode == 2
    assert seconds < 30  # caught: assert (a parameter that a caller passes a duration)


def test_direct():
    t0 = time.perf_counter()
    work()
    assert time.perf_counter() - t0 < 2.0  # caught: assert


def test_held():
    t0 = perf_counter()
    work()
    took = perf_counter() - t0
    ok = took < 1.5 + 1.0  # caught: literal
    assert ok  # caught: assert


def test_through_a_helper():
    proc, seconds = _cli("x")
    assert proc.returncode == 0
    _check(proc, seconds)


def test_deadline_and_left():
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:  # a bound on a hang: allowed
        time.sleep(0.1)
    left = deadline - time.monotonic()
    if left > 5:  # caught: literal
        pass


def test_stored_then_iterated():
    ended = [None, None]
    step2 = time.monotonic()
    for i in (0, 1):
        ended[i] = time.monotonic() - step2
    for t in ended:
        assert 11 <= t <= 57  # caught: assert


def test_unrelated():
    proc = _cli("y")[0]
    assert proc.returncode == 2 and len(proc.stdout) > 0
"""


def test_the_rule_catches_a_made_up_example():
    """Each line marked `# caught: assert` / `# caught: literal` above, and no other."""
    kinds = {"assert": "an assert on a measured duration",
             "literal": "a measured duration against a literal"}  # fmt: skip
    marked = [
        (i, kinds[line.split("# caught: ")[1].split()[0]])
        for i, line in enumerate(MADE_UP.splitlines(), 1)
        if "# caught: " in line
    ]
    assert len(marked) == 6
    assert wall_clock_bounds(MADE_UP) == marked


def test_every_test_a_page_names_exists():
    """docs/contributing.md: each user-page claim names its test (`tests/x.py::test_name`); the
    file and the test function must exist."""
    import re

    root = TESTS.parent
    named = []
    pages = [root / "README.md", *(root / "docs").glob("*.md")]
    for page in sorted(p for p in pages if p.name != "contributing.md"):  # (it shows the form)
        for path, name in re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", page.read_text()):
            named.append((page.name, path, name))
    assert len(named) > 40  # the tables of placement.md, multi-turn.md and lora.md
    missing = []
    for page, path, name in named:
        file = root / path
        defined = set()
        if file.exists():
            tree = ast.parse(file.read_text())
            defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        if name not in defined:
            missing.append(f"{page}: {path}::{name}")
    assert missing == [], "\n".join(missing)
