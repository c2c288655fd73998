"""The structure rules of docs/architecture.md, checked on the tree as it is (tools/archcheck.py
reads the code with ``ast``; nothing is imported). A rule broken by a change fails here with the
file and line that broke it."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import archcheck  # noqa: E402


def test_the_tree_passes_every_rule():
    """Every rule at once. Until FragmentStore, TieredStore, SemanticIndex and EdgeSync are whole
    classes (issue 27), this fails on those four mixin assemblies alone."""
    report = archcheck.check()
    assert report.modules > 50  # the checker found the packages at all
    assert report.failures() == {}


def test_library_never_imports_benchmarks_tools_or_tests():
    assert archcheck.check().library_imports_outside == []


def test_test_folders_are_not_checked():
    """``benchmarks/tests`` lies inside the checked ``benchmarks`` folder but, like ``tests``, is
    test code: its files are not read; the benchmarks' own modules are."""
    files = archcheck.source_files()
    assert not any(p.is_relative_to(ROOT / "benchmarks" / "tests") or p.is_relative_to(ROOT / "tests") for p in files)
    assert ROOT / "benchmarks" / "runner.py" in files


def _tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_outside_import_rule_sees_imports_in_functions_and_import_module(monkeypatch, tmp_path):
    """Top-level, function-level and ``importlib.import_module("...")`` imports of benchmarks,
    tools or tests from the library are flagged; the same imports from benchmarks/ are not."""
    _tree(tmp_path, {
        "edgesync_engines/__init__.py": "",
        "edgesync_engines/a.py": "import importlib\nfrom edgesync_bench import runner\n"
                                 "def f():\n    import tools.dump\n    return importlib.import_module('tests.x')\n",
        "edgesync_engines/b.py": "def g():\n    return __import__('benchmarks.plots')\n",
        "benchmarks/__init__.py": "",
        "benchmarks/c.py": "from edgesync_engines import a\nimport tools.dump\n",
    })
    monkeypatch.setattr(archcheck, "ROOT", tmp_path)
    report = archcheck.check()
    assert sorted(report.library_imports_outside) == [
        "edgesync_engines/a.py:2 edgesync_bench", "edgesync_engines/a.py:4 tools.dump",
        "edgesync_engines/a.py:5 tests.x", "edgesync_engines/b.py:2 benchmarks.plots"]


def test_mixin_rule_flags_host_dependent_bases_only(monkeypatch, tmp_path):
    """A base from another module that reads attributes only its host defines, or is named
    ``...Mixin``, is a mixin; an exception, an abstract interface (ABC with abstract methods, a
    Protocol), a self-contained base or a base from the same module is not."""
    _tree(tmp_path, {
        "edgesync_store/__init__.py": "from edgesync_store.parts import Reads\n",
        "edgesync_store/parts.py": (
            "import abc\nfrom typing import Protocol\n"
            "class Reads:\n    def get(self):\n        return self._env.begin()\n"
            "class HelperMixin:\n    pass\n"
            "class Counter:\n    def __init__(self):\n        self.n = 0\n"
            "    def bump(self):\n        self.n += 1\n        return self.n\n"
            "class Backend(abc.ABC):\n    @abc.abstractmethod\n    def get(self): ...\n"
            "    def get_many(self, keys):\n        return [self.get() for _ in keys]\n"
            "class Sized(Protocol):\n    def size(self) -> int: ...\n"
            "class StoreError(RuntimeError):\n    pass\n"),
        "edgesync_store/store.py": (
            "import edgesync_store.parts as parts\n"
            "from edgesync_store import Reads\nfrom edgesync_store.parts import Backend, Counter, HelperMixin\n"
            "class Local:\n    def f(self):\n        return self.host_only\n"
            "class Store(Reads, Backend):\n    def __init__(self):\n        self._env = None\n"
            "class Fine(Counter, Backend, parts.Sized, Local):\n    pass\n"
            "class Helped(HelperMixin):\n    pass\n"
            "class BadInput(parts.StoreError):\n    pass\n"),
    })
    monkeypatch.setattr(archcheck, "ROOT", tmp_path)
    assert sorted(archcheck.check().mixin_classes) == [
        "edgesync_store.store:12 Helped(HelperMixin from edgesync_store.parts)",
        "edgesync_store.store:7 Store(Reads from edgesync_store.parts)"]


def test_cycle_finder_finds_cycles_and_passes_chains(tmp_path):
    """The cycle finder itself: a two-module cycle and a three-module one are found, a chain is not."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert sorted(archcheck.find_cycles(graph)) == [["a", "b"], ["c", "d", "e"]]


def test_private_use_rule_flags_another_modules_underscore_name(monkeypatch, tmp_path):
    """``store._txn`` from outside the store's core is flagged; ``self._x`` and names the module
    defines itself are not."""
    pkg = tmp_path / "edgesync_engines"
    pkg.mkdir()
    src = pkg / "mod.py"
    src.write_text(
        "class A:\n"
        "    def __init__(self):\n"
        "        self._mine = 1\n"
        "    def f(self, store, other):\n"
        "        return self._mine + other._mine + store._txn\n"
    )
    monkeypatch.setattr(archcheck, "ROOT", tmp_path)
    hits = archcheck.private_uses(src, ast.parse(src.read_text()), {"edgesync_engines.mod"})
    assert [h.split()[-1] for h in hits] == ["._txn"]


def test_engines_never_import_lmdb():
    report = archcheck.check()
    assert report.lmdb_in_engines == []
