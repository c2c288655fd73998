"""``edgesync serve``'s listening socket (``app/cli_serve.py``): the connections asyncio accepts
on it send small writes at once (Nagle's algorithm off), so that a stream's first chunks do not
wait for the client's delayed ACK of the response headers."""

from __future__ import annotations

import asyncio
import socket

from edgesync_engines.app.cli_serve import listening_socket


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
