"""Prefect's server (`start_prefect_server`: `prefect server start`) and which Prefect API a process talks to: the
configured one, else a temporary local server it starts once. The process helpers (free ports, readiness, stopping
by pid) are `_servers`'."""

from __future__ import annotations

import atexit
import os
import subprocess
import tempfile
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect.context import refresh_global_settings_context
from prefect.settings import get_current_settings

from ..._limits import private_dir
from ..._servers import ServerProcess, bind_to_parent, command_path, free_port, wait_until_ready
from ._spec import ENGINE

_TEMPORARY_SERVER: list[Any] = []
"""The temporary local Prefect server this process started (at most one; see `ensure_api`)."""

_LAUNCHED: list[tuple[ServerProcess, Callable[[], None]]] = []
"""A temporary server `warm_up` launched and nobody has waited for yet: `(server, wait until ready)`."""


def configured_api() -> str | None:
    """The Prefect API URL configured for this process (`PREFECT_API_URL`, or the active Prefect profile), or `None`."""
    return get_current_settings().api.url or None


def ensure_api() -> tuple[str, bool]:
    """The Prefect API this process talks to: `(url, temporary)`.

    The configured one (`configured_api`), else a temporary local server this process starts once (`prefect server
    start` on a free port, on the database of the user's Prefect home, as Prefect's own temporary server would) and
    points every Prefect client of the process at (`PREFECT_API_URL` and `refresh_global_settings_context`, so
    Prefect's background threads see it too). The server dies with this process, even on `kill -9`
    (`start_prefect_server(die_with_parent=True)`), and is stopped at exit. A server launched early by `warm_up`
    is the one waited for here.

    Raises:
        RuntimeError / TimeoutError: the temporary server did not come up.
    """
    if _TEMPORARY_SERVER:
        return _TEMPORARY_SERVER[0].address, True
    if _LAUNCHED:
        server, ready = _LAUNCHED.pop()
        ready()
    else:
        url = configured_api()
        if url:
            return url, False
        server = start_prefect_server(home=None, die_with_parent=True)
    _TEMPORARY_SERVER.append(server)
    atexit.register(server.stop)
    os.environ['PREFECT_API_URL'] = server.address
    refresh_global_settings_context()
    return server.address, True


def warm_up(notify: Callable[[str], None]) -> None:
    """Launch the temporary local server now, when a run will need one (no Prefect API configured), without waiting
    for it: `ensure_api` waits for it later, so the 10-30 s `prefect server start` takes (its imports, and the
    migrations of the Prefect home's database on a first start) overlap loading TARGET (issue 29 item 6: the
    Prefect demo took 65 s). Says so on `notify`, so the wait is explained. Does nothing when an API is configured
    or a server is already launched. Call it from the thread that will run the flow (`die_with_parent` binds the
    server to the launching thread)."""
    if _TEMPORARY_SERVER or _LAUNCHED or configured_api():
        return
    notify('prefect server: starting a temporary local server, as PREFECT_API_URL is not set (it takes 10-30 s; '
           'set PREFECT_API_URL to use a running server)')
    _LAUNCHED.append(launch_prefect_server(home=None, die_with_parent=True))


def server_line() -> str:
    """The line a run prints before it starts: which Prefect API it uses (starting the temporary server if needed)."""
    url, temporary = ensure_api()
    if temporary:
        return (f'prefect server: temporary local server at {url}, started by this command and stopped with it '
                '(PREFECT_API_URL is not set)')
    return f'prefect server: {url}'


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
    server, ready = launch_prefect_server(port=port, home=home, timeout=timeout, die_with_parent=die_with_parent)
    ready()
    return server


def launch_prefect_server(
    *, port: int | None = None, home: str | Path | None = '.durcap/prefect', timeout: float = 120.0,
    die_with_parent: bool = False,
) -> tuple[ServerProcess, Callable[[], None]]:
    """Launch `prefect server start` (arguments as for `start_prefect_server`) without waiting for it.

    Returns:
        `(server, ready)`: call `ready()` to wait for `/api/health`; it raises RuntimeError (the server exited; the
        message ends with its log) or TimeoutError (not ready within `timeout` seconds of the call), stopping the
        server first.
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
    process = subprocess.Popen(
        [command_path('prefect') or 'prefect', 'server', 'start', '--host', '127.0.0.1', '--port', str(port), '--analytics-off', '--no-ui'],
        stdout=log, stderr=subprocess.STDOUT, env=env,
        **({'preexec_fn': bind_to_parent} if die_with_parent else {'start_new_session': True}),  # type: ignore[call-overload]
    )
    log.close()
    server = ServerProcess(ENGINE, process, api, log_path, extra)

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(f'{api}/health', timeout=1) as response:
                return response.status == 200
        except OSError:
            return False

    def ready() -> None:
        try:
            wait_until_ready(healthy, process, timeout, 'prefect server', log_path)
        except BaseException:
            server.stop()
            raise

    return server, ready
