"""Structure checks for the EdgeSync tree: import cycles, private names used across modules,
module and function sizes, and which packages import the storage library.

Run ``python tools/archcheck.py [--json]`` from the checkout; ``tests/test_architecture.py``
asserts the same rules. It reads the code as text (``ast``), imports nothing of it.

Rules (see docs/architecture.md):

* no import cycle among the project's modules, counting imports inside functions;
* no module uses an underscore name it does not define itself (``x._name`` where ``x`` is not
  ``self``/``cls``, or ``from m import _name`` from a project module), except inside
  ``edgesync_store/core/``, whose modules implement the store together;
* ``edgesync_engines`` never imports a storage library, ``lmdb`` or the remote tier's
  ``redis``/``valkey`` (:data:`STORAGE_LIBRARIES`; storage errors cross the seam as
  ``edgesync_store.errors`` types);
* library modules stay under :data:`MAX_MODULE_LINES` lines and functions under
  :data:`MAX_FUNCTION_LINES`, except those listed in :data:`LONG_FUNCTIONS` with the reason.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("edgesync_store", "edgesync_engines", "migrations", "benchmarks", "tools")
"""Top-level folders whose ``.py`` files are checked (tests are not library code)."""
LIBRARY = ("edgesync_store", "edgesync_engines", "migrations")
"""The packages the size rules apply to."""
PRIVATE_OK_DIRS: tuple[str, ...] = ()
"""Folders whose modules may use each other's underscore names (none: every class is whole)."""
STORAGE_LIBRARIES = ("lmdb", "redis", "valkey")
"""Client libraries only ``edgesync_store`` imports (``Report.lmdb_in_engines`` lists offenders)."""
MAX_MODULE_LINES = 420
MAX_FUNCTION_LINES = 80
LONG_FUNCTIONS: dict[str, str] = {}
"""``"path:function"`` -> why it must be longer than :data:`MAX_FUNCTION_LINES`."""
LIBRARY_PRIVATE_OK = {"_replace", "_asdict", "_fields", "_make", "_exit", "_getframe", "_MEIPASS"}
"""Underscore names that are public API of the standard library (namedtuple, os, sys)."""


@dataclass
class Report:
    """What :func:`check` found; every list empty means the tree passes."""

    modules: int = 0
    cycles: list[list[str]] = field(default_factory=list)
    private_uses: list[str] = field(default_factory=list)
    lmdb_in_engines: list[str] = field(default_factory=list)
    long_modules: list[str] = field(default_factory=list)
    long_functions: list[str] = field(default_factory=list)
    longest_function: str = ""
    longest_function_lines: int = 0

    def failures(self) -> dict[str, list]:
        """The rules that fail, by name (empty when the tree passes)."""
        named = {"import cycles": self.cycles, "private names used across modules": self.private_uses,
                 "lmdb or redis imported by edgesync_engines": self.lmdb_in_engines,
                 "modules over the line limit": self.long_modules,
                 "functions over the line limit": self.long_functions}
        return {k: v for k, v in named.items() if v}


def module_name(path: Path) -> str:
    """Dotted module name of a file below :data:`ROOT`."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files() -> list[Path]:
    """Every checked ``.py`` file, sorted."""
    files: list[Path] = []
    for pkg in PACKAGES:
        files.extend(p for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts)
    return sorted(files)


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(path: Path, tree: ast.AST, known: set[str]) -> set[str]:
    """Project modules that ``path`` imports anywhere (top level or inside functions)."""
    mod, is_pkg = module_name(path), path.name == "__init__.py"
    found: set[str] = set()

    def add(name: str) -> None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != mod:
            found.add(name)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(mod, is_pkg, node)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                add(full if full in known else base)
    return found


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _defined_private(tree: ast.AST) -> set[str]:
    """Underscore names a module defines: functions, classes, assignments, attributes it sets."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    return {n for n in names if n.startswith("_")}


def private_uses(path: Path, tree: ast.AST, known: set[str]) -> list[str]:
    """``file:line name`` for each underscore name used here but defined elsewhere."""
    rel = path.relative_to(ROOT).as_posix()
    if rel.startswith(PRIVATE_OK_DIRS):
        return []
    own = _defined_private(tree)
    mod, is_pkg = module_name(path), path.name == "__init__.py"
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            name = node.attr
            if (name.startswith("_") and not name.startswith("__") and name not in own
                    and name not in LIBRARY_PRIVATE_OK
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                hits.append(f"{rel}:{node.lineno} .{name}")
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(mod, is_pkg, node)
            if base.split(".")[0] in {k.split(".")[0] for k in known}:
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        hits.append(f"{rel}:{node.lineno} import {alias.name}")
    return hits


def check() -> Report:
    """Read the tree and apply every rule."""
    files = source_files()
    known = {module_name(p) for p in files}
    report = Report(modules=len(files))
    graph: dict[str, set[str]] = {}
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text, filename=rel)
        graph[module_name(path)] = imports_of(path, tree, known)
        report.private_uses.extend(private_uses(path, tree, known))
        if rel.startswith("edgesync_engines/"):
            for node in ast.walk(tree):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                if any(n.split(".")[0] in STORAGE_LIBRARIES for n in names):
                    report.lmdb_in_engines.append(f"{rel}:{node.lineno}")
        if not rel.startswith(LIBRARY):
            continue
        lines = text.count("\n") + 1
        if lines > MAX_MODULE_LINES:
            report.long_modules.append(f"{rel} {lines} lines")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                where = f"{rel}:{node.name}"
                if n > report.longest_function_lines:
                    report.longest_function, report.longest_function_lines = where, n
                if n > MAX_FUNCTION_LINES and where not in LONG_FUNCTIONS:
                    report.long_functions.append(f"{where} {n} lines")
    report.cycles = find_cycles(graph)
    return report


def main(argv: list[str] | None = None) -> int:
    """Print the figures and every failure; exit 1 when a rule fails."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    report = check()
    if args.json:
        print(json.dumps(report.__dict__, indent=2))
    else:
        print(f"modules checked: {report.modules}")
        print(f"import cycles: {len(report.cycles)}")
        print(f"private names used across modules: {len(report.private_uses)}")
        print(f"lmdb or redis imports in edgesync_engines: {len(report.lmdb_in_engines)}")
        print(f"longest function: {report.longest_function} ({report.longest_function_lines} lines)")
        for rule, items in report.failures().items():
            print(f"\n{rule}:")
            for item in items:
                print(f"  {item}")
    return 1 if report.failures() else 0


if __name__ == "__main__":
    sys.exit(main())
