"""Shared fixtures of both test folders, ``tests/`` (the library) and ``benchmarks/tests/``
(``edgesync_bench``): the real SmolLM2 model through llama.cpp, real stores in temp dirs, and the
real workload data from ../shared/workloads (EDGESYNC_WORKLOADS overrides; missing data fails).
Being at the repository root, this file also puts the root on ``sys.path``, so that both folders
import the helper modules as ``tests.<name>``.

Test layers (markers registered in pyproject.toml): ``model`` loads a real model, ``server``
starts ``edgesync serve``, ``redis`` starts redis-server. The fast layer is
``pytest -m "not model and not server and not redis and not slow"``. A test that loads a model in this process
(a GGUF through llama.cpp, an ONNX model through ONNX Runtime, or the model fixtures below), or
starts the Redis fixtures, without its marker fails at once naming the marker; a model loaded by a
child process is not seen, so such tests carry the marker by hand."""

from __future__ import annotations

import functools
import json
import os
import tempfile
from pathlib import Path

import pytest

from edgesync_bench import workloads

# Keep the suite out of the user's own cache directory: fingerprints and any default store go
# to a temp dir (set before any test or subprocess starts, so subprocesses inherit it).
_SANDBOX = tempfile.mkdtemp(prefix="edgesync-tests-")
os.environ.setdefault("EDGESYNC_FINGERPRINT_CACHE", os.path.join(_SANDBOX, "fingerprints.json"))
os.environ.setdefault("EDGESYNC_STORE", os.path.join(_SANDBOX, "default-store"))

_RUNNING: list[pytest.Item | None] = [None]
"""The test being set up, run or torn down (session fixtures are built inside the first test
that asks for them, so that test's markers decide)."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _RUNNING[0] = item
    try:
        yield
    finally:
        _RUNNING[0] = None


def require_marker(name: str, what: str) -> None:
    """Fail the running test unless it is marked ``name`` (pytest.fail is a BaseException, so no
    ``except Exception`` in the code under test swallows it)."""
    item = _RUNNING[0]
    if item is not None and item.get_closest_marker(name) is None:
        pytest.fail(f"{item.nodeid} {what} but is not marked @pytest.mark.{name} (markers: pyproject.toml)",
                    pytrace=False)


def _is_gguf(path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except (OSError, TypeError):
        return False


def _is_onnx_model(path_or_bytes) -> bool:
    return isinstance(path_or_bytes, bytes) or (path_or_bytes is not None and Path(path_or_bytes).is_file())


def _guard_constructor(cls: type, argname: str, is_model) -> None:
    """Wrap ``cls.__init__`` so that loading a real model (``is_model`` of its first argument,
    positional or ``argname``) requires the ``model`` marker; a bad path still reaches the
    library's own error."""
    init = cls.__init__

    @functools.wraps(init)
    def guarded(self, *args, **kwargs):
        source = args[0] if args else kwargs.get(argname)
        if is_model(source):
            require_marker("model", f"loads the model {source!r:.120}")
        init(self, *args, **kwargs)

    cls.__init__ = guarded


def _pin_xdist_worker() -> None:
    """Give each pytest-xdist worker its own share of this process's CPUs (``make test`` runs
    two workers on two cores). The engines size their thread pools by the CPUs they may run on
    (``usable_cpus``), and child processes inherit the mask, so two workers never run four
    spinning llama.cpp threads on two cores."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not worker or not count or not hasattr(os, "sched_setaffinity"):
        return
    cpus, index, count = sorted(os.sched_getaffinity(0)), int(worker.removeprefix("gw")), int(count)
    if len(cpus) >= count > 1:
        share = len(cpus) // count
        os.sched_setaffinity(0, cpus[index * share:(index + 1) * share] if index < count - 1 else cpus[index * share:])


LONGEST_FIRST = ("test_server_load.py", "test_quantized_kv.py", "test_cross_engine.py", "test_router.py",
                 "test_documents.py", "test_concurrent_compact.py", "test_semantic_router.py", "test_check.py",
                 "test_idle.py", "test_gemma.py", "test_ram_tier.py", "test_remote_nodes.py")
"""The test files that take longest (by ``pytest --durations=0``), run first: ``make test``'s
workers take whole files in collection order (``--dist loadfile --no-loadscope-reorder``), and a
long file taken last would leave one worker running it alone at the end."""


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def pytest_configure(config):
    _pin_xdist_worker()
    try:
        import llama_cpp
    except ImportError:
        pass
    else:
        _guard_constructor(llama_cpp.Llama, "model_path", _is_gguf)
    try:
        import onnxruntime
    except ImportError:
        pass
    else:
        _guard_constructor(onnxruntime.InferenceSession, "path_or_bytes", _is_onnx_model)


@pytest.fixture(scope="session")
def data_dir():
    """The workload data directory; raises WorkloadDataError (a failure, not a skip) when absent."""
    return workloads.workloads_dir()


@pytest.fixture(scope="session")
def system_prompts(data_dir):
    """The 8 app system prompts of system_prompts.json, in file order."""
    return [row["system_prompt"] for row in json.loads((data_dir / "system_prompts.json").read_text())]


@pytest.fixture(scope="session")
def study_prompt(system_prompts):
    """system_prompts.json row 0 (the study app): a long system prompt."""
    return system_prompts[0]


@pytest.fixture(scope="session")
def seed_requests(data_dir):
    """The seed workload's first 1,000 requests (README recipe, Random(0))."""
    return workloads.seed_workload(1000, data_dir)


@pytest.fixture(scope="session")
def adapter():
    """One real SmolLM2-135M-Instruct (Q4_1) llama.cpp context for the whole session."""
    require_marker("model", "uses the adapter fixture")
    from edgesync_engines.adapters.llamacpp import LlamaCppAdapter

    a = LlamaCppAdapter()
    yield a
    a.close()


# The ONNX export of the real GGUF: `make test` builds it first (`edgesync export-onnx`, into the
# per-user cache dir or EDGESYNC_ONNX_DIR); a bare `pytest` builds it on first use (1.5 minutes).


@pytest.fixture(scope="session")
def onnx_export():
    """The export directory of the real SmolLM2 GGUF (built if missing)."""
    require_marker("model", "uses the onnx_export fixture")
    from edgesync_engines.adapters.model_files import default_model_path
    from edgesync_engines.adapters.onnx_export import export_gguf

    return export_gguf(default_model_path())


@pytest.fixture(scope="session")
def onnx_adapter(onnx_export):
    """One ONNX Runtime session of the real SmolLM2 export for the whole session."""
    from edgesync_engines.adapters.onnxrt import OnnxRuntimeAdapter

    a = OnnxRuntimeAdapter()
    yield a
    a.close()


@pytest.fixture(scope="session")
def llama_all_logits():
    """A llama.cpp context of the real GGUF that keeps the logits of every evaluated position
    (``logits_all=True``; ``llm.scores``), for position-by-position comparisons."""
    require_marker("model", "uses the llama_all_logits fixture")
    import llama_cpp

    from edgesync_engines.adapters.llamacpp import LlamaCppAdapter
    from edgesync_engines.adapters.model_files import default_model_path
    from edgesync_engines.adapters.threads import usable_cpus

    path = default_model_path()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=1024, logits_all=True, verbose=False,
                          n_threads=usable_cpus(), n_threads_batch=usable_cpus())
    a = LlamaCppAdapter(llm, model_path=path)
    yield a
    a.close()
    llm.close()


# The remote tier's servers: real redis-server processes (Debian's package; `make test` installs
# it) on free loopback ports, one set per test module, stopped after it (tools/redis_servers.py).


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """One standalone redis-server on a free loopback port."""
    require_marker("redis", "uses the redis_server fixture")
    from tools.redis_servers import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    """A 3-master Redis Cluster (no replicas) on free loopback ports."""
    require_marker("redis", "uses the redis_cluster fixture")
    from tools.redis_servers import RedisClusterServers

    cluster = RedisClusterServers(tmp_path_factory.mktemp("redis-cluster")).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def reference():
    """The library uncached, with the threads of a server of one worker (``EDGESYNC_THREADS``,
    default all cores): the answers a server's must equal."""
    require_marker("model", "uses the reference fixture")
    from edgesync_engines.config import EdgeSyncConfig
    from edgesync_engines.request.router import EdgeSync

    es = EdgeSync(store=False, config=EdgeSyncConfig.load())
    yield es
    es.close()
