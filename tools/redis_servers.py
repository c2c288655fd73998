"""Real Redis servers on free loopback ports, for the tests and ``benchmarks/remote.py``.

:class:`RedisServer` runs the distribution's ``redis-server`` (Debian's 7.0.15; ``make test``
installs it with apt-get when missing) as a child process: loopback only, no persistence
(``--save '' --appendonly no``), its files in a directory of the caller's, optional extra
arguments (``--maxmemory 4mb --maxmemory-policy noeviction``). It can be killed with any
signal and started again on the same port. :class:`RedisClusterServers` runs three of them with
``--cluster-enabled yes`` and joins them with ``redis-cli --cluster create`` into a 3-master
cluster (no replicas), all 16384 slots covered.

Readiness is checked with a raw ``PING`` over a socket (no client library needed here).
Every process started is stopped by :meth:`stop` (SIGTERM, then SIGKILL after 5 s).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

__all__ = ["RedisClusterServers", "RedisServer", "RedisUnavailableError", "free_port", "redis_binaries"]


class RedisUnavailableError(RuntimeError):
    """redis-server or redis-cli is not installed, or a server did not come up."""


def redis_binaries() -> tuple[str, str]:
    """Paths of ``redis-server`` and ``redis-cli``.

    Raises:
        RedisUnavailableError: one is missing (the message says how to install it).
    """
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if not server or not cli:
        raise RedisUnavailableError("redis-server / redis-cli not found: `make redis-server` installs Debian's "
                                    "package (apt-get install -y redis-server)")
    return server, cli


def free_port(bus: bool = False) -> int:
    """A TCP port free on 127.0.0.1 now (with ``bus``: port + 10000 too, Redis Cluster's bus)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not bus:
            return port
        if port + 10000 < 65536:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port
    raise RedisUnavailableError("no free loopback port pair for a cluster node")


def ping(port: int, timeout_s: float = 0.5) -> bool:
    """True when a server on ``127.0.0.1:port`` answers PING (or says it is loading)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            s.sendall(b"PING\r\n")
            reply = s.recv(64)
    except OSError:
        return False
    return reply.startswith(b"+PONG") or reply.startswith(b"-NOAUTH")


class RedisServer:
    """One ``redis-server`` child process on ``127.0.0.1:port``.

    Args:
        workdir: directory for its files (``--dir``) and its log (``redis-<port>.log``).
        port: the port (None: a free one).
        args: extra ``redis-server`` arguments.
    """

    def __init__(self, workdir: str | os.PathLike, port: int | None = None, args: tuple[str, ...] = ()) -> None:
        self.server_bin, self.cli_bin = redis_binaries()
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.args = tuple(args)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "RedisServer":
        """Start the process and wait until it answers PING.

        Raises:
            RedisUnavailableError: it exited or did not answer within ``timeout_s``.
        """
        log = open(self.workdir / f"redis-{self.port}.log", "ab")
        cmd = [self.server_bin, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", str(self.workdir), "--daemonize", "no", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RedisUnavailableError(f"redis-server on port {self.port} exited ({self.proc.returncode}); "
                                            f"see {self.workdir}/redis-{self.port}.log")
            if ping(self.port):
                return self
            time.sleep(0.02)
        self.stop()
        raise RedisUnavailableError(f"redis-server on port {self.port} did not answer within {timeout_s} s")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the server and wait for it to exit."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=10)

    def cli(self, *args: str) -> str:
        """Run ``redis-cli -p PORT ARGS...``; its stdout."""
        out = subprocess.run([self.cli_bin, "-h", "127.0.0.1", "-p", str(self.port), *args], capture_output=True,
                             text=True, timeout=30, check=True)
        return out.stdout

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s (idempotent)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


class RedisClusterServers:
    """Three cluster-enabled servers joined into one 3-master cluster.

    Args:
        workdir: one sub-directory per node.
    """

    def __init__(self, workdir: str | os.PathLike, masters: int = 3) -> None:
        self.nodes = []
        for i in range(masters):
            port = free_port(bus=True)
            self.nodes.append(RedisServer(Path(workdir) / f"node{i}", port,
                                          ("--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                                           "--cluster-node-timeout", "2000")))

    @property
    def url(self) -> str:
        """The first node's URL (a cluster client discovers the others)."""
        return self.nodes[0].url

    def start(self, timeout_s: float = 30.0) -> "RedisClusterServers":
        """Start the nodes, create the cluster, wait for ``cluster_state:ok`` on every node."""
        try:
            for node in self.nodes:
                node.start()
            addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
            subprocess.run([self.nodes[0].cli_bin, "--cluster", "create", *addresses, "--cluster-replicas", "0",
                            "--cluster-yes"], capture_output=True, text=True, timeout=60, check=True)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if all("cluster_state:ok" in n.cli("cluster", "info") for n in self.nodes):
                    return self
                time.sleep(0.1)
        except (subprocess.SubprocessError, OSError, RedisUnavailableError):
            self.stop()
            raise
        self.stop()
        raise RedisUnavailableError(f"the cluster did not reach cluster_state:ok within {timeout_s} s")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
