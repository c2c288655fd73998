"""The server's safety defaults: loopback binding (a warning otherwise), the API key's check,
and ``edgesync serve`` refusing bad input in one line before any model is loaded."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from edgesync_engines.app.cli_serve import default_workers, idle_store_override
from edgesync_engines.server.security import bind_warning, is_loopback, key_matches

ROOT = Path(__file__).resolve().parent.parent


def test_loopback_addresses_and_the_warning_for_others():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.5.0.1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.4") and not is_loopback("example.org")
    assert bind_warning("127.0.0.1", None) is None
    assert "no --api-key" in bind_warning("0.0.0.0", None)
    assert "no --api-key" not in bind_warning("0.0.0.0", "k") and "not loopback" in bind_warning("0.0.0.0", "k")


def test_the_key_must_match_exactly():
    assert key_matches(b"Bearer s3cret", "s3cret")
    for wrong in (None, b"", b"s3cret", b"Bearer s3cre", b"Bearer s3cret ", b"bearer s3cret", b"Bearer S3CRET"):
        assert not key_matches(wrong, "s3cret"), wrong


def test_default_workers_follow_the_cpu_count():
    assert [default_workers(n) for n in (1, 2, 3, 4, 8, 64)] == [1, 1, 1, 2, 4, 4]


def test_idle_store_is_on_in_the_server_unless_the_flag_or_the_environment_says_no():
    assert idle_store_override(False, {}) is True
    assert idle_store_override(False, {"EDGESYNC_IDLE_STORE": "  "}) is True  # blank: not given
    assert idle_store_override(False, {"EDGESYNC_IDLE_STORE": "0"}) is None  # the environment decides
    assert idle_store_override(False, {"EDGESYNC_IDLE_STORE": "1"}) is None
    assert idle_store_override(True, {"EDGESYNC_IDLE_STORE": "1"}) is False  # the flag wins
    assert idle_store_override(True, {}) is False


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgesync_engines.app.cli", "serve", *args], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)


@pytest.mark.server
def test_bad_input_is_one_line_and_exit_2(tmp_path):
    missing = _serve("--model", str(tmp_path / "none.gguf"), "--store", str(tmp_path / "s"))
    assert missing.returncode == 2 and missing.stderr.strip().startswith("error: model not found")
    assert "Traceback" not in missing.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        busy = _serve("--port", str(port), "--store", str(tmp_path / "s"))
    assert busy.returncode == 2 and f"error: cannot listen on 127.0.0.1:{port}" in busy.stderr
    assert "Traceback" not in busy.stderr
    exposed = _serve("--host", "0.0.0.0", "--model", str(tmp_path / "none.gguf"))
    assert exposed.stderr.splitlines()[0].startswith("warning: serving on 0.0.0.0, not loopback")
    assert "no --api-key" in exposed.stderr and exposed.returncode == 2
    port = _serve("--port", "70000")
    assert port.returncode == 2 and "must be <= 65535" in port.stderr
    limit = _serve("--max-tokens-limit", "5000", "--store", str(tmp_path / "s"))
    assert limit.returncode == 2 and "leaves no room for a prompt" in limit.stderr
