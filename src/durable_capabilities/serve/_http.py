"""`durcap serve`'s HTTP protocol: uvicorn's own (httptools when installed, else h11), each response's head sent in
one socket write with the body that follows it.

uvicorn writes a response's head (status line and headers, at `http.response.start`) and each body chunk in writes
of their own; on a fresh socket each write is a `send()` at once, a packet of its own, and a wake-up of the client
for each. A JSON answer (a turn's 202) is then two writes where one does, and an SSE stream's head goes out alone
just before its first events. Here the head is held until the next write of the connection, which takes it along,
or else until the loop has run what is ready now (`call_soon`: a stream whose first event is not stored yet gets its
head at once, not with that event). The bytes and their order are unchanged.
"""

from __future__ import annotations

import asyncio
from typing import Any

_HEAD = b'HTTP/1.1 '
"""How every response head uvicorn writes starts (its status line; h11's too)."""


class HeadJoinedTransport:
    """A connection's transport (`asyncio.Transport`'s methods, each passed on to `transport`) whose write of a
    response head (bytes starting `HTTP/1.1 `) is held until the next write, which sends both in one call, or until
    the loop's next pass; `close` sends a held head first, `abort` drops it (as it drops what is buffered).

    Args:
        transport: The connection's own transport.
        loop: The loop it runs on.
    """

    __slots__ = ('_held', '_loop', '_transport')

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._loop = transport, loop
        self._held: bytes | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Send `data`, with the head held before it; a head itself is held (see the class). Empty data is nothing
        to send (as the loop's own transports take it; h11 ends a message with one): a held head stays held."""
        if not data:
            return
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(b''.join((held, data)))
        elif bytes(data[:len(_HEAD)]) == _HEAD:
            self._held = bytes(data)
            self._loop.call_soon(self._flush)
        else:
            self._transport.write(data)

    def writelines(self, lines: Any) -> None:
        """`write` of the lines joined."""
        self.write(b''.join(lines))

    def _flush(self) -> None:
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():  # gone meanwhile (the client left): nothing to send
            self._transport.write(held)

    def close(self) -> None:
        """Send a held head, then close."""
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        """Drop a held head and abort (what is buffered is lost)."""
        self._held = None
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def protocol_class() -> type[asyncio.Protocol]:
    """uvicorn's automatic HTTP protocol class (httptools when installed, else h11) with `HeadJoinedTransport`
    around each connection's transport: `uvicorn.Config(http=...)`.

    Raises:
        ImportError: uvicorn is not installed (the `serve` extra).
    """
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HeadJoinedProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(HeadJoinedTransport(transport, asyncio.get_running_loop()))  # type: ignore[arg-type]

    return HeadJoinedProtocol
