"""The package layout of docs/layout.md: imports point one way down the stages, and no modules import each other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "draftlab"

# Each package and what it may import (besides itself); docs/layout.md's table.
SHARED = {"config", "base", "data", "losses", "procs", "progress", "shipped"}
ALLOWED = {
    **{m: set() for m in SHARED},
    "decode": SHARED,
    "drafters": {"decode"} | SHARED,
    "interop": {"drafters", "decode"} | SHARED,
    "serve": {"interop", "drafters", "decode"} | SHARED,
    "train": {"interop", "drafters", "decode"} | SHARED,
    "parallel": {"serve", "interop", "drafters", "decode"} | SHARED,
    "eval": {"serve", "interop", "drafters", "decode"} | SHARED,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The draftlab modules a file imports (at any depth of the file: lazy imports count too)."""
    mod = module_name(path)
    package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n for n in names if n.startswith("draftlab")}
    return found


MODULES = {module_name(p): p for p in PKG.rglob("*.py")}
GRAPH = {m: {t for t in imports(p) if t in MODULES and t != m} for m, p in MODULES.items()}


def stage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_layout_is_what_the_docs_say():
    stages = {stage(m) for m in MODULES} - {"", "cli"}
    assert stages == set(ALLOWED), "a package was added or removed: update ALLOWED and docs/layout.md"


@pytest.mark.parametrize("pkg", sorted(ALLOWED))
def test_imports_point_down_the_stages(pkg):
    wrong = sorted(f"{m} imports {t}" for m, ts in GRAPH.items() if stage(m) == pkg for t in ts
                   if stage(t) not in ALLOWED[pkg] | {pkg, ""})
    assert not wrong, "imports against docs/layout.md's arrows:\n" + "\n".join(wrong)


def test_no_module_imports_the_cli():
    assert not [m for m, ts in GRAPH.items() if stage(m) != "cli" for t in ts if stage(t) == "cli"]


def test_no_import_circles():
    """No set of modules import each other (Tarjan's strongly connected components)."""
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not circles, f"modules that import each other: {circles}"
