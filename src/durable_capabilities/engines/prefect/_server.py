"""Which Prefect API a process talks to: the configured one, else a temporary local server it starts once."""

from __future__ import annotations

import atexit
import os
from typing import Any

from prefect.context import refresh_global_settings_context
from prefect.settings import get_current_settings

from ..._servers import start_prefect_server

_TEMPORARY_SERVER: list[Any] = []
"""The temporary local Prefect server this process started (at most one; see `ensure_api`)."""


def configured_api() -> str | None:
    """The Prefect API URL configured for this process (`PREFECT_API_URL`, or the active Prefect profile), or `None`."""
    return get_current_settings().api.url or None


def ensure_api() -> tuple[str, bool]:
    """The Prefect API this process talks to: `(url, temporary)`.

    The configured one (`configured_api`), else a temporary local server this process starts once (`prefect server
    start` on a free port, on the database of the user's Prefect home, as Prefect's own temporary server would) and
    points every Prefect client of the process at (`PREFECT_API_URL` and `refresh_global_settings_context`, so
    Prefect's background threads see it too). The server dies with this process, even on `kill -9`
    (`_servers.start_prefect_server(die_with_parent=True)`), and is stopped at exit.

    Raises:
        RuntimeError / TimeoutError: the temporary server did not come up.
    """
    if _TEMPORARY_SERVER:
        return _TEMPORARY_SERVER[0].address, True
    url = configured_api()
    if url:
        return url, False
    server = start_prefect_server(home=None, die_with_parent=True)
    _TEMPORARY_SERVER.append(server)
    atexit.register(server.stop)
    os.environ['PREFECT_API_URL'] = server.address
    refresh_global_settings_context()
    return server.address, True


def server_line() -> str:
    """The line a run prints before it starts: which Prefect API it uses (starting the temporary server if needed)."""
    url, temporary = ensure_api()
    if temporary:
        return (f'prefect server: temporary local server at {url}, started by this command and stopped with it '
                '(PREFECT_API_URL is not set)')
    return f'prefect server: {url}'
