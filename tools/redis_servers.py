"""Real Redis servers on free loopback ports, for the tests and ``benchmarks/remote.py``.

:class:`RedisServer` runs the distribution's ``redis-server`` (Debian's 7.0.15; ``make test``
installs it with apt-get when missing) as a child process: loopback only, no persistence
(``--save '' --appendonly no``), its files in a directory of the caller's, optional extra
arguments (``--maxmemory 4mb --maxmemory-policy noeviction``). It can be killed with any
signal and started again on the same port. :class:`RedisClusterServers` runs three of them with
``--cluster-enabled yes`` and joins them with ``redis-cli --cluster create`` into a 3-master
cluster (no replicas), all 16384 slots covered.

Readiness is checked over a raw socket (no client library needed here): the server answering
``INFO server`` on the port must report the child's own process ID.
Every process started is stopped by :meth:`stop` (SIGTERM, then SIGKILL after 5 s).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

__all__ = ["RedisClusterServers", "RedisServer", "RedisUnavailableError", "free_port", "ping", "redis_binaries",
           "server_pid"]


class RedisUnavailableError(RuntimeError):
    """redis-server or redis-cli is not installed, or a server did not come up."""


class _PortTaken(Exception):
    """redis-server exited because its port (or its cluster bus port) was in use."""


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


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it hands out on its own (Linux: /proc/sys/net/ipv4/ip_local_port_range)."""
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(port: int) -> bool:
    """True when nothing holds ``127.0.0.1:port`` (no SO_REUSEADDR, so a TIME_WAIT socket counts too)."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(bus: bool = False, avoid: frozenset[int] | set[int] = frozenset()) -> int:
    """A TCP port free on 127.0.0.1 now, below the kernel's ephemeral range.

    Ports from ``bind(('', 0))`` come from the ephemeral range, where the outgoing connections of
    this very test run (clients, PINGs) take their local ports: such a port can be taken between
    being chosen and the server binding it. So a random port below that range is tried instead.

    Args:
        bus: port + 10000 must be free too (Redis Cluster's bus port), and below the range.
        avoid: ports already promised to other servers (their bus ports are avoided as well).

    Raises:
        RedisUnavailableError: no free port after 500 tries.
    """
    low = _ephemeral_range()[0]
    top = (low - 10000 if bus else low) - 1
    taken = set(avoid) | {p + 10000 for p in avoid}
    rng = random.Random()
    for _ in range(500):
        port = rng.randint(10000, max(top, 10001))
        wanted = (port, port + 10000) if bus else (port,)
        if any(w in taken or w > 65535 for w in wanted):
            continue
        if all(_bindable(w) for w in wanted):
            return port
    raise RedisUnavailableError("no free loopback port" + (" pair for a cluster node" if bus else ""))


def ping(port: int, timeout_s: float = 0.5) -> bool:
    """True when a server on ``127.0.0.1:port`` answers PING (or says it is loading)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            s.sendall(b"PING\r\n")
            reply = s.recv(64)
    except OSError:
        return False
    return reply.startswith(b"+PONG") or reply.startswith(b"-NOAUTH")


def server_pid(port: int, timeout_s: float = 0.5) -> int | None:
    """The process ID of the server answering on ``127.0.0.1:port`` (``INFO server``'s
    ``process_id``), or None when none answers or it asks for a password."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            s.sendall(b"INFO server\r\n")
            reply = b""
            while True:
                piece = s.recv(4096)
                if not piece or (reply + piece).startswith(b"-"):  # closed, or an error such as NOAUTH
                    return None
                reply += piece
                _, found, rest = reply.partition(b"process_id:")
                if found and b"\r\n" in rest:
                    return int(rest.split(b"\r\n", 1)[0])
    except (OSError, ValueError):
        return None


class RedisServer:
    """One ``redis-server`` child process on ``127.0.0.1:port``.

    Args:
        workdir: directory for its files (``--dir``) and its log (``redis-<port>.log``).
        port: the port (None: a free one, see :func:`free_port`; if the server still finds it
            taken at its first start, it is started again on another free port, up to 5 times).
        args: extra ``redis-server`` arguments.
        bus: with an automatic port, port + 10000 is kept free too (a cluster node's bus).
        avoid: with an automatic port, ports promised to other servers of the same caller.
    """

    def __init__(self, workdir: str | os.PathLike, port: int | None = None, args: tuple[str, ...] = (),
                 bus: bool = False, avoid: frozenset[int] | set[int] = frozenset()) -> None:
        self.server_bin, self.cli_bin = redis_binaries()
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._bus = bus
        self.avoid = frozenset(avoid)
        self._port_chosen_here = port is None
        self.port = port or free_port(bus, self.avoid)
        self.args = tuple(args)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"redis-{self.port}.log"

    def start(self, timeout_s: float = 10.0) -> "RedisServer":
        """Start the process and wait until it answers PING.

        A restart after :meth:`kill` keeps the port. Only the first start of a server whose port
        was chosen here moves to another port when the chosen one was taken meanwhile.

        Raises:
            RedisUnavailableError: it exited (the message quotes its log) or did not answer within
                ``timeout_s``.
        """
        first = self.proc is None
        for _ in range(5):
            try:
                return self._start_once(timeout_s)
            except _PortTaken:
                if not (first and self._port_chosen_here):
                    raise RedisUnavailableError(f"redis-server could not bind port {self.port}: it is in use") from None
                self.port = free_port(self._bus, self.avoid | {self.port})
        raise RedisUnavailableError("redis-server found each of 5 free ports taken when it started")

    def _start_once(self, timeout_s: float) -> "RedisServer":
        # The server answering on the port must be this process: another server that holds the
        # port would answer PING while this one exits for want of it.
        log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            cmd = [self.server_bin, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                   "no", "--dir", str(self.workdir), "--daemonize", "no", *self.args]
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                with open(self.log_path, "rb") as log:
                    log.seek(log_start)
                    said = log.read().decode(errors="replace")
                if "in use" in said:
                    raise _PortTaken
                raise RedisUnavailableError(f"redis-server on port {self.port} exited ({self.proc.returncode}); "
                                            f"it wrote to {self.log_path}:\n{said[-600:]}")
            if server_pid(self.port) == self.proc.pid:
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
        self.nodes: list[RedisServer] = []
        for i in range(masters):
            # Each node has its own directory, so the cluster config file can have a fixed name.
            taken = frozenset(n.port for n in self.nodes)
            self.nodes.append(RedisServer(Path(workdir) / f"node{i}", None,
                                          ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                           "--cluster-node-timeout", "2000"), bus=True, avoid=taken))

    @property
    def url(self) -> str:
        """The first node's URL (a cluster client discovers the others)."""
        return self.nodes[0].url

    def start(self, timeout_s: float = 30.0) -> "RedisClusterServers":
        """Start the nodes, create the cluster, wait for ``cluster_state:ok`` on every node."""
        try:
            for node in self.nodes:
                node.avoid = frozenset(n.port for n in self.nodes if n is not node)  # as they are now
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
