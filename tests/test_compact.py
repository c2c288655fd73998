"""``python -m edgesync_store.compact`` and ``edgesync compact`` (the same parser): the report,
``--dry-run`` and ``--json``, the store's settings alone, bad input, and a clean stop on SIGTERM.

Real parts: an LMDB store in a tmp directory holding seeded synthetic fragments
(``tests/test_store.make_fragment``: compaction never looks inside the tensors), and the commands
run as subprocesses. No model is loaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from edgesync_store.compactor import Compactor
from edgesync_store.core.store import FragmentStore
from edgesync_store.lifecycle.merge import split_layers
from tests.test_store import make_fragment

ROOT = Path(__file__).resolve().parents[1]
MODULE = [sys.executable, "-m", "edgesync_store.compact"]


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without EDGESYNC_* settings, plus ``extra``."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("EDGESYNC_")}, **extra}


def run(cmd: list[str], **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=clean_env(**extra_env), timeout=300)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def edgesync(*args: str) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "edgesync_engines.app.cli", *args])


def one_expired_store(path: Path, now: float | None = None) -> Path:
    """A store of two fragments, one expired half an hour before ``now`` (Unix seconds; None:
    the current time)."""
    now = time.time() if now is None else now
    with FragmentStore(path) as store:
        store.put_many([make_fragment(seed=70, created_at=now - 3600, expires_at=now - 1800),
                        make_fragment(seed=71, created_at=now, expires_at=now + 1800)])
    return path


def test_compact_command_dry_run_and_json(tmp_path):
    path = one_expired_store(tmp_path / "s")
    cmd = MODULE + [str(path), "--json"]
    with FragmentStore(path, readonly=True) as store:
        recorded = store.recorded_max_bytes()  # the default budget, recorded when the store was created
    before = (path / "data.mdb").read_bytes()
    dry = json.loads(ok(run(cmd + ["--dry-run"])).stdout)
    assert dry["dry_run"] and dry["expired"] == 1 and dry["fragments_after"] == 2 and dry["store"] == str(path)
    assert dry["max_bytes"] == recorded and not dry["skipped"] and not dry["stopped"]
    assert (path / "data.mdb").read_bytes() == before  # a dry run changes nothing
    done = json.loads(ok(run(cmd)).stdout)
    assert done["expired"] == 1 and done["fragments_before"] == 2 and done["fragments_after"] == 1
    for bad in ([str(tmp_path / "missing")], [str(path), "--max-bytes", "lots"]):
        proc = run(MODULE + bad)
        assert proc.returncode == 2 and proc.stderr.strip()
    assert not (tmp_path / "missing").exists()


def test_compact_reads_the_store_settings_alone(tmp_path):
    """STORE defaults to EDGESYNC_STORE and the budget to EDGESYNC_MAX_BYTES; a bad store setting
    is one error line naming it; the engines' settings are not read, and no engine is imported."""
    path = one_expired_store(tmp_path / "s")
    doc = json.loads(ok(run(MODULE + ["--dry-run", "--json"], EDGESYNC_STORE=str(path), EDGESYNC_MAX_BYTES="64M",
                            EDGESYNC_REUSE="not an engine setting the store reads")).stdout)
    assert doc["store"] == str(path) and doc["max_bytes"] == 64 << 20 and doc["expired"] == 1
    proc = run(MODULE + [str(path), "--dry-run"], EDGESYNC_SWEEP_INTERVAL_S="-1")
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: sweep_interval_s: must be a positive number of seconds, got -1.0 "
                                   "(from EDGESYNC_SWEEP_INTERVAL_S='-1')")
    code = ("import sys; from edgesync_store import compact; code = compact.main(sys.argv[1:]); "
            "assert code == 0, code; "
            "assert not [m for m in sys.modules if m.startswith(('edgesync_engines', 'llama_cpp'))], 'engine'")
    ok(run([sys.executable, "-c", code, str(path), "--dry-run", "--json"]))


def test_compact_subcommand_equals_the_module_command(tmp_path):
    """``edgesync compact`` and ``python -m edgesync_store.compact`` take the same flags and
    print the same report; bad input exits 2 with one error line from both."""
    # one creation time for both: the blobs' JSON headers (and so their padded sizes) are then equal
    now = time.time()
    stores = [one_expired_store(tmp_path / name, now) for name in ("a", "b")]
    flags = ["--json", "--no-reclaim", "--max-bytes", "512M"]
    dry = json.loads(ok(edgesync("compact", str(stores[0]), "--dry-run", *flags)).stdout)
    assert dry["dry_run"] and dry["expired"] == 1 and dry["fragments_after"] == 2 and dry["max_bytes"] == 512 << 20
    reports = [json.loads(ok(edgesync("compact", str(stores[0]), *flags)).stdout),
               json.loads(ok(run(MODULE + [str(stores[1]), *flags])).stdout)]
    for doc, path in zip(reports, stores):
        assert doc["store"] == str(path) and doc["expired"] == 1
        assert doc["fragments_before"] == 2 and doc["fragments_after"] == 1 and not doc["reclaim"]
    drop = {"store", "elapsed_s"}
    same = [{k: v for k, v in doc.items() if k not in drop} for doc in reports]
    assert same[0] == same[1]
    text = ok(edgesync("compact", str(stores[0]), "--no-reclaim")).stdout
    assert text.startswith(f"store {stores[0]}\n") and "  fragments      1 -> 1" in text
    missing = tmp_path / "missing"
    for proc in (edgesync("compact", str(missing)), run(MODULE + [str(missing)])):
        assert proc.returncode == 2 and proc.stderr.strip() == f"error: no EdgeSync store at {missing}"
    proc = edgesync("compact", str(stores[0]), "--reclaim-fraction", "2")
    assert proc.returncode == 2 and "must be in [0, 1], got 2.0" in proc.stderr
    assert not missing.exists()


def test_compact_command_stops_cleanly_on_sigterm(tmp_path, monkeypatch, capsys):
    """SIGTERM (or Ctrl-C) stops the command between merge groups: it prints the report so far
    and exits 130; every merge it finished is whole and the next run finishes the rest. Each
    merge is slowed by a test hook so the signal lands mid-run."""
    import signal
    import threading

    from edgesync_store import compact
    from edgesync_store.lifecycle import merge

    path = tmp_path / "s"
    now = time.time()
    wholes = [make_fragment(seed=300 + i, created_at=now, expires_at=now + 3600) for i in range(12)]
    with FragmentStore(path) as store:
        store.put_many([half for w in wholes for half in split_layers(w, 15)])
    real = merge.merge_layers
    calls = []

    def slowed(frags):
        # the signal is sent from inside the first merge, so it lands mid-run however slow the machine
        calls.append(1)
        if len(calls) == 1:
            threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM)).start()
        time.sleep(0.2)
        return real(frags)

    monkeypatch.setattr(merge, "merge_layers", slowed)
    code = compact.main([str(path), "--json", "--no-reclaim"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 130 and doc["stopped"] is True
    assert 1 <= doc["merged_layers"] < 12
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler was put back
    monkeypatch.setattr(merge, "merge_layers", real)
    with FragmentStore(path) as store:
        assert store.stats().fragments == 24 - doc["merged_layers"]
        assert Compactor(store).run(do_reclaim=False).merged_layers == 12 - doc["merged_layers"]
        for w in wholes:
            assert np.array_equal(store.get(w.key()).keys, w.keys)


def test_no_reclaim_and_force_reclaim_are_refused_together(tmp_path):
    path = tmp_path / "s"
    with FragmentStore(path) as store:
        store.put_many([make_fragment(seed=90)])
    proc = run([sys.executable, "-m", "edgesync_store.compact", str(path), "--no-reclaim", "--force-reclaim"])
    assert proc.returncode == 2 and "not allowed with argument" in proc.stderr


def _options(parse_args, argv: list[str]) -> set[str]:
    """The option strings of a parser's ``--help`` (printed before it exits)."""
    import contextlib
    import io
    import re

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        parse_args(argv)
    return set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", out.getvalue()))


def test_the_module_takes_the_same_options_as_edgesync_compact():
    from edgesync_engines.app.cli import build_parser as edgesync_parser
    from edgesync_store.compact import build_parser

    module = _options(build_parser().parse_args, ["--help"])
    assert module == _options(edgesync_parser().parse_args, ["compact", "--help"])
    assert {"--log-level", "--dry-run", "--json", "--max-bytes", "--help"} <= module
