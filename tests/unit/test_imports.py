"""The package's imports: no module imports itself round a cycle, and each imports on its own.

The cycle check is static: every module under irdmafs/ is parsed with ``ast`` and every import
in it counts, wherever it stands (under ``if TYPE_CHECKING:``, in a function: a cycle put off
until run time or hidden from it is still a cycle of the design). ``from X import Y`` is an edge
to module ``X.Y`` when that is a module, else to ``X`` (a package: its ``__init__``).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "irdmafs"
# what some modules need that is optional, and is not installed on every machine
OPTIONAL = ("pyverbs", "torch")


def modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the package (a package by its ``__init__``)."""
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that module ``name`` imports, anywhere in it."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else target)
    out = set()
    for target in found:
        # ``import irdmafs.a.b`` names a module; an unknown tail is an attribute of one
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target.split(".")[0] == PACKAGE and target != name:
            out.add(target)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of two or more modules (Tarjan), each as a cycle through
    them found by a walk that stays inside the set."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_a_cycle(graph, set(c)) for c in components]


def _a_cycle(graph: dict[str, set[str]], members: set[str]) -> list[str]:
    """One cycle through the first member of a strongly connected set (a shortest one)."""
    start = min(members)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return sorted(members)


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_relative_imports_resolve_to_modules_and_packages(tmp_path):
    known = {"irdmafs", "irdmafs.server", "irdmafs.server.node", "irdmafs.server.meta", "irdmafs.cluster", "irdmafs.transport"}
    src = tmp_path / "node.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import meta\n"
        "from ..cluster import NodeDown\n"
        "import irdmafs.transport.base\n"
        "if TYPE_CHECKING:\n"
        "    from .. import server\n"
    )
    assert imports_of("irdmafs.server.node", src, known) == {"irdmafs.server.meta", "irdmafs.cluster", "irdmafs.transport", "irdmafs.server"}


def test_no_module_imports_itself_round_a_cycle():
    mods = modules()
    graph = {name: imports_of(name, path, set(mods)) for name, path in mods.items()}
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


# Run in one fresh interpreter: each module imported alone, with every irdmafs module (and
# nothing else) dropped from sys.modules before the next, so each finds what it needs itself.
_IMPORT_EACH = """
import importlib, json, sys, traceback
out = {}
for name in json.loads(sys.argv[1]):
    for loaded in [m for m in sys.modules if m == "irdmafs" or m.startswith("irdmafs.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
        out[name] = None
    except ImportError as exc:
        out[name] = [getattr(exc, "name", None) or "", traceback.format_exc()]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def imported_alone() -> dict:
    """Module -> None if it imported on its own, else [the module missing, the traceback]."""
    names = sorted(modules())
    # two interpreters at once, every other module each (9 s in one on 2026-12-03)
    procs = [
        subprocess.Popen([sys.executable, "-c", _IMPORT_EACH, json.dumps(names[i::2])], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        for i in range(2)
    ]
    out = {}
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        out.update(json.loads(stdout.splitlines()[-1]))
    return out


@pytest.mark.parametrize("name", sorted(modules()))
def test_every_module_imports_on_its_own(name, imported_alone):
    failure = imported_alone[name]
    if failure is None:
        return
    missing, tb = failure
    if missing.split(".")[0] in OPTIONAL:
        pytest.skip(f"{name} needs {missing}, an optional package not installed here")
    pytest.fail(f"{name} does not import on its own:\n{tb}")


def reached(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` loads, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for w in graph[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    return seen


def test_client_and_server_share_only_what_is_pure_and_a_node_loads_no_client_code():
    """The two sides meet in modules both import (irdmafs.policy, the value types of the RPC
    edge), never in each other's packages: a node process loads nothing of irdmafs.client (it
    did, through metrics.py), and the client nothing of irdmafs.server (it took the policies
    from there)."""
    mods = modules()
    graph = {name: imports_of(name, path, set(mods)) for name, path in mods.items()}
    node = reached(graph, "irdmafs.server.node")
    assert not {m for m in node if m.startswith("irdmafs.client")}, sorted(m for m in node if m.startswith("irdmafs.client"))
    client = set().union(*(reached(graph, m) | {m} for m in mods if m.startswith("irdmafs.client")))
    assert not {m for m in client if m.startswith("irdmafs.server")}, sorted(m for m in client if m.startswith("irdmafs.server"))


# The floors of the package, bottom up, and what each may import besides itself (docs/design.md's
# module map): the shared vocabulary at the top level, the transport and the coordination service
# on it, the cluster runtime on those, the client and the server side by side on the runtime, the
# file system on the client, the launchers on everything. The worker's side stands apart: a
# training process imports it and nothing of the cluster.
VOCABULARY = "vocabulary"
MAY_IMPORT = {
    VOCABULARY: set(),
    "irdmafs.transport": {VOCABULARY},
    "irdmafs.coord": {VOCABULARY},
    "irdmafs.runtime": {VOCABULARY, "irdmafs.transport", "irdmafs.coord"},
    "irdmafs.client": {VOCABULARY, "irdmafs.transport", "irdmafs.coord", "irdmafs.runtime"},
    "irdmafs.server": {VOCABULARY, "irdmafs.transport", "irdmafs.coord", "irdmafs.runtime"},
    "irdmafs.fs": {VOCABULARY, "irdmafs.transport", "irdmafs.coord", "irdmafs.runtime", "irdmafs.client"},
    "irdmafs.worker": {VOCABULARY},
    "irdmafs.launch": {VOCABULARY, "irdmafs.transport", "irdmafs.coord", "irdmafs.runtime", "irdmafs.client", "irdmafs.server", "irdmafs.fs"},
}
# the faces users import by their old names: each is the worker's module itself (sys.modules)
FACES = {"irdmafs.torch": "irdmafs.worker", "irdmafs.steps": "irdmafs.worker", "irdmafs.__main__": "irdmafs.launch"}


def floor_of(name: str) -> str:
    parts = name.split(".")
    if len(parts) > 1 and ".".join(parts[:2]) in MAY_IMPORT:
        return ".".join(parts[:2])
    return VOCABULARY


def test_no_module_imports_one_from_a_floor_above_it():
    mods = modules()
    wrong = []
    for name, path in mods.items():
        if name == PACKAGE:
            continue
        floor = floor_of(name)
        for target in imports_of(name, path, set(mods)):
            if target == PACKAGE:
                continue
            to = floor_of(target)
            if to != floor and to not in MAY_IMPORT[floor] and FACES.get(name) != to:
                wrong.append(f"{name} ({floor}) imports {target} ({to})")
    assert not wrong, "imports up or across a floor:\n" + "\n".join(wrong)


def test_the_floor_rule_catches_an_import_up(tmp_path):
    src = tmp_path / "etcd.py"
    src.write_text("from ..launch.local import free_ports\n")
    known = {"irdmafs.coord.etcd", "irdmafs.launch.local", "irdmafs.launch"}
    targets = imports_of("irdmafs.coord.etcd", src, known)
    assert targets == {"irdmafs.launch.local"}
    assert floor_of("irdmafs.launch.local") not in MAY_IMPORT[floor_of("irdmafs.coord.etcd")]


def test_pure_modules_import_no_transport_and_no_trio():
    """A module whose docstring says it is pure (no I/O) imports neither the transport nor trio:
    the errors it raises come from irdmafs/errors.py."""
    mods = modules()
    wrong = []
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        doc = ast.get_docstring(tree) or ""
        if not ("Pure" in doc or doc.startswith("pure")):
            continue
        targets = imports_of(name, path, set(mods))
        raw = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        raw |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
        if any(t.startswith("irdmafs.transport") for t in targets) or any(r.split(".")[0] == "trio" for r in raw):
            wrong.append(name)
    assert not wrong, "pure modules that import the transport or trio: " + ", ".join(sorted(wrong))
