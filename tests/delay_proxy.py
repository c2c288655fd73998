"""A loopback TCP proxy that delays every chunk it forwards: a slow remote tier for the fault
tests (a real Redis server cannot be told to answer late). Listens on 127.0.0.1 only, forwards
to one loopback address, and stops with :meth:`DelayProxy.stop` (threads are daemons).

With ``piece`` it trickles instead: the server's replies reach the client ``piece`` bytes at a
time, ``delay_s`` apart (a link that keeps every socket read short while a large reply takes
long), and the client's commands pass at once."""

from __future__ import annotations

import socket
import threading
import time


class DelayProxy:
    """Forwards ``127.0.0.1:port`` to ``127.0.0.1:target_port``, sleeping ``delay_s`` before
    passing on each chunk in either direction; with ``piece`` (bytes), only before each
    ``piece`` bytes of the server's replies. ``bytes_down``: reply bytes passed on so far."""

    def __init__(self, target_port: int, delay_s: float, piece: int | None = None) -> None:
        self.target_port = target_port
        self.delay_s = delay_s
        self.piece = piece
        self.bytes_down = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._stopped = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                return
            self._sockets += [client, upstream]
            for a, b, down in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(target=self._pump, args=(a, b, down), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, down: bool) -> None:
        try:
            while not self._stopped.is_set():
                data = src.recv(self.piece if self.piece and down else 65536)
                if not data:
                    break
                if down or not self.piece:
                    time.sleep(self.delay_s)
                if down:  # counted before the client can have it: a reader never sees it short
                    self.bytes_down += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def stop(self) -> None:
        self._stopped.set()
        self._listener.close()
        for s in self._sockets:
            try:
                s.close()
            except OSError:
                pass
