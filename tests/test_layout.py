"""The package's import layers (docs/architecture.md, "Map: stage and
placement to module"), read from the source with ast: every import of one of
coordl's own modules -- at the top of a file or inside a function -- goes to
the same layer or one below, and the module graph has no cycle but the one
listed (with its reason).  A new module must be given a layer here."""
from __future__ import annotations

import ast
import os

import coordl

ROOT = os.path.dirname(os.path.abspath(coordl.__file__))

# Bottom first.  A module belongs to the first entry that is it or a package
# holding it.
LAYERS = [
    ("base", ["coordl.errors", "coordl.stats", "coordl.plan", "coordl.protocol", "coordl._rng",
              "coordl.base", "coordl.synth"]),
    ("storage, decode", ["coordl.storage", "coordl._remote", "coordl.decode"]),
    ("datasets, transforms", ["coordl.datasets", "coordl.transforms", "coordl.timmcompat", "coordl.subsets"]),
    ("cache", ["coordl.cache"]),
    ("device", ["coordl.device"]),
    ("pipeline", ["coordl.pipeline"]),
    ("sharing, peers", ["coordl.daemon", "coordl.peers", "coordl.tvcompat"]),
    ("loader", ["coordl.loader", "coordl"]),
    ("tools", ["coordl.accelerate", "coordl.analyze", "coordl.cli", "coordl.demo", "coordl.testing", "coordl.__main__"]),
]

# Cycles the code keeps, each with why (docs/architecture.md says the same).
ALLOWED_CYCLES: list[set[str]] = []


def modules(root: str, top: str = "coordl") -> dict[str, str]:
    """{dotted module name: path} of every .py file under ``root``."""
    out = {}
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for f in files:
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(d, f), root)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join([top] + rel)] = os.path.join(d, f)
    return out


def _type_checking_only(node: ast.AST) -> bool:
    t = node.test if isinstance(node, ast.If) else None
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports(mods: dict[str, str], typing: bool = True) -> dict[str, set[tuple[str, int]]]:
    """{module: {(imported coordl module, line)}}, lazy imports included;
    ``if TYPE_CHECKING:`` blocks too unless ``typing`` is false (they never
    run, but a module that needs another's types to be read sits above it: a
    circle through them is a circle for the reader and for the layers)."""
    out = {}
    for mod, path in mods.items():
        is_pkg = path.endswith("__init__.py")
        pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        skip = set() if typing else {id(n) for top in ast.walk(tree) if isinstance(top, ast.If)
                                     and _type_checking_only(top) for n in ast.walk(top) if n is not top}
        found = set()
        for n in ast.walk(tree):
            if id(n) in skip:
                continue
            if isinstance(n, ast.Import):
                found |= {(a.name, n.lineno) for a in n.names}
            elif isinstance(n, ast.ImportFrom):
                base = n.module.split(".") if n.level == 0 else (
                    pkg[:len(pkg) - n.level + 1] + (n.module.split(".") if n.module else []))
                target = ".".join(base)
                for a in n.names:
                    sub = f"{target}.{a.name}"
                    found.add((sub if sub in mods else target, n.lineno))
        out[mod] = {(t, line) for t, line in found if t in mods}
    return out


def layer_of(mod: str) -> int | None:
    for i, (_, members) in enumerate(LAYERS):
        for m in members:
            if mod == m or (m != "coordl" and mod.startswith(m + ".")):
                return i
    return None


def upward(graph) -> list[str]:
    bad = []
    for mod, targets in sorted(graph.items()):
        for t, line in sorted(targets):
            if layer_of(t) > layer_of(mod):
                bad.append(f"{mod} (layer {LAYERS[layer_of(mod)][0]!r}) imports {t} (layer "
                           f"{LAYERS[layer_of(t)][0]!r}) at line {line}")
    return bad


def cycles(graph) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    edges = {m: sorted({t for t, _ in ts if t != m}) for m, ts in graph.items()}
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_layer():
    missing = [m for m in modules(ROOT) if layer_of(m) is None]
    assert not missing, f"give these modules a layer in LAYERS (and docs/architecture.md's map): {missing}"


def test_imports_run_down_the_layers():
    bad = upward(imports(modules(ROOT)))
    assert not bad, "imports that run up a layer:\n" + "\n".join(bad)


def test_no_import_cycles():
    found = [c for c in cycles(imports(modules(ROOT))) if c not in ALLOWED_CYCLES]
    assert not found, f"import cycles: {found}"


def test_the_checks_see_an_upward_import_and_a_cycle(tmp_path):
    """The checks above can fail: a planted upward import (lazy, inside a
    function), a planted cycle, and a cycle made only by a type-checking
    import, inside one package, are all reported."""
    pkg = tmp_path / "coordl"
    (pkg / "cache").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "cache" / "__init__.py").write_text("")
    (pkg / "cache" / "node.py").write_text("def f():\n    from ..loader import DataLoader\n")
    (pkg / "loader.py").write_text("from .cache import node\nfrom typing import TYPE_CHECKING\n"
                                   "if TYPE_CHECKING:\n    from . import cli\n")
    (pkg / "cli.py").write_text("from . import loader\n")
    (pkg / "daemon").mkdir()
    (pkg / "daemon" / "__init__.py").write_text("")
    (pkg / "daemon" / "hub.py").write_text("from .pool import Pools\n")
    (pkg / "daemon" / "pool.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                            "    from .hub import Res\n")
    graph = imports(modules(str(pkg)))
    assert graph["coordl.loader"] == {("coordl.cache.node", 1), ("coordl.cli", 4)}
    assert imports(modules(str(pkg)), typing=False)["coordl.loader"] == {("coordl.cache.node", 1)}
    assert upward(graph) == ["coordl.cache.node (layer 'cache') imports coordl.loader (layer 'loader') at line 2",
                             "coordl.loader (layer 'loader') imports coordl.cli (layer 'tools') at line 4"]
    assert sorted(map(sorted, cycles(graph))) == [["coordl.cache.node", "coordl.cli", "coordl.loader"],
                                                  ["coordl.daemon.hub", "coordl.daemon.pool"]]


def test_the_daemons_hub_and_the_command_line_never_import_torch(tmp_path):
    """``import coordl`` imports its public names on first use, so the
    daemon's hub process and ``coordl`` commands start without torch (seconds
    of CPU and hundreds of MB each); the names are all there when used, and
    ``coordl.plan`` stays the function whatever imports the module of that name;
    a dataset's code identity does not depend on which names a process used
    (a job uses some, the daemon's workers none)."""
    import subprocess
    import sys

    code = ("import sys, coordl, coordl.cli, coordl.daemon.server\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n"
            f"sys.path.insert(0, {str(tmp_path)!r})\n"
            "from coordl.daemon.codeid import code_identity\n"
            "import userds\n"
            "before = code_identity(userds.D())\n"
            "from coordl import *\n"
            "import coordl.plan, coordl.loader\n"
            "from coordl.plan import EpochPlan as E\n"
            "assert callable(coordl.plan) and coordl.plan.__module__ == 'coordl.plan', coordl.plan\n"
            "assert plan is coordl.plan and E is coordl.EpochPlan and DataLoader is coordl.loader.DataLoader\n"
            "assert set(coordl.__all__) <= set(dir(coordl))\n"
            "assert all(getattr(coordl, n) is not None for n in coordl.__all__)\n"
            "assert code_identity(userds.D()) == before  # (a daemon worker uses none of them)\n"
            "try:\n    coordl.no_such_name\nexcept AttributeError:\n    pass\nelse:\n    raise AssertionError\n")
    (tmp_path / "userds.py").write_text("import coordl\n\n\nclass D:\n    def f(self):\n        return coordl\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
