"""A TCP proxy the chaos run puts between its workers and its servers, to cut connections.

One asyncio loop on a daemon thread forwards 127.0.0.1:``port`` to 127.0.0.1:``target``.
:meth:`Proxy.cut` aborts every open connection (both sides see a reset) and, for the given
seconds, resets each new one as soon as it is accepted: a network cut as the workers see it,
while the servers and the run's own direct connections are untouched.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from typing import Optional, Set


class Proxy:
    def __init__(self, target: int, port: int = 0) -> None:
        self.target = target
        self._loop = asyncio.new_event_loop()
        self._transports: Set[asyncio.BaseTransport] = set()
        self._refuse_until = 0.0
        self._server: Optional[asyncio.AbstractServer] = None
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", port))
        self.port: int = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._run, name=f"proxy-{self.port}",
                                        daemon=True)
        started = threading.Event()
        self._loop.call_soon(started.set)
        self._thread.start()
        started.wait(10)
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._serve, sock=self._sock, backlog=128)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if time.monotonic() < self._refuse_until:
            _reset(writer.transport)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            _reset(writer.transport)  # the server is down: the client sees a refused call
            return
        pair = {writer.transport, up_writer.transport}
        self._transports |= pair
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            self._transports -= pair
            for transport in pair:
                transport.abort()

    def cut(self, seconds: float) -> None:
        """Reset every open connection now and every new one for ``seconds``."""

        def do() -> None:
            self._refuse_until = time.monotonic() + seconds
            for transport in list(self._transports):
                _reset(transport)

        self._loop.call_soon_threadsafe(do)

    def close(self) -> None:
        def do() -> None:
            if self._server is not None:
                self._server.close()
            for transport in list(self._transports):
                transport.abort()
            self._loop.stop()

        self._loop.call_soon_threadsafe(do)
        self._thread.join(10)


def _reset(transport: asyncio.BaseTransport) -> None:
    """Close with RST (SO_LINGER 0), as a cut network or a dead peer does."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    transport.abort()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.transport.abort()
