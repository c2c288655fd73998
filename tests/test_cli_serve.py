"""``edgesync serve``'s start-up checks (``app/cli_serve.py``, ``server/capacity.py``) and its
listening socket. A worker count whose estimated memory (model file, KV cache, process overhead)
exceeds the memory available is refused before any worker starts, a default count lowered; more
workers than CPUs is a warning. The connections asyncio accepts on the socket send small writes
at once (Nagle's algorithm off), so that a stream's first chunks do not wait for the client's
delayed ACK of the response headers. Only the model's header is read, no model is loaded."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import socket

import pytest

from edgesync_engines.adapters.gguf_header import read_header
from edgesync_engines.adapters.model_files import default_model_path
from edgesync_engines.app.cli_serve import listening_socket
from edgesync_engines.server.capacity import (
    MIB,
    WorkerCountError,
    WorkerEstimate,
    available_memory,
    check_workers,
    kv_cache_bytes,
)


def test_accepted_connections_have_nagle_off():
    async def scenario() -> int:
        sock = listening_socket("127.0.0.1", 0)
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport) -> None:
                accepted.set_result(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP,
                                                                                  socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        nodelay = await asyncio.wait_for(accepted, 10)
        writer.close()
        server.close()
        await server.wait_closed()
        return nodelay

    assert asyncio.run(scenario()) == 1


def test_an_absurd_worker_count_is_refused_before_any_worker_starts(tmp_path, monkeypatch, capsys):
    """``--workers 100000``: one line naming ``--workers`` and the figures, exit status 2, and no
    worker pool made (nor a port bound): the check comes before both."""
    from edgesync_engines.app import cli, cli_serve
    from edgesync_engines.server import pool

    def no_pool(*args, **kwargs):
        raise AssertionError("a worker pool was made")

    for name in ("EDGESYNC_MODEL", "EDGESYNC_N_CTX", "EDGESYNC_KV_TYPE"):  # the figures below are the defaults'
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(pool, "WorkerPool", no_pool)
    monkeypatch.setattr(cli_serve, "listening_socket", no_pool)
    status = cli.main(["serve", "--workers", "100000", "--store", str(tmp_path / "store"), "--port", "0"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert len(lines) == 1 and lines[0].startswith("error: --workers 100000: 100000 workers need an estimated ")
    assert "the model 94 MiB + its KV cache for n_ctx 4096 90 MiB + 128 MiB" in lines[0]
    assert "of memory is available; at most " in lines[0]
    assert multiprocessing.active_children() == []


def test_the_kv_cache_estimate_is_llama_cpps_for_smollm2():
    """30 layers x 3 KV heads x (64 + 64) K and V elements per cell, 4096 cells, f16: 90 MiB;
    q8_0 stores 34 bytes per 32 elements; a context is padded to 256 cells."""
    header = read_header(default_model_path())
    assert kv_cache_bytes(header, 4096, "f16") == 30 * 3 * 128 * 4096 * 2 == 90 * MIB
    assert kv_cache_bytes(header, 4096, "q8_0") == 30 * 3 * 128 * 4096 * 34 // 32
    assert kv_cache_bytes(header, 4000, "f32") == kv_cache_bytes(header, 4096, "f32")


def test_the_memory_available_is_read_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24684000 kB\nMemFree:         1000 kB\nMemAvailable:   23186000 kB\n")
    assert available_memory(meminfo) == 23186000 * 1024
    # no such file (not Linux): the free pages sysconf reports, where it knows them, else None
    fallback = available_memory(tmp_path / "none")
    assert fallback is None or fallback > 0


ESTIMATE = WorkerEstimate(model=100 * MIB, kv_cache=90 * MIB, overhead=128 * MIB)  # 318 MiB


@pytest.mark.parametrize("n, explicit, available, started, warned", [
    (4, True, 2000 * MIB, 4, None),  # fits
    (4, True, None, 4, None),  # memory unknown: unchecked
    (4, False, 1000 * MIB, 3, "4 workers need an estimated 1,272 MiB"),  # a default count is lowered
    (1, True, 100 * MIB, 1, "which may swap"),  # one worker starts anyway
])
def test_a_count_that_does_not_fit_is_lowered_or_warned_unless_asked_for(caplog, n, explicit, available, started,
                                                                         warned):
    with caplog.at_level(logging.WARNING, logger="edgesync_engines.server.capacity"):
        assert check_workers(n, explicit, ESTIMATE, 4096, cpus=8, available=available) == started
    messages = [r.getMessage() for r in caplog.records]
    assert ([m for m in messages if warned in m] if warned else messages) == ([messages[0]] if warned else [])


def test_an_explicit_count_that_does_not_fit_is_refused_naming_the_figures():
    with pytest.raises(WorkerCountError) as err:
        check_workers(8, True, ESTIMATE, 4096, cpus=8, available=1000 * MIB)
    assert str(err.value) == ("--workers 8: 8 workers need an estimated 2,544 MiB (each: the model 100 MiB + its "
                              "KV cache for n_ctx 4096 90 MiB + 128 MiB for the process), and 1,000 MiB of memory "
                              "is available; at most 3 fit")


def test_more_workers_than_cpus_is_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="edgesync_engines.server.capacity"):
        assert check_workers(4, True, ESTIMATE, 4096, cpus=2, available=None) == 4
        assert check_workers(2, True, ESTIMATE, 4096, cpus=2, available=None) == 2
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "--workers 4 is more than the 2 CPUs this process may run on"]


def test_slots_are_lowered_to_what_fits_or_refused_when_asked_for(caplog):
    from edgesync_engines.server.capacity import check_slots, worker_estimate

    model = default_model_path()
    one_slot = worker_estimate(model, 4096, "f16").total
    assert check_slots(4, False, 1, model, 4096, "f16", None) == 4  # unknown memory: unchecked
    kv = worker_estimate(model, 4096, "f16").kv_cache
    with caplog.at_level(logging.WARNING):
        assert check_slots(4, False, 1, model, 4096, "f16", one_slot + kv) == 2
    assert "4 slots per worker do not fit" in caplog.text
    with pytest.raises(WorkerCountError, match=r"--slots 4: 1 worker of 4 slots need .*n_ctx 4096 x 4 slots"):
        check_slots(4, True, 1, model, 4096, "f16", one_slot + kv)


@pytest.mark.parametrize("value, message", [("0", "must be in [1, 64], got 0"), ("65", "must be in [1, 64], got 65"),
                                            ("x", "not an integer")])
def test_slots_outside_one_to_sixty_four_are_refused_by_the_command_line(value, message, capsys):
    from edgesync_engines.app.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--slots", value])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
