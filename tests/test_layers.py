"""The packages' layers hold: no upward import, no private name taken across packages, no circle.

Layers, bottom to top (``../shared/DESIGN.md``, "Packages"): ``treeattn`` (1), the ``specdec``
library (2: everything under ``specdec/`` but ``specdec/cli``), ``drafters`` (3), ``eval`` (4),
``training`` (5), the command line ``specdec.cli`` (6). Every ``.py`` file under those folders and
under ``scripts/`` is parsed with :mod:`ast` (never imported) and every import in it, at module
level or inside a function, is checked:

(a) a package module imports nothing from a higher layer (scripts may import any layer);
(b) no file imports a private name -- a ``_name`` module or object -- of another package (the
    six layers are the packages here: ``specdec.cli`` is another package than the ``specdec``
    library; each script is a package of its own);
(c) the package modules' imports form no circle (``a`` imports ``b`` when ``a``'s source has an
    import of ``b`` or of a name defined in ``b``; a package's ``__init__`` runs on import of
    its submodules, but that implicit edge is not counted).

A failure names every offending import as ``file:line`` and what it imports.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: top-level folders of importable package code, checked for (a), (b) and (c)
PACKAGES = ("treeattn", "specdec", "drafters", "eval", "training")
#: folders of runnable entry points, checked for (b) only
SCRIPTS = ("scripts",)
#: (module prefix, layer), most specific first
LAYERS = (("specdec.cli", 6), ("training", 5), ("eval", 4), ("drafters", 3), ("specdec", 2), ("treeattn", 1))


@dataclass(frozen=True)
class Import:
    """One first-party import: ``file:line`` of ``importer`` takes ``name`` (None: the module itself)
    from ``module``."""

    importer: str
    path: str
    line: int
    module: str
    name: str | None

    def __str__(self) -> str:
        what = self.module if self.name is None else f"{self.module}.{self.name}"
        return f"{self.path}:{self.line}: {self.importer} imports {what}"


def _layer(module: str) -> int | None:
    for prefix, layer in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return None


def _package(module: str) -> str:
    """The package a first-party module belongs to for rule (b): its layer's prefix (a script: itself)."""
    for prefix, _ in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return prefix
    return module


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _files(root: Path, folders: tuple[str, ...]) -> Iterator[Path]:
    for folder in folders:
        yield from sorted((root / folder).rglob("*.py"))


def _imports(root: Path, path: Path, modules: set[str]) -> Iterator[Import]:
    """The imports of first-party modules in ``path`` (every one, at any depth of the file)."""
    rel = path.relative_to(root).as_posix()
    importer = _module_name(root, path)
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=rel)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PACKAGES:
                    yield Import(importer, rel, node.lineno, alias.name, None)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the importer's package
                base = importer.split(".") if is_package else importer.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                if alias.name == "*":
                    yield Import(importer, rel, node.lineno, source, None)
                elif f"{source}.{alias.name}" in modules:  # a submodule
                    yield Import(importer, rel, node.lineno, f"{source}.{alias.name}", None)
                else:
                    yield Import(importer, rel, node.lineno, source, alias.name)


def _cycles(edges: dict[str, dict[str, Import]]) -> list[list[Import]]:
    """One circle of imports per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
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
                components.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    out = []
    for comp in components:  # a shortest circle through the component's first module (breadth first)
        members, start = set(comp), comp[0]
        came: dict[str, Import] = {}
        frontier = [start]
        while frontier and start not in came:
            nxt = []
            for v in frontier:
                for w, imp in sorted(edges.get(v, {}).items()):
                    if w in members and w not in came:
                        came[w] = imp
                        nxt.append(w)
            frontier = nxt
        path, at = [], start
        while True:
            imp = came[at]
            path.append(imp)
            at = imp.importer
            if at == start:
                break
        out.append(path[::-1])
    return out


def violations(root: Path = ROOT) -> list[str]:
    """Every broken rule under ``root``, one line each (``file:line: ...``)."""
    package_files = list(_files(root, PACKAGES))
    modules = {_module_name(root, p) for p in package_files}
    found: list[str] = []
    edges: dict[str, dict[str, Import]] = {}
    for path in package_files + list(_files(root, SCRIPTS)):
        is_script = path.relative_to(root).parts[0] in SCRIPTS
        for imp in _imports(root, path, modules):
            here, there = _layer(imp.importer), _layer(imp.module)
            if not is_script and here is not None and there is not None and there > here:
                found.append(f"{imp}: layer {there} imported from layer {here} (upward)")
            private = [p for p in imp.module.split(".") + ([imp.name] if imp.name else []) if _private(p)]
            if private and _package(imp.module) != (imp.importer if is_script else _package(imp.importer)):
                found.append(f"{imp}: a private name ({private[0]}) of another package")
            if not is_script:
                target = imp.module if imp.module in modules else None
                if target is not None and target != imp.importer:
                    edges.setdefault(imp.importer, {}).setdefault(target, imp)
    for circle in _cycles(edges):
        found.append("circle: " + " -> ".join(imp.importer for imp in circle) + f" -> {circle[0].importer} ("
                     + "; ".join(f"{imp.path}:{imp.line}" for imp in circle) + ")")
    return found


def test_the_layers_hold():
    found = violations()
    assert not found, f"{len(found)} import(s) break the layers (../shared/DESIGN.md, Packages):\n" + "\n".join(found)


def _plant(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))


def test_the_checker_finds_planted_breaks(tmp_path):
    """An upward import, a private import across packages and a circle, at module level and inside
    functions, are each reported with file:line; the same imports within the rules are not."""
    _plant(tmp_path, {
        "treeattn/__init__.py": "",
        "treeattn/ops.py": "def _launch(): pass\n",
        "specdec/__init__.py": "",
        "specdec/engine.py": "from specdec import kv\nimport treeattn.ops\n\n\ndef f():\n    from drafters import lookup\n",
        "specdec/kv.py": "def g():\n    import specdec.engine\n",
        "specdec/graphs.py": "class _Replayed: pass\n",
        "specdec/cli/__init__.py": "from specdec.graphs import _Replayed\nimport training.medusa\n",
        "specdec/cli/args.py": "",
        "drafters/__init__.py": "",
        "drafters/lookup.py": "from specdec.graphs import _Replayed\nfrom ._build import x\n",
        "drafters/_build.py": "x = 1\n",
        "eval/__init__.py": "from eval import datasets\n",
        "eval/datasets.py": "",
        "training/__init__.py": "",
        "training/medusa.py": "from eval.datasets import *\nfrom specdec.cli import args\n",
        "scripts/profile.py": "from treeattn.ops import _launch\nimport specdec.cli\nfrom specdec.cli import train\n",
    })  # fmt: skip
    found = violations(tmp_path)
    assert sorted(found) == sorted([
        "specdec/engine.py:6: specdec.engine imports drafters.lookup: layer 3 imported from layer 2 (upward)",
        "training/medusa.py:2: training.medusa imports specdec.cli.args: layer 6 imported from layer 5 (upward)",
        "drafters/lookup.py:1: drafters.lookup imports specdec.graphs._Replayed: a private name (_Replayed) of "
        "another package",
        "specdec/cli/__init__.py:1: specdec.cli imports specdec.graphs._Replayed: a private name (_Replayed) of "
        "another package",
        "scripts/profile.py:1: scripts.profile imports treeattn.ops._launch: a private name (_launch) of another "
        "package",
        "circle: specdec.engine -> specdec.kv -> specdec.engine (specdec/engine.py:1; specdec/kv.py:2)",
    ]), "\n".join(found)  # fmt: skip
    # a three-module circle through function-level imports, in another layer
    _plant(tmp_path, {"specdec/kv.py": "", "eval/a.py": "def f():\n    from eval import b\n",
                      "eval/b.py": "import eval.c\n", "eval/c.py": "def g():\n    from eval.a import f\n"})  # fmt: skip
    circles = [line for line in violations(tmp_path) if line.startswith("circle")]
    assert circles == ["circle: eval.a -> eval.b -> eval.c -> eval.a (eval/a.py:2; eval/b.py:1; eval/c.py:2)"]
