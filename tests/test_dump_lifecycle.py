"""The dump's lifecycle columns (lifetime, hits, last use, expiry) and ``--summary``, on a real LMDB
store in a temp dir with synthetic fragments and an injected clock (``ttl.ManualClock``).

No mocks. The clock starts an hour before the real time so that the fragment left to expire
is expired for the subprocess too (which judges expiry by ``time.time()``), while the two
written after the clock moved on are live for it.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from test_store import make_fragment  # noqa: E402  (tests/test_store.py)
from unreadable_store import BECOME_NOBODY, run_on_unreadable_store

from edgesync_store.commands.dump import print_dump
from edgesync_store.commands.inventory import fragment_rows, lifetime_summary, render_lifetime_table, render_table
from edgesync_store.commands.units import format_binary
from edgesync_store.core import codec
from edgesync_store.core.store import FragmentStore
from edgesync_store.documents.retrieval import keep_as_document
from edgesync_store.ttl import LONG_TTL_SECONDS, ManualClock

ROOT = Path(__file__).resolve().parents[1]
DUMP = ROOT / "tools" / "dump.py"
MiB = 1 << 20
BUDGET = 64 * MiB
TTL = 1800.0  # the short lifetime's 30 minutes (TTLPolicy default)


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t).astimezone().isoformat(timespec="seconds")


@pytest.fixture
def lifecycle_store(tmp_path):
    """A store holding three fragments: ``expired`` (written at T0, clock then moved 1 h on),
    ``short`` (written at T1 = T0 + 3600, never hit) and ``long`` (written at T1, hit 5 times
    at T1+10 .. T1+50: promoted). Yields ``(path, clock, info)`` with per fragment its key,
    encoded (stored) size, raw size and the times; the store is closed."""
    t0 = float(int(time.time()) - 3600)
    clock = ManualClock(t0)
    path = tmp_path / "store"
    frags = {}
    with FragmentStore(path, clock=clock, max_bytes=BUDGET) as store:
        frags["expired"] = make_fragment(seed=1, created_at=clock())
        assert store.put(frags["expired"])
        t1 = clock.advance(3600.0)  # past the 30 minutes of the first fragment
        frags["short"] = make_fragment(seed=2, created_at=t1)
        frags["long"] = make_fragment(seed=3, created_at=t1)
        assert store.put_many([frags["short"], frags["long"]]) == 2
        for _ in range(5):
            clock.advance(10.0)
            store.record_hits([frags["long"].key()])
    info = {
        name: {"key": f.key(), "stored": len(codec.encode(f)), "raw": f.raw_nbytes}
        for name, f in frags.items()
    }
    info["t0"], info["t1"] = t0, t1
    return path, clock, info


def _by_key(rows, info):
    out = {}
    for name in ("expired", "short", "long"):
        [row] = [r for r in rows if r["key"] == info[name]["key"].hex()[:12]]
        out[name] = row
    return out


def test_rows_show_lifetime_hits_and_expiry(lifecycle_store):
    path, clock, info = lifecycle_store
    t0, t1, now = info["t0"], info["t1"], clock()
    assert now == t1 + 50
    with FragmentStore(path, readonly=True, clock=clock) as store:
        rows = _by_key(fragment_rows(store), info)  # judged at the store's clock
    assert len(rows) == 3

    exp, short, long_ = rows["expired"], rows["short"], rows["long"]
    assert (exp["lifetime"], exp["hits"], exp["expired"]) == ("short", 0, True)
    assert exp["expires_at"] == t0 + TTL and exp["expires"] == _iso(t0 + TTL)
    assert exp["expires_in_s"] == t0 + TTL - now == -1850.0
    assert exp["last_used_at"] == t0 and exp["last_hit_at"] is None and exp["last_hit"] is None

    assert (short["lifetime"], short["hits"], short["expired"]) == ("short", 0, False)
    assert short["expires_at"] == t1 + TTL and short["expires_in_s"] == 1750.0
    assert short["last_used_at"] == t1 and short["last_used"] == _iso(t1) and short["created_at"] == t1

    assert (long_["lifetime"], long_["hits"], long_["expired"]) == ("long", 5, False)
    assert long_["last_hit_at"] == t1 + 50 and long_["last_hit"] == _iso(t1 + 50)
    assert long_["last_used_at"] == t1 + 50 and long_["last_used"] == _iso(t1 + 50)
    assert long_["expires_at"] == t1 + 50 + LONG_TTL_SECONDS
    assert long_["expires_in_s"] == float(LONG_TTL_SECONDS) == 604800.0
    for name, row in rows.items():
        assert row["compressed_bytes"] == info[name]["stored"] and row["raw_bytes"] == info[name]["raw"]

    # the table: the lifetime column, and "expired" in place of the seconds left
    from rich.console import Console

    console = Console(record=True, width=240, file=io.StringIO())
    console.print(render_table({"fragments": list(rows.values()),
                                "summary": {"path": str(path), "shown": 3, "fragments": 3, "compressed_bytes": 1,
                                            "raw_bytes": 1, "disk_bytes": 1, "map_size": 1,
                                            "compression_ratio": None}}))
    text = console.export_text()
    lines = {name: next(line for line in text.splitlines() if row["key"] in line) for name, row in rows.items()}
    assert " long " in lines["long"] and " 604800 " in lines["long"] and "expired" not in lines["long"]
    assert " short " in lines["short"] and " 1750 " in lines["short"]
    assert " short " in lines["expired"] and "expired" in lines["expired"]


def test_summary_counts_and_bytes_by_lifetime(lifecycle_store):
    path, clock, info = lifecycle_store
    with FragmentStore(path, readonly=True, clock=clock) as store:
        summ = lifetime_summary(store)
    lifetimes = summ["lifetimes"]
    assert list(lifetimes) == ["short", "long", "document", "expired", "total"]
    assert lifetimes["document"] == {"fragments": 0, "stored_bytes": 0, "raw_bytes": 0, "hits": 0}
    for name, hits in (("short", 0), ("long", 5), ("expired", 0)):
        assert lifetimes[name] == {"fragments": 1, "stored_bytes": info[name]["stored"],
                               "raw_bytes": info[name]["raw"], "hits": hits}, name
    stored = sum(info[n]["stored"] for n in ("short", "long", "expired"))
    raw = sum(info[n]["raw"] for n in ("short", "long", "expired"))
    assert lifetimes["total"] == {"fragments": 3, "stored_bytes": stored, "raw_bytes": raw, "hits": 5}
    assert summ["used_bytes"] == stored
    assert summ["max_bytes"] == BUDGET
    assert summ["used_percent"] == round(100 * stored / BUDGET, 2) > 0
    assert summ["data_mdb_bytes"] == (path / "data.mdb").stat().st_size >= stored
    assert summ["corrupt"] == 0 and summ["now"] == clock()

    # later, the short one has expired too: it moves from "short" to "expired"
    clock.advance(TTL)
    with FragmentStore(path, readonly=True, clock=clock) as store:
        later = lifetime_summary(store)["lifetimes"]
    assert later["short"]["fragments"] == 0 and later["expired"]["fragments"] == 2
    assert later["expired"]["stored_bytes"] == info["short"]["stored"] + info["expired"]["stored"]

    from rich.console import Console

    console = Console(record=True, width=120, file=io.StringIO())
    console.print(render_lifetime_table(summ))
    text = console.export_text()
    assert [
        line.split()[1]
        for line in text.splitlines()
        if line.split()[1:2] in (["short"], ["long"], ["document"], ["expired"], ["total"])
    ] == ["short", "long", "document", "expired", "total"]
    assert f"({summ['used_percent']:.1f}%)" in text
    assert f"of the {format_binary(BUDGET)} budget" in " ".join(text.split())  # the unit the budget is set in


def test_dump_script_summary_json(lifecycle_store):
    path, _clock, info = lifecycle_store
    before = (path / "data.mdb").stat()
    proc = subprocess.run([sys.executable, str(DUMP), str(path), "--summary", "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    # judged at the real time: the first fragment expired an hour ago, the others are live
    assert {name: row["fragments"] for name, row in doc["lifetimes"].items()} == \
        {"short": 1, "long": 1, "document": 0, "expired": 1, "total": 3}
    assert doc["lifetimes"]["long"]["hits"] == 5
    assert doc["lifetimes"]["expired"]["stored_bytes"] == info["expired"]["stored"]
    assert doc["max_bytes"] == BUDGET and doc["used_bytes"] == doc["lifetimes"]["total"]["stored_bytes"]
    after = (path / "data.mdb").stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)  # read-only


def test_dump_rows_and_cli_summary_flag(lifecycle_store, capsys):
    path, _clock, info = lifecycle_store
    from rich.console import Console

    out = io.StringIO()
    assert print_dump(path, as_json=True, limit=2, out=Console(file=out)) == 0
    doc = json.loads(out.getvalue())
    assert len(doc["fragments"]) == 2 and doc["summary"]["fragments"] == 3
    assert all(r["lifetime"] in ("short", "long") and "last_used" in r for r in doc["fragments"])

    from edgesync_engines.app import cli

    assert cli.main(["dump", str(path), "--summary", "--json"]) == 0
    summ = json.loads(capsys.readouterr().out)
    assert summ["lifetimes"]["total"]["fragments"] == 3 and summ["lifetimes"]["long"]["fragments"] == 1


def test_document_lifetime_fragment_never_expires_in_dump(lifecycle_store, capsys):
    path, clock, info = lifecycle_store
    key = info["short"]["key"]
    with FragmentStore(path, clock=clock, max_bytes=BUDGET) as store:
        assert keep_as_document(store, [key]) == 1
        assert keep_as_document(store, [key]) == 0  # already there: nothing rewritten

    from edgesync_engines.app import cli

    assert cli.main(["dump", str(path), "--json"]) == 0
    rows = {r["key"]: r for r in json.loads(capsys.readouterr().out)["fragments"]}
    doc_row = rows[key.hex()[:12]]
    assert (doc_row["lifetime"], doc_row["expired"]) == ("document", False)
    assert doc_row["expires"] is None and doc_row["expires_at"] is None and doc_row["expires_in_s"] is None
    assert rows[info["long"]["key"].hex()[:12]]["lifetime"] == "long"

    assert cli.main(["dump", str(path), "--summary", "--json"]) == 0
    lifetimes = json.loads(capsys.readouterr().out)["lifetimes"]
    assert {name: row["fragments"] for name, row in lifetimes.items()} == \
        {"short": 0, "long": 1, "document": 1, "expired": 1, "total": 3}
    assert lifetimes["document"]["stored_bytes"] == info["short"]["stored"]

    # a week and a day later the long one has expired; the document's fragment has not
    clock.advance(LONG_TTL_SECONDS + 86400.0)
    with FragmentStore(path, readonly=True, clock=clock) as store:
        later = lifetime_summary(store)["lifetimes"]
    assert (later["document"]["fragments"], later["expired"]["fragments"]) == (1, 2)


def test_summary_of_missing_store_exits_2_and_creates_nothing(tmp_path):
    missing = tmp_path / "absent"
    err = io.StringIO()
    assert print_dump(missing, summary_only=True, as_json=True, err=err) == 2
    assert err.getvalue().strip() == f"error: no store at {missing}"
    assert not missing.exists()


_DUMP_AS_ANOTHER_USER = """
import io, sys
from edgesync_store.commands.dump import print_dump
""" + BECOME_NOBODY + """
err = io.StringIO()
status = print_dump(sys.argv[1], summary_only=True, as_json=True, err=err)
print(status, err.getvalue().strip())
"""


@pytest.mark.parametrize("closed", ["store", "parent"])
def test_dump_of_a_store_it_cannot_read_exits_2_naming_it(closed):
    """A store directory without read permission, or inside a directory we may not enter:
    status 2 and one line that says so."""
    path, child = run_on_unreadable_store(closed, _DUMP_AS_ANOTHER_USER)
    assert child.returncode == 0, child.stderr
    status, message = child.stdout.strip().split(" ", 1)
    assert status == "2"
    assert message.startswith("error: ") and str(path) in message and "read" in message
    assert "permission denied" in message and "Errno" not in message
