"""edgesync_store.settings: settings declared as dataclass fields, and the store's own
(StoreSettings: defaults < environment < overrides, bad values named, no engine needed)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from edgesync_store.core.store import DEFAULT_MAX_BYTES
from edgesync_store.settings import (
    DEFAULT_COMPACT_INTERVAL_S,
    DEFAULT_SWEEP_INTERVAL_S,
    StoreSettings,
    default_store_path,
    flag,
    load,
    markdown_rows,
    setting,
    table,
)
from edgesync_store.ttl import DEFAULT_TTL_SECONDS


def test_store_settings_defaults_environment_overrides(tmp_path):
    s = StoreSettings.load(environ={})
    assert (s.store_path, s.ttl_seconds, s.max_bytes, s.compression, s.jobs) == (
        default_store_path(), float(DEFAULT_TTL_SECONDS), None, "none", True)
    assert (s.sweep_interval_s, s.compact_interval_s) == (DEFAULT_SWEEP_INTERVAL_S, DEFAULT_COMPACT_INTERVAL_S)
    env = {"EDGESYNC_STORE": str(tmp_path / "env"), "EDGESYNC_MAX_BYTES": "512M", "EDGESYNC_COMPRESSION": " ZSTD ",
           "EDGESYNC_JOBS": "no", "EDGESYNC_REUSE": "not a store setting: ignored"}
    s = StoreSettings.load(environ=env)
    assert (s.store_path, s.max_bytes, s.compression, s.jobs) == (tmp_path / "env", 512 << 20, "zstd", False)
    s = StoreSettings.load({"store_path": str(tmp_path / "cli"), "max_bytes": None}, environ=env)
    assert s.store_path == tmp_path / "cli" and s.max_bytes == 512 << 20  # None: not given
    assert s.to_dict()["store_path"] == str(tmp_path / "cli")
    assert list(s.to_dict()) == [r.name for r in table(StoreSettings)]


def test_bad_store_settings_name_the_setting_and_the_variable():
    with pytest.raises(ValueError, match=r"^EDGESYNC_MAX_BYTES='lots': not a size in bytes"):
        StoreSettings.load(environ={"EDGESYNC_MAX_BYTES": "lots"})
    with pytest.raises(ValueError, match=r"^sweep_interval_s: must be a positive number of seconds, got 0.0 "
                                         r"\(from EDGESYNC_SWEEP_INTERVAL_S='0'\)$"):
        StoreSettings.load(environ={"EDGESYNC_SWEEP_INTERVAL_S": "0"})
    with pytest.raises(ValueError, match=r"^compression: 'gzip' is not one of none, zstd$"):
        StoreSettings(compression="gzip")
    with pytest.raises(ValueError, match=r"^max_bytes: must be None or bytes from 1 to"):
        StoreSettings(max_bytes=0)
    with pytest.raises(ValueError, match="unknown setting 'reuse'"):
        StoreSettings.load({"reuse": "exact"}, environ={})
    assert "8 GiB and 25% of the disk space free" in table(StoreSettings)[2].shown_default()
    assert DEFAULT_MAX_BYTES == 8 << 30


def test_a_settings_dataclass_is_its_fields():
    """Any frozen dataclass of ``setting``/``flag`` fields loads, checks and prints the same way;
    a secret variable's text is never quoted in an error."""

    def must_be_short(v):
        return None if len(v) < 8 else f"too long: {len(v)} characters"

    @dataclass(frozen=True)
    class Demo:
        token: str = setting("t", env="DEMO_TOKEN", parse=str, help="a secret", check=must_be_short, secret=True)
        on: bool = flag(False, "DEMO_ON", "a switch")

        def __post_init__(self) -> None:
            from edgesync_store.settings import check_fields

            check_fields(self)

    assert load(Demo, environ={"DEMO_ON": "yes"}) == Demo(on=True)
    with pytest.raises(ValueError) as err:
        load(Demo, environ={"DEMO_TOKEN": "hunter2hunter2"})
    assert str(err.value) == "token: too long: 14 characters (from DEMO_TOKEN)" and "hunter2" not in str(err.value)
    with pytest.raises(ValueError, match=r"^DEMO_ON='maybe': not a boolean: 'maybe'$"):
        load(Demo, environ={"DEMO_ON": "maybe"})
    assert markdown_rows(Demo) == ["| `token` | `DEMO_TOKEN` | `t` | a secret |",
                                   "| `on` | `DEMO_ON` | off | a switch |"]


def test_store_settings_load_no_engine():
    """The store's settings need nothing of the engines (``python -m edgesync_store.compact`` reads them)."""
    code = ("import sys; from edgesync_store.settings import StoreSettings; StoreSettings.load(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('edgesync_engines', 'llama_cpp')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout
    assert out.strip() == "[]"
