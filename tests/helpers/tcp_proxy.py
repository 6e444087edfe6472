"""TCP proxies that can cut a client off from its server: a network partition made on this machine.

Each ``Proxy`` listens on a free loopback port and forwards every connection to one upstream address.
``partition()`` stops forwarding in both directions: nothing is read from either side any more, so what
was sent stays queued in the kernel's buffers and the proxy (and nothing is lost); ``heal()`` forwards
again. While cut, the client sees a server that never answers and the server a client that never
speaks: a statement in flight waits, a transaction left open is ended by the server's own timers
(``idle_in_transaction_session_timeout``). A connection opened while cut is accepted (the kernel does
that) but reaches the server only after the heal.

What a userspace proxy cannot do is stop the kernel from acknowledging: the client's TCP keepalives and
``tcp_user_timeout`` see a live peer (the proxy's socket), so a partition here looks to the client like a
silent server, not like lost packets. All proxies of a ``Proxies`` share one event loop in one thread of
the calling process; ``Proxies.close()`` (or leaving its ``running()`` block) stops them.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator


class Proxy:
    """127.0.0.1:``port`` -> ``upstream``, with a switch that cuts both directions."""

    def __init__(self, loop: asyncio.AbstractEventLoop, upstream: tuple[str, int], name: str) -> None:
        self.loop, self.upstream, self.name = loop, upstream, name
        self.port = 0
        self.open = asyncio.Event()
        self.open.set()
        self.server: asyncio.Server | None = None
        self.connections: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.connections.add(client_writer)
        upstream_writer: asyncio.StreamWriter | None = None
        try:
            await self.open.wait()  # a connection made while cut reaches the server after the heal
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.upstream)
            self.connections.add(upstream_writer)
            await asyncio.gather(self._pipe(client_reader, upstream_writer),
                                 self._pipe(upstream_reader, client_writer))
        except OSError:
            pass  # the server is down (restarting): the client sees its connection close
        finally:
            for writer in (client_writer, upstream_writer):
                if writer is not None:
                    self.connections.discard(writer)
                    writer.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await self.open.wait()
                data = await reader.read(65536)
                # read just before the cut (data, or the peer's close): held until the heal, never dropped
                await self.open.wait()
                if not data:
                    break
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()  # one side closed: so does the other (the gather's other pipe ends with it)

    async def stop(self) -> None:
        self.open.set()
        if self.server is not None:
            self.server.close()
        for writer in list(self.connections):
            writer.close()
        if self.server is not None:
            await self.server.wait_closed()


class Proxies:
    """Proxies by name, served by one event loop in a daemon thread of this process."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="chaos-tcp-proxies", daemon=True)
        self.by_name: dict[str, Proxy] = {}
        self.thread.start()

    def get(self, name: str) -> Proxy:
        """The proxy ``name`` (started on a free port the first time)."""
        if name not in self.by_name:
            proxy = Proxy(self.loop, self.upstream, name)
            asyncio.run_coroutine_threadsafe(proxy.start(), self.loop).result(10)
            self.by_name[name] = proxy
        return self.by_name[name]

    def partition(self, name: str) -> None:
        self.loop.call_soon_threadsafe(self.by_name[name].open.clear)

    def heal(self, name: str) -> None:
        self.loop.call_soon_threadsafe(self.by_name[name].open.set)

    def close(self) -> None:
        for proxy in self.by_name.values():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(proxy.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    @contextlib.contextmanager
    def running(self) -> Iterator[Proxies]:
        try:
            yield self
        finally:
            self.close()
