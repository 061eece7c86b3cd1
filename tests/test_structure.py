"""The package's structure, drawn from its imports by ``ast`` (nothing is imported): no import circle, every import
follows the ranks of the layout, top-level modules are leaves, no module over 600 lines, and the CLI / bench stacks
(typer, rich, tqdm, safetensors, matplotlib) never imported at module level outside ``cli`` and ``bench``.

Ranks (a module imports modules of its own package or of a lower rank; function-local imports count and obey the
same rule; the lazy ``_EXPORTS`` of ``sparse_mla/__init__.py`` are exempt):

    top-level modules (leaves) 0 < union, workloads 1 < mqa 2 < layer, integration, distributed 3 < bench 4 < cli 5

Checked on the committed files (``testlib.paths.package_files``).
"""

from __future__ import annotations

import ast
from pathlib import Path

from testlib.paths import PACKAGE, package_files

PKG = "sparse_mla"
RANKS = {"union": 1, "workloads": 1, "mqa": 2, "layer": 3, "integration": 3, "distributed": 3, "bench": 4, "cli": 5,
         "__main__": 5}
OPTIONAL = {"typer", "rich", "tqdm", "safetensors", "matplotlib"}
OPTIONAL_OK = ("cli", "bench")
MAX_LINES = 600


def _name(f: Path) -> str:
    parts = [PKG, *f.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module):
    """(import node, local) for every import; local: inside a function (runs on first use, not at import time)."""
    def rec(nodes, local):
        for n in nodes:
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                yield n, local
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from rec(ast.iter_child_nodes(n), True)
            elif isinstance(n, ast.If) and isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING":
                continue
            else:
                yield from rec(ast.iter_child_nodes(n), local)
    yield from rec(tree.body, False)


def _targets(mod: str, is_pkg: bool, node, modules: set[str]) -> list[str]:
    """The package modules one import statement names (``from . import x`` names module x where it exists)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
    return subs + ([target] if len(subs) < len(node.names) else [])


def _nearest(name: str, modules: set[str]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _graph():
    files = {_name(f): f for f in package_files()}
    modules = set(files)
    edges, lines, optional = {}, {}, []
    for mod, f in files.items():
        src = f.read_text()
        lines[mod] = src.count("\n")
        tree = ast.parse(src)
        edges[mod] = {}
        for node, local in _imports(tree):
            for t in _targets(mod, f.name == "__init__.py", node, modules):
                head = t.split(".")[0]
                if head in OPTIONAL and not local and not mod[len(PKG) + 1:].startswith(OPTIONAL_OK):
                    optional.append(f"{mod}:{node.lineno} imports {t}")
                target = _nearest(t, modules) if head == PKG else None
                if target and target != mod:
                    edges[mod][target] = edges[mod].get(target, True) and local
        if f.name == "__init__.py":  # lazy exports: module paths as strings
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(PKG + "."):
                    target = _nearest(node.value, modules)
                    if target and target != mod:
                        edges[mod].setdefault(target, True)
    return modules, edges, lines, optional


def _rank(mod: str) -> int | None:
    sub = mod[len(PKG) + 1:]
    top = sub.split(".")[0]
    if top in RANKS:
        return RANKS[top]
    return 0 if "." not in sub else None


def _packages(modules: set[str]) -> set[str]:
    return {m for m in modules if any(o.startswith(m + ".") for o in modules)}


def _home(mod: str, packages: set[str]) -> str:
    """The subpackage a module belongs to ("" = a top-level module)."""
    sub = mod[len(PKG) + 1:]
    return sub.split(".")[0] if "." in sub or mod in packages else ""


def _circles(modules, edges) -> list[list[str]]:
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                strong(w)
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
                out.append(sorted(comp))
    for v in sorted(modules):
        if v not in index:
            strong(v)
    return out


def test_no_import_circle():
    """No circle over all imports, function-local ones included (they only hide a circle)."""
    modules, edges, _, _ = _graph()
    assert _circles(modules, edges) == []


def test_imports_follow_the_ranks():
    modules, edges, _, _ = _graph()
    packages = _packages(modules)
    against = []
    for mod in sorted(modules):
        if mod == PKG:
            continue  # the lazy top-level exports
        for target in sorted(edges[mod]):
            if target == PKG:
                continue
            rm, rt = _rank(mod), _rank(target)
            hm, ht = _home(mod, packages), _home(target, packages)
            if rm is None or rt is None:
                against.append(f"{mod} -> {target} (a package not in RANKS)")
            elif rt > rm or (rt == rm and hm != ht and not (hm == ht == "")):
                star = "*" if edges[mod][target] else ""
                against.append(f"{mod} -> {target}{star} (rank {rm} -> {rt})")
    assert against == []


def test_top_level_modules_are_leaves():
    """A top-level module imports no subpackage, at module level or inside a function."""
    modules, edges, _, _ = _graph()
    packages = _packages(modules)
    nonleaf = [f"{mod} -> {t}" for mod in sorted(modules)
               if mod.count(".") == 1 and mod not in packages and _rank(mod) == 0
               for t in sorted(edges[mod]) if _home(t, packages) != ""]
    assert nonleaf == []


def test_no_module_over_600_lines():
    _, _, lines, _ = _graph()
    assert {m: n for m, n in lines.items() if n > MAX_LINES} == {}


def test_cli_and_bench_stacks_stay_out_of_the_core():
    """typer, rich, tqdm, safetensors and matplotlib are imported at module level only by cli and bench
    (tests/test_core_install.py imports the core and runs a kernel with them blocked)."""
    _, _, _, optional = _graph()
    assert optional == []


def test_the_graph_sees_the_package():
    """The checks above look at something: every subpackage in RANKS but cli is a package with modules."""
    modules, edges, _, _ = _graph()
    for sub in RANKS:
        if sub not in ("cli", "__main__"):
            assert f"{PKG}.{sub}" in modules and any(m.startswith(f"{PKG}.{sub}.") for m in modules), sub
    assert sum(len(e) for e in edges.values()) > 100
