"""The ``edgesync`` command and ``tools/dump.py``, run as subprocesses on the real model.

Real parts only: SmolLM2-135M-Instruct through llama.cpp, an LMDB store in a tmp directory,
the shared workload data (../shared/workloads or $EDGESYNC_WORKLOADS). No mocks.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from edgesync_bench.workloads import SYSTEM_PROMPTS_FILE, workloads_dir
from tests.cli_support import cli_env, edgesync, ok

ROOT = Path(__file__).resolve().parents[1]
DUMP = ROOT / "tools" / "dump.py"
QUESTION = "How should I plan a week of revision before my chemistry exam?"


def dump_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(DUMP), *args], capture_output=True, text=True, cwd=ROOT, env=cli_env(), timeout=120,
    )


@pytest.fixture(scope="module")
def system_prompt() -> str:
    prompts = json.loads((workloads_dir() / SYSTEM_PROMPTS_FILE).read_text(encoding="utf-8"))
    return prompts[0]["system_prompt"]


@pytest.fixture(scope="module")
def generated(tmp_path_factory, system_prompt):
    """The same long chat prompt generated twice (--json) in a fresh store."""
    store = tmp_path_factory.mktemp("gen") / "store"
    args = ["generate", QUESTION, "--system", system_prompt, "--store", str(store), "--max-tokens", "12", "--json"]
    first = json.loads(ok(edgesync(*args)).stdout)
    second = json.loads(ok(edgesync(*args)).stdout)
    return store, first, second


@pytest.mark.model
def test_generate_json_miss_then_exact(generated):
    _store, first, second = generated
    assert first["prompt_tokens"] >= 300
    assert first["hit"] == "miss" and first["tokens_reused"] == 0 and first["bytes_read"] == 0
    assert first["fragments_written"] >= 2
    assert second["hit"] == "exact"
    assert second["prompt_tokens"] == first["prompt_tokens"]
    assert second["tokens_reused"] >= second["prompt_tokens"] - 1
    assert second["tokens_prefilled"] == second["prompt_tokens"] - second["tokens_reused"]
    assert second["bytes_read"] > 0
    assert second["tokens"] == first["tokens"] and len(first["tokens"]) > 0
    assert second["text"] == first["text"]
    for key in ("text", "tokens", "hit", "similarity", "ttft_ms", "total_ms"):
        assert key in second


@pytest.mark.model
def test_generate_streams_text_and_summary(generated, system_prompt):
    store, first, _ = generated
    proc = ok(edgesync("generate", QUESTION, "--system", system_prompt, "--store", str(store), "--max-tokens", "12"))
    assert proc.stdout.rstrip("\n") == first["text"].rstrip("\n")
    summary = proc.stderr.strip().splitlines()[-1]
    assert summary.startswith("[exact]")
    assert f"prompt {first['prompt_tokens']} tokens" in summary and "TTFT" in summary


@pytest.mark.model
def test_generate_context_overflow_exits_2(tmp_path):
    store = tmp_path / "store"
    proc = edgesync("generate", "Hello there, how are you?", "--store", str(store), "--max-tokens", "5000")
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error:")
    match = re.search(r"prompt of (\d+) tokens", line)
    assert match and int(match.group(1)) > 0
    assert "5000" in line and "4096" in line


@pytest.mark.model
def test_dump_lists_written_fragments(generated):
    store, first, _ = generated
    doc = json.loads(ok(dump_script(str(store), "--json")).stdout)
    frags = doc["fragments"]
    assert len(frags) == first["fragments_written"] == doc["summary"]["fragments"]
    assert all(not f["corrupt"] and f["compressed_bytes"] > 0 and f["raw_bytes"] > 0 for f in frags)
    spans = sorted(tuple(map(int, f["tokens"].split("-"))) for f in frags)
    # The chunks tile the prompt from position 0 (the router may leave out its last token).
    assert spans[0][0] == 0 and first["prompt_tokens"] - 1 <= spans[-1][1] <= first["prompt_tokens"]
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert all(f["hits"] >= 1 and f["expires_in_s"] > 0 and f["engine"] == "llama.cpp" for f in frags)
    assert doc["summary"]["compressed_bytes"] == sum(f["compressed_bytes"] for f in frags)

    limited = json.loads(ok(edgesync("dump", str(store), "--json", "--limit", "1")).stdout)
    assert len(limited["fragments"]) == 1 and limited["summary"]["fragments"] == len(frags)
    table = ok(dump_script(str(store))).stdout
    assert frags[0]["key"] in table


def test_dump_missing_store_exits_2_and_creates_nothing(tmp_path):
    missing = tmp_path / "no-such-store"
    for proc in (dump_script(str(missing)), edgesync("dump", str(missing), "--json")):
        assert proc.returncode == 2
        assert proc.stdout == ""
        assert proc.stderr.strip() == f"error: no store at {missing}"
        assert not missing.exists()
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for proc in (dump_script(str(a_file)), edgesync("dump", str(a_file), "--json")):
        expected = f"error: store path {a_file}: exists and is not a directory"
        assert (proc.returncode, proc.stderr.strip()) == (2, expected)
        assert a_file.read_text() == "x"


def test_missing_model_exits_2(tmp_path):
    proc = edgesync("generate", "hi", "--store", str(tmp_path / "s"),
                    env=cli_env(EDGESYNC_MODEL=str(tmp_path / "absent.gguf")))
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and "Traceback" not in proc.stderr
    assert not (tmp_path / "s").exists()


def test_a_command_that_is_not_installed_is_listed_and_refused_in_one_line(monkeypatch, capsys):
    """The measurement commands come from the ``edgesync.commands`` entry points; one no entry
    point adds is still listed, and running it (with any arguments) prints one line saying how to
    get it and exits 2."""
    from edgesync_engines.app import cli

    monkeypatch.setitem(cli.MEASUREMENT_COMMANDS, "not-installed", "a command no distribution adds")
    assert "not-installed" in cli.build_parser().format_help()
    assert cli.main(["not-installed", "seed", "--limit", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: `edgesync not-installed`")
    assert "pip install -e ./benchmarks" in err


INTERRUPT_AT_IMPORT = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal, whatever the runner ignores
from edgesync_engines.app.cli_entry import main

class InterruptAt:  # a real SIGINT, sent as the named module starts to load
    def find_spec(self, name, path=None, target=None):
        if name == sys.argv[1]:
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, InterruptAt())
sys.exit(main(["--help"]))
"""


@pytest.mark.parametrize("module", ["edgesync_engines.app.cli", "edgesync_engines.app.cli_serve", "numpy"])
def test_a_ctrl_c_while_the_command_loads_exits_130_with_one_line(module):
    """A Ctrl-C while the command's modules load (the signal sent by an import hook as the named
    module starts to load, instead of at a moment a timer would have to hit) exits 130 with one
    line, not a traceback. What comes before, the interpreter's own start-up and the package's
    few imports, is not the command's to handle. The console script is this function."""
    scripts = [ep.value for ep in entry_points(group="console_scripts", name="edgesync")]
    assert scripts == ["edgesync_engines.app.cli_entry:main"]
    proc = subprocess.run([sys.executable, "-c", INTERRUPT_AT_IMPORT, module], capture_output=True, text=True,
                          cwd=ROOT, env=cli_env(), timeout=120)
    assert (proc.returncode, proc.stderr, proc.stdout) == (130, "error: interrupted\n", "")


INTERRUPT_IN_NATIVE_LOG = """
import logging, os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal, whatever the runner ignores
from edgesync_engines.app.cli_entry import main

class InterruptOnce(logging.Handler):  # a real SIGINT, sent as llama.cpp logs its first line
    fired = False

    def emit(self, record):
        if not InterruptOnce.fired:
            InterruptOnce.fired = True
            os.kill(os.getpid(), signal.SIGINT)

native = logging.getLogger("edgesync.llama_cpp.native")
native.setLevel(logging.DEBUG)
native.propagate = False
native.addHandler(InterruptOnce())
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.model
def test_a_ctrl_c_while_the_model_loads_is_not_lost(tmp_path):
    """A SIGINT while llama.cpp loads the model (sent from its log callback, where Python would
    raise the KeyboardInterrupt and ctypes print "Exception ignored" and drop it, and the
    command would go on to generate) ends the command with 130 and one line once the load
    returns, with nothing generated."""
    proc = subprocess.run([sys.executable, "-c", INTERRUPT_IN_NATIVE_LOG, "generate", "Tell me about cats",
                           "--store", str(tmp_path / "s"), "--max-tokens", "8"], capture_output=True, text=True,
                          cwd=ROOT, env=cli_env(), timeout=300)
    assert (proc.returncode, proc.stdout, proc.stderr) == (130, "", "error: interrupted\n")


@pytest.mark.model
def test_a_prompt_that_is_not_utf8_is_refused_in_one_line(tmp_path):
    for args in ([b"caf\xe9 ?"], [b"hi", b"--system", b"\xff\xfe"]):
        proc = subprocess.run([sys.executable, "-m", "edgesync_engines.app.cli", "generate", *args,
                               "--store", str(tmp_path / "s")], capture_output=True, text=True, timeout=120)
        name = "--system" if b"--system" in args else "prompt"
        assert (proc.returncode, proc.stderr) == (2, f"error: {name}: is not valid UTF-8 text\n")
    assert not (tmp_path / "s").exists()


def test_paths_and_models_that_do_not_work_exit_2_with_one_line(tmp_path):
    """A store path that is a file, and a model file that is not a GGUF: one error line, no
    traceback."""
    a_file = tmp_path / "file"
    a_file.write_text("x")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"\0" * 4096)
    for args, env in (
        (["generate", "hi", "--store", str(a_file)], {}),
        (["generate", "hi", "--store", str(tmp_path / "s")], {"EDGESYNC_MODEL": str(junk)}),
        (["generate", "hi", "--store", str(tmp_path / "s")], {"EDGESYNC_TTL_SECONDS": "nan"}),
    ):
        proc = subprocess.run([sys.executable, "-m", "edgesync_engines.app.cli", *args], capture_output=True,
                              text=True, timeout=120, env={**os.environ, **env})
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
