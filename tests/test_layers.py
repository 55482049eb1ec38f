"""The layers a reader can see, checked on the source: the engine (``fedmf/``) imports none of its
adapters (``server/``, ``client/``, ``launcher/``) nor Flower or Ray, argparse only in its CLI
(``fedmf.cli``), the layers below policy import none above them (``LAYERS``: the ledger stores and
queries, and imports no accounting, audit or budget policy), and no import cycle joins the project's
modules.

Every ``.py`` file of the packages ``fedmf``, ``server``, ``client`` and ``launcher`` is parsed
with ``ast`` (nothing is imported). An import is any ``import``/``from ... import`` statement,
at module level or inside a function or class (lazy imports count), and any string literal given
to ``importlib.import_module`` / ``__import__``; relative imports are resolved against the
module's package. ``from pkg import name`` is an edge to ``pkg`` (its ``__init__`` runs first)
and to the submodule ``pkg.name`` when there is one: so a module that ``fedmf/__init__`` imports
writes ``from .checks import number``, not ``from . import checks``. The graph counts what Python
runs: importing ``a.b.c`` (``import a.b.c``, ``from a.b.c import x``, ``from a.b import c``) runs
``a/__init__`` and ``a/b/__init__`` first, so it is also an edge to every parent package of the
imported module, except the importer's own packages (they are already being imported when the
importer runs, so the import does not run them). Imports under
``if TYPE_CHECKING:`` never run: they are left out of the cycle check (a type-only back-reference
is allowed), but the engine may not name an adapter even there.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fedmf", "server", "client", "launcher")
#: what no module under fedmf may import (top-level names)
FORBIDDEN_IN_ENGINE = ("flwr", "ray", "server", "client", "launcher")
#: package → what none of its modules may import (module names and their submodules), lazily neither
LAYERS: dict[str, tuple[str, ...]] = {
    "fedmf.ledger": ("fedmf.accounting", "fedmf.audit", "fedmf.budgets"),  # storage below policy
}


def _cycles(edges: dict[str, set[str]] | dict[str, dict[str, int]]) -> set[frozenset[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: set[frozenset[str]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.add(frozenset(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """{dotted module name: file} of every module of the project's packages."""
    out = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            out[_module_name(path, root)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve(module: str | None, level: int, importer: str, is_package: bool) -> str:
    """The absolute name of ``from <level dots><module> import ...`` in ``importer``."""
    if level == 0:
        return module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imports_of(name: str, path: Path, modules: set[str]) -> list[tuple[str, int, bool]]:
    """(imported module, line, under TYPE_CHECKING) for every import in the file of module ``name``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    found: list[tuple[str, int, bool]] = []

    def target(absolute: str, names: list[str]) -> list[str]:
        return [absolute] + [f"{absolute}.{n}" for n in names if f"{absolute}.{n}" in modules]

    def visit(node: ast.AST, typing_only: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, typing_only)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno, typing_only) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            absolute = _resolve(node.module, node.level, name, is_package)
            for dotted in target(absolute, [alias.name for alias in node.names if alias.name != "*"]):
                found.append((dotted, node.lineno, typing_only))
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if called in ("import_module", "__import__") and node.args and \
                    isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                text = node.args[0].value
                level = len(text) - len(text.lstrip("."))
                found.append((_resolve(text[level:] or None, level, name, is_package), node.lineno, typing_only))
        for child in ast.iter_child_nodes(node):
            visit(child, typing_only)

    visit(tree, False)
    return found


def engine_violations(root: Path = ROOT) -> list[str]:
    """'module:line imports X' for every import of a forbidden top-level name by a module of fedmf."""
    modules = project_modules(root)
    out = []
    for name, path in modules.items():
        if name.split(".")[0] != "fedmf":
            continue
        for imported, line, _ in imports_of(name, path, set(modules)):
            if imported.split(".")[0] in FORBIDDEN_IN_ENGINE:
                out.append(f"{name}:{line} imports {imported}")
    return out


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def layer_violations(root: Path = ROOT, layers: dict[str, tuple[str, ...]] = LAYERS) -> list[str]:
    """'module:line imports X' for every import that ``layers`` forbids its package."""
    modules = project_modules(root)
    out = []
    for name, path in modules.items():
        for package, forbidden in layers.items():
            if not _within(name, package):
                continue
            for imported, line, _ in imports_of(name, path, set(modules)):
                if any(_within(imported, f) for f in forbidden):
                    out.append(f"{name}:{line} imports {imported}")
    return out


def cli_only_violations(root: Path = ROOT) -> list[str]:
    """'module:line imports argparse' for every engine module outside ``fedmf.cli`` that imports it."""
    modules = project_modules(root)
    out = []
    for name, path in modules.items():
        if name.split(".")[0] != "fedmf" or name == "fedmf.cli" or name.startswith("fedmf.cli."):
            continue
        for imported, line, _ in imports_of(name, path, set(modules)):
            if imported.split(".")[0] == "argparse":
                out.append(f"{name}:{line} imports {imported}")
    return out


def runs(imported: str, importer: str) -> list[str]:
    """The modules an import of ``imported`` by ``importer`` runs: the parent packages of ``imported``,
    outermost first, then ``imported``; less ``importer``'s own packages (already being imported)."""
    parts = imported.split(".")
    own = importer.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts)) if parts[:i] != own[:i]] + [imported]


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """{module: {project module it runs by an import at run time: first line}} (TYPE_CHECKING imports left
    out; an imported module's parent packages included, ``runs``)."""
    modules = project_modules(root)
    graph: dict[str, dict[str, int]] = {name: {} for name in modules}
    for name, path in modules.items():
        for imported, line, typing_only in imports_of(name, path, set(modules)):
            if typing_only:
                continue
            for ran in runs(imported, name):
                if ran in modules and ran != name:
                    graph[name].setdefault(ran, line)
    return graph


def _describe(component: list[str], graph: dict[str, dict[str, int]]) -> str:
    members = set(component)
    edges = [f"{a}:{line} -> {b}" for a in component for b, line in sorted(graph[a].items()) if b in members]
    return f"cycle {component}: " + "; ".join(edges)


def test_the_engine_imports_no_adapter_nor_flower():
    """No module under fedmf/ imports flwr, ray, server, client or launcher (lazily neither)."""
    bad = engine_violations()
    assert not bad, "the engine imports an adapter:\n" + "\n".join(bad)


def test_storage_below_policy():
    """The ledger stores and queries: no module of fedmf.ledger imports the accountant, the audit or
    the budget policy (they read the ledger, never the other way)."""
    bad = layer_violations()
    assert not bad, "a layer imports one above it:\n" + "\n".join(bad)
    assert layer_violations(ROOT, {"fedmf.budgets": ("fedmf.ledger",)})  # the checker sees the real edges


def test_argparse_only_in_the_cli():
    """Command-line parsing belongs to fedmf.cli: the engine's errors name parameters, not flags."""
    assert cli_only_violations() == []
    assert any(name.startswith("fedmf.cli") and any(i == "argparse" for i, _, _ in imports_of(name, path, set()))
               for name, path in project_modules().items())


def test_no_import_cycle_among_the_projects_modules():
    graph = import_graph()
    assert len(graph) > 50 and "fedmf.tasks.base" in graph and "launcher.processes" in graph
    # the graph sees function-level, relative and parent-package imports on the real tree too: the CLI
    # imports the accountants' scheme table inside _load(), the accountant imports it at module level,
    # and the budget policy's import of fedmf.accounting.gdp runs fedmf/accounting/__init__
    assert "fedmf.accounting.schemes" in graph["fedmf.cli.accounting"]
    assert "fedmf.accounting.schemes" in graph["fedmf.accounting.accountant"]
    assert {"fedmf.accounting", "fedmf.accounting.gdp"} <= set(graph["fedmf.budgets"])
    assert "fedmf.mechanisms.io" in graph["fedmf.cli.mechanism"]
    found = sorted(sorted(c) for c in _cycles(graph))
    assert not found, "import cycles:\n" + "\n".join(_describe(c, graph) for c in found)


def test_the_checker_sees_lazy_relative_and_dynamic_imports(tmp_path):
    """The checker itself, on a planted tree: a lazy engine -> adapter import, a lazy relative
    cycle, an import_module string, a TYPE_CHECKING back-reference that is not a cycle, a cycle
    through a package's ``__init__`` (``from . import sub`` in a module the package imports), a
    cycle through the parent package an import of its submodule runs, and argparse outside the CLI."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "fedmf" / "a.py").write_text("def f():\n    from . import b\n    import server.app\n")
    (tmp_path / "fedmf" / "b.py").write_text("def g():\n    from .a import f\n")
    (tmp_path / "fedmf" / "c.py").write_text(
        "import importlib\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import X\n"
        "def h():\n    importlib.import_module('launcher.x')\n")
    (tmp_path / "fedmf" / "d.py").write_text("from fedmf import c\nX = 1\n")
    (tmp_path / "fedmf" / "sub").mkdir()
    (tmp_path / "fedmf" / "sub" / "__init__.py").write_text("from .e import E\n")
    (tmp_path / "fedmf" / "sub" / "e.py").write_text("from . import f\nE = 1\n")
    (tmp_path / "fedmf" / "sub" / "f.py").write_text("import argparse\n")
    (tmp_path / "fedmf" / "cli").mkdir()
    (tmp_path / "fedmf" / "cli" / "__init__.py").write_text("def main():\n    import argparse\n")
    (tmp_path / "server" / "app.py").write_text("")
    # a cycle only through a parent package: desc's lazy import of pkg.leaf runs pkg/__init__, which
    # imports pkg.factory, which imports desc; the same import under TYPE_CHECKING runs nothing
    (tmp_path / "fedmf" / "pkg").mkdir()
    (tmp_path / "fedmf" / "pkg" / "__init__.py").write_text("from .factory import make\n")
    (tmp_path / "fedmf" / "pkg" / "factory.py").write_text("from ..desc import D\nfrom .leaf import L\nmake = 1\n")
    (tmp_path / "fedmf" / "pkg" / "leaf.py").write_text("L = 1\n")
    (tmp_path / "fedmf" / "desc.py").write_text("D = 1\ndef f():\n    from .pkg.leaf import L\n")
    (tmp_path / "fedmf" / "typed.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .pkg.leaf import L\n")
    assert engine_violations(tmp_path) == ["fedmf.a:3 imports server.app", "fedmf.c:6 imports launcher.x"]
    assert cli_only_violations(tmp_path) == ["fedmf.sub.f:1 imports argparse"]
    graph = import_graph(tmp_path)
    assert graph["fedmf.a"] == {"fedmf": 2, "fedmf.b": 2, "server": 3, "server.app": 3}
    assert graph["fedmf.c"] == {"launcher": 6}  # import_module("launcher.x") runs launcher/__init__
    assert graph["fedmf.d"] == {"fedmf": 1, "fedmf.c": 1}
    assert graph["fedmf.desc"] == {"fedmf.pkg": 3, "fedmf.pkg.leaf": 3} and graph["fedmf.typed"] == {}
    assert graph["fedmf.pkg.factory"] == {"fedmf.desc": 1, "fedmf.pkg.leaf": 2}  # its own packages run already
    assert runs("a.b.c", "a.x") == ["a.b", "a.b.c"] and runs("a.b.c", "z") == ["a", "a.b", "a.b.c"]
    assert _cycles(graph) == {frozenset({"fedmf.a", "fedmf.b"}), frozenset({"fedmf.sub", "fedmf.sub.e"}),
                              frozenset({"fedmf.desc", "fedmf.pkg", "fedmf.pkg.factory"})}
    assert _describe(["fedmf.a", "fedmf.b"], graph) == \
        "cycle ['fedmf.a', 'fedmf.b']: fedmf.a:2 -> fedmf.b; fedmf.b:2 -> fedmf.a"
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {frozenset("abc")}
