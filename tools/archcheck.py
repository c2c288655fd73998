"""Structure checks for the EdgeSync tree: import cycles, private names used across modules,
function sizes, which packages import the storage library, library imports of benchmarks, tools or
tests, and classes assembled from mixins.

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
* the library (:data:`LIBRARY`) never imports benchmarks, tools or tests (:data:`NOT_LIBRARY`):
  no ``import``/``from`` anywhere in a module (inside functions too), and no
  ``importlib.import_module``/``__import__`` of a literal name;
* no library class is assembled from mixins in other modules (:func:`mixin_bases`): a base class
  defined in another project module must be an exception class, an abstract interface (an
  ``ABC``/``Protocol`` that declares abstract methods for the subclass to implement) or
  self-contained (every ``self.x`` its methods read it defines itself, or its own bases do); a
  base that reads attributes only its host defines, or whose name ends in ``Mixin``, is a mixin.
  A class lives whole in one module, however long: there is no module-size rule;
* library functions stay under :data:`MAX_FUNCTION_LINES` lines, except those listed in
  :data:`LONG_FUNCTIONS` with the reason.
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
"""Top-level folders whose ``.py`` files are checked."""
TEST_FOLDERS = ("tests", "benchmarks/tests")
"""Test folders, never checked (tests are not library code); ``benchmarks/tests`` lies in a checked folder."""
IMPORT_NAMES = {"migrations": "edgesync_store.migrations", "benchmarks": "edgesync_bench"}
"""Folders installed under another import name (``package-dir`` in the pyproject.toml files)."""
LIBRARY = ("edgesync_store", "edgesync_engines", "migrations")
"""The folders of the installed library (the ``edgesync`` wheel)."""
NOT_LIBRARY = ("edgesync_bench", "benchmarks", "tools", "tests")
"""Top-level import names the library must never import."""
IMPORT_FUNCTIONS = ("import_module", "__import__")
"""Calls whose literal first argument is an import (``importlib.import_module("x")``)."""
EXCEPTION_BASES = {"BaseException", "Exception"}
"""Builtin roots of exception classes; any builtin name ending in Error, Exception or Warning counts."""
PRIVATE_OK_DIRS: tuple[str, ...] = ()
"""Folders whose modules may use each other's underscore names (none: every class is whole)."""
STORAGE_LIBRARIES = ("lmdb", "redis", "valkey")
"""Client libraries only ``edgesync_store`` imports (``Report.lmdb_in_engines`` lists offenders)."""
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
    library_imports_outside: list[str] = field(default_factory=list)
    mixin_classes: list[str] = field(default_factory=list)
    long_functions: list[str] = field(default_factory=list)
    longest_function: str = ""
    longest_function_lines: int = 0

    def failures(self) -> dict[str, list]:
        """The rules that fail, by name (empty when the tree passes)."""
        named = {"import cycles": self.cycles, "private names used across modules": self.private_uses,
                 "lmdb or redis imported by edgesync_engines": self.lmdb_in_engines,
                 "library imports of benchmarks, tools or tests": self.library_imports_outside,
                 "classes assembled from mixins in other modules": self.mixin_classes,
                 "functions over the line limit": self.long_functions}
        return {k: v for k, v in named.items() if v}


def module_name(path: Path) -> str:
    """Dotted module name of a file below :data:`ROOT`."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    parts[0] = IMPORT_NAMES.get(parts[0], parts[0])
    return ".".join(parts)


def source_files() -> list[Path]:
    """Every checked ``.py`` file, sorted."""
    files: list[Path] = []
    for pkg in PACKAGES:
        files.extend(p for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts
                     and not any(p.is_relative_to(ROOT / t) for t in TEST_FOLDERS))
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


def imported_names(path: Path, tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of every import in ``path``, anywhere in it: ``import``, ``from``
    (relative ones resolved) and ``importlib.import_module``/``__import__`` of a literal."""
    mod, is_pkg = module_name(path), path.name == "__init__.py"
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, _resolve(mod, is_pkg, node)))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            arg = node.args[0]
            if name in IMPORT_FUNCTIONS and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.append((node.lineno, arg.value))
    return found


def outside_imports(path: Path, tree: ast.AST) -> list[str]:
    """``file:line name`` for each import of benchmarks, tools or tests (:data:`NOT_LIBRARY`)."""
    rel = path.relative_to(ROOT).as_posix()
    return [f"{rel}:{line} {name}" for line, name in imported_names(path, tree)
            if name.split(".")[0] in NOT_LIBRARY]


@dataclass
class ClassInfo:
    """What :func:`mixin_bases` needs of one class: where it is and what its methods use."""

    module: str
    node: ast.ClassDef
    imports: dict[str, str]
    """The defining module's imported names: local name -> dotted source (``"pkg.mod.Name"``)."""


def _module_imports(mod: str, is_pkg: bool, tree: ast.Module) -> dict[str, str]:
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(mod, is_pkg, node)
            for a in node.names:
                names[a.asname or a.name] = f"{base}.{a.name}"
    return names


def _dotted(expr: ast.expr) -> str:
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        inner = _dotted(expr.value)
        return f"{inner}.{expr.attr}" if inner else ""
    if isinstance(expr, ast.Subscript):  # Protocol[T], Generic[T]
        return _dotted(expr.value)
    return ""


def _lookup(classes: dict[str, ClassInfo], modules: dict[str, dict[str, str]], dotted: str,
            depth: int = 0) -> ClassInfo | None:
    """The project class ``pkg.mod.Name`` names, following re-exports (``from x import Name`` in a
    package's ``__init__``)."""
    if dotted in classes:
        return classes[dotted]
    mod, _, name = dotted.rpartition(".")
    if depth < 5 and mod in modules and name in modules[mod]:
        return _lookup(classes, modules, modules[mod][name], depth + 1)
    return None


def _base_names(info: ClassInfo) -> list[str]:
    """Each base of ``info``'s class as a dotted name (``"abc.ABC"``, ``"edgesync_store.x.Y"``)."""
    out = []
    for base in info.node.bases:
        text = _dotted(base)
        head, _, rest = text.partition(".")
        source = info.imports.get(head)
        out.append((f"{source}.{rest}" if rest else source) if source else
                   f"{info.module}.{text}" if not rest else text)
    return out


def _is_exception(info: ClassInfo, classes, modules, depth: int = 0) -> bool:
    for name in _base_names(info):
        short = name.rpartition(".")[2]
        base = _lookup(classes, modules, name)
        if base is None and (short in EXCEPTION_BASES or short.endswith(("Error", "Exception", "Warning"))):
            return True
        if base is not None and depth < 10 and _is_exception(base, classes, modules, depth + 1):
            return True
    return False


def _is_abstract_interface(info: ClassInfo) -> bool:
    """An ABC or Protocol that declares abstract methods (the subclass implements them)."""
    shorts = {n.rpartition(".")[2] for n in _base_names(info)}
    meta = {_dotted(k.value).rpartition(".")[2] for k in info.node.keywords if k.arg == "metaclass"}
    is_protocol = "Protocol" in shorts
    if not (is_protocol or "ABC" in shorts or "ABCMeta" in meta):
        return False
    for node in info.node.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if is_protocol or any(_dotted(d).rpartition(".")[2] == "abstractmethod" for d in node.decorator_list):
                return True
    return False


def _defines_and_reads(node: ast.ClassDef) -> tuple[set[str], set[str]]:
    """Attributes a class defines (methods, class attributes and annotations, ``self.x = ...``)
    and the ``self.x`` its methods read."""
    defined: set[str] = set()
    read: set[str] = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(item.name)
        elif isinstance(item, ast.Assign):
            defined.update(t.id for t in item.targets if isinstance(t, ast.Name))
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            defined.add(item.target.id)
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
            (defined if isinstance(sub.ctx, (ast.Store, ast.Del)) else read).add(sub.attr)
    return defined, read - {a for a in read if a.startswith("__") and a.endswith("__")}


def _host_reads(info: ClassInfo, classes, modules, depth: int = 0) -> set[str] | None:
    """The ``self.x`` a class reads that neither it nor its bases define (what it expects of its
    host), or None when a base outside the project (other than ``object``, ``ABC``, ``Generic``)
    makes that unknowable."""
    defined, read = _defines_and_reads(info.node)
    for name in _base_names(info):
        base = _lookup(classes, modules, name)
        if base is None:
            if name.rpartition(".")[2] not in ("object", "ABC", "Generic", "Protocol"):
                return None
            continue
        if depth >= 10:
            return None
        base_defined, _ = _defines_and_reads(base.node)
        inherited = _host_reads(base, classes, modules, depth + 1)
        if inherited is None:
            return None
        defined |= base_defined
    return read - defined


def mixin_bases(classes: dict[str, ClassInfo], modules: dict[str, dict[str, str]]) -> list[str]:
    """``file:line Class(Base from module, ...)`` for each library class with a mixin base from
    another module (the rule in this module's docstring)."""
    hits = []
    for _, info in sorted(classes.items()):
        if not module_file_is_library(info.module):
            continue
        mixins = []
        for name in _base_names(info):
            base = _lookup(classes, modules, name)
            if base is None or base.module == info.module:
                continue
            if base.node.name.endswith("Mixin"):
                mixins.append(f"{base.node.name} from {base.module}")
            elif _is_exception(base, classes, modules) or _is_abstract_interface(base):
                continue
            elif _host_reads(base, classes, modules):
                mixins.append(f"{base.node.name} from {base.module}")
        if mixins:
            hits.append(f"{info.module}:{info.node.lineno} {info.node.name}({', '.join(mixins)})")
    return hits


def module_file_is_library(mod: str) -> bool:
    """Whether dotted module ``mod`` belongs to the installed library (:data:`LIBRARY`)."""
    return mod.split(".")[0] in ("edgesync_store", "edgesync_engines")


def check() -> Report:
    """Read the tree and apply every rule."""
    files = source_files()
    known = {module_name(p) for p in files}
    report = Report(modules=len(files))
    graph: dict[str, set[str]] = {}
    classes: dict[str, ClassInfo] = {}
    modules: dict[str, dict[str, str]] = {}
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text, filename=rel)
        mod = module_name(path)
        graph[mod] = imports_of(path, tree, known)
        modules[mod] = _module_imports(mod, path.name == "__init__.py", tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(f"{mod}.{node.name}", ClassInfo(mod, node, modules[mod]))
        report.private_uses.extend(private_uses(path, tree, known))
        if rel.startswith("edgesync_engines/"):
            for node in ast.walk(tree):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                if any(n.split(".")[0] in STORAGE_LIBRARIES for n in names):
                    report.lmdb_in_engines.append(f"{rel}:{node.lineno}")
        if not rel.startswith(LIBRARY):
            continue
        report.library_imports_outside.extend(outside_imports(path, tree))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                where = f"{rel}:{node.name}"
                if n > report.longest_function_lines:
                    report.longest_function, report.longest_function_lines = where, n
                if n > MAX_FUNCTION_LINES and where not in LONG_FUNCTIONS:
                    report.long_functions.append(f"{where} {n} lines")
    report.cycles = find_cycles(graph)
    report.mixin_classes = mixin_bases(classes, modules)
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
        print(f"library imports of benchmarks, tools or tests: {len(report.library_imports_outside)}")
        print(f"classes assembled from mixins in other modules: {len(report.mixin_classes)}")
        print(f"longest function: {report.longest_function} ({report.longest_function_lines} lines)")
        for rule, items in report.failures().items():
            print(f"\n{rule}:")
            for item in items:
                print(f"  {item}")
    return 1 if report.failures() else 0


if __name__ == "__main__":
    sys.exit(main())
