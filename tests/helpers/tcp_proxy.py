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

``doom(n)`` makes the next ``n`` connections die as sessions die when PostgreSQL shuts down: right after
start-up (the server's first ReadyForQuery) the client gets ``FATAL 57P01 terminating connection due to
administrator command`` and, a moment later, the close. A client that sends its next statement in between
meets a connection whose protocol state is broken (asyncpg: ``InternalClientError``), as it can during a
real restart; here it happens every time, not once in a while.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
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
        self.handlers: set[asyncio.Task[None]] = set()
        self.doomed = 0  # connections still to end right after their start-up
        self.doomed_served = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.connections.add(client_writer)
        handler = asyncio.current_task()
        if handler is not None:
            self.handlers.add(handler)
        upstream_writer: asyncio.StreamWriter | None = None
        try:
            await self.open.wait()  # a connection made while cut reaches the server after the heal
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.upstream)
            self.connections.add(upstream_writer)
            if self.doomed > 0:
                self.doomed -= 1
                await asyncio.gather(
                    self._pipe(client_reader, upstream_writer),
                    self._end_after_startup(upstream_reader, client_writer),
                )
                return
            await asyncio.gather(
                self._pipe(client_reader, upstream_writer), self._pipe(upstream_reader, client_writer)
            )
        except OSError:
            pass  # the server is down (restarting): the client sees its connection close
        finally:
            for writer in (client_writer, upstream_writer):
                if writer is not None:
                    self.connections.discard(writer)
                    writer.close()
            self.handlers.discard(handler)

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

    async def _end_after_startup(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Forward the server's start-up messages up to its first ReadyForQuery, then a FATAL of its
        shutdown; close 0.5 s later (a client that speaks in between meets the broken state)."""
        try:
            first = await reader.readexactly(1)
            if first == b"N":  # SSL refused: the answer to an SSLRequest is one byte, not a message
                writer.write(first)
                first = await reader.readexactly(1)
            elif first in (b"S", b"G"):  # TLS or GSS from here on: not readable here (use sslmode=disable)
                raise AssertionError("a doomed connection must not use TLS: connect with sslmode=disable")
            while True:
                length = await reader.readexactly(4)
                body = await reader.readexactly(struct.unpack("!I", length)[0] - 4)
                if first == b"Z":
                    # in one write, so that the client reads both at once, as it does when the server
                    # goes down between two statements
                    writer.write(first + length + body + _shutdown_fatal())
                    break
                writer.write(first + length + body)
                first = await reader.readexactly(1)
            await writer.drain()
            self.doomed_served += 1
            await asyncio.sleep(0.5)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        self.open.set()
        if self.server is not None:
            self.server.close()
        for writer in list(self.connections):
            writer.close()
        for handler in list(self.handlers):  # ended here, not destroyed pending when the loop stops
            handler.cancel()
        await asyncio.gather(*self.handlers, return_exceptions=True)
        if self.server is not None:
            await self.server.wait_closed()


def _shutdown_fatal() -> bytes:
    """The ErrorResponse PostgreSQL sends every session when it shuts down (fast or immediate)."""
    fields = [b"SFATAL", b"VFATAL", b"C57P01", b"Mterminating connection due to administrator command"]
    body = b"".join(field + b"\0" for field in fields) + b"\0"
    return b"E" + struct.pack("!I", len(body) + 4) + body


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

    def doom(self, name: str, connections: int) -> None:
        """``connections`` more connections through ``name`` die right after their start-up."""

        def set_count() -> None:
            self.by_name[name].doomed += connections

        self.loop.call_soon_threadsafe(set_count)

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
