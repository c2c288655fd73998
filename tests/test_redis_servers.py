"""tools/redis_servers.py: the test servers come up on ports nothing else takes meanwhile.

Real redis-server processes (Debian's package, as in the other remote-tier tests); a listening
socket of the test's own stands in for another program that took the chosen port.
"""

from __future__ import annotations

import socket

import pytest

from tools.redis_servers import RedisClusterServers, RedisServer, RedisUnavailableError, free_port, ping, server_pid


def _ephemeral_low() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        return int(f.read().split()[0])


def test_free_ports_lie_below_the_kernels_ephemeral_range_and_miss_the_avoided_ones():
    low = _ephemeral_low()
    avoid = {free_port(bus=True) for _ in range(5)}
    for _ in range(200):
        port = free_port(bus=True, avoid=avoid)
        assert port + 10000 < low
        assert not {port, port + 10000} & (avoid | {a + 10000 for a in avoid})
        assert free_port() < low


def _listen(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


@pytest.mark.redis
def test_a_server_whose_chosen_port_was_taken_meanwhile_starts_on_another(tmp_path):
    server = RedisServer(tmp_path)
    chosen = server.port
    squatter = _listen(chosen)
    try:
        server.start()
        assert server.port != chosen
        assert ping(server.port)
    finally:
        server.stop()
        squatter.close()


@pytest.mark.redis
def test_a_server_given_a_taken_port_says_so(tmp_path):
    squatter = _listen(free_port())
    port = squatter.getsockname()[1]
    try:
        with pytest.raises(RedisUnavailableError, match=f"could not bind port {port}: it is in use"):
            RedisServer(tmp_path, port).start()
    finally:
        squatter.close()


@pytest.mark.redis
def test_a_cluster_node_whose_bus_port_was_taken_meanwhile_moves(tmp_path):
    cluster = RedisClusterServers(tmp_path)
    squatter = _listen(cluster.nodes[1].port + 10000)
    try:
        cluster.start()
        ports = [n.port for n in cluster.nodes]
        assert squatter.getsockname()[1] - 10000 not in ports
        assert len(set(ports) | {p + 10000 for p in ports}) == 6
        assert all("cluster_state:ok" in n.cli("cluster", "info") for n in cluster.nodes)
    finally:
        cluster.stop()
        squatter.close()


@pytest.mark.redis
def test_a_port_held_by_another_redis_server_is_not_taken_for_this_ones(tmp_path):
    """The other server answers on the port while this one exits for want of it: start() must
    not return as if this one were up."""
    other = RedisServer(tmp_path / "other").start()
    try:
        with pytest.raises(RedisUnavailableError, match=f"could not bind port {other.port}: it is in use"):
            RedisServer(tmp_path / "given", other.port).start()
        mover = RedisServer(tmp_path / "auto")
        mover.port = other.port  # as if the other server had bound the chosen port first
        mover.start()
        try:
            assert mover.port != other.port
            assert server_pid(mover.port) == mover.proc.pid
            assert server_pid(other.port) == other.proc.pid
        finally:
            mover.stop()
    finally:
        other.stop()


@pytest.mark.redis
def test_a_failed_start_quotes_what_this_start_logged_not_an_earlier_one(tmp_path):
    squatter = _listen(free_port())
    port = squatter.getsockname()[1]
    try:
        with pytest.raises(RedisUnavailableError, match="in use"):
            RedisServer(tmp_path, port).start()  # its log now says the port was in use
    finally:
        squatter.close()
    with pytest.raises(RedisUnavailableError, match="maxmemory") as caught:
        RedisServer(tmp_path, port, args=("--maxmemory", "lots")).start()
    assert "in use" not in str(caught.value)
