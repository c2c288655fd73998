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
    report = archcheck.check()
    assert report.modules > 50  # the checker found the packages at all
    assert report.failures() == {}


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
