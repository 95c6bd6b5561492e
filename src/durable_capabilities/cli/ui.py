"""`durcap ui`: serve the web pages over runs, conversations and approvals (`durable_capabilities.ui`).

Exit codes: 0 stopped (Ctrl-C / SIGTERM); 2 unusable input (an engine not installed, the port is taken).
"""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer

from .._limits import INPUT_CODE
from . import _err, _unusable, app, engine_metavar, engine_name
from ._options import StoreOption, connection_options, connection_settings

TOKEN_ENV = 'DURCAP_UI_TOKEN'  # noqa: S105 - the variable's name, not a token
"""The environment variable holding the decision token (otherwise one is generated and printed at start)."""

LOOPBACK = ('127.0.0.1', '::1', 'localhost')


@app.command()
@connection_options('read')
def ui(
    host: Annotated[str, typer.Option(help='Interface to bind (default loopback only: the pages show run data).')] = '127.0.0.1',
    port: Annotated[int, typer.Option(help='TCP port.', min=1, max=65535)] = 8765,
    engine: Annotated[list[str] | None, typer.Option('--engine', '-e', parser=engine_name(durable_only=True),
                                                     metavar=engine_metavar(True),
                                                     help='Engines to read (repeatable; default: every installed durable engine).')] = None,
    limit: Annotated[int, typer.Option(help='Runs listed per engine, newest first.', min=1)] = 50,
    store: StoreOption = None,
    conn: dict[str, Any] | None = None,
) -> None:
    """Serve runs, one run's durable units and conversation, and pending approvals (approve / deny) as web pages.

    Decisions need the token from $DURCAP_UI_TOKEN, or the one printed at start, typed into the form.
    """
    import socket

    try:
        import uvicorn

        from ..ui import create_app, new_token
    except ImportError as exc:
        _unusable(f'durcap ui needs its extra: pip install "durable-capabilities[ui]" ({exc})')
    from ..reading import EngineNotInstalled

    token = os.environ.get(TOKEN_ENV) or new_token()
    settings = connection_settings(conn or {}, store)
    try:
        application = create_app(settings, token, engines=engine, limit=limit)
    except EngineNotInstalled as exc:
        _unusable(str(exc))
    try:
        with socket.create_server((host, port)):
            pass  # free: uvicorn binds it next (its own error on a taken port is a log line and exit 1)
    except OSError as exc:
        _unusable(f'{INPUT_CODE} cannot serve on {host}:{port}: {exc.strerror or exc}')
    if host not in LOOPBACK:
        _err.print(f'durcap ui: warning: serving on {host}, not loopback: anyone who reaches it sees run data '
                   '(decisions still need the token)', markup=False)
    shown = f'[{host}]' if ':' in host else host
    where = ', '.join(f'{k} {v}' for k, v in settings.describe(application.state.engines).items())
    _err.print(f'durcap ui: http://{shown}:{port}/ ({where})', markup=False)
    _err.print(f'durcap ui: decision token from ${TOKEN_ENV}' if os.environ.get(TOKEN_ENV)
               else f'durcap ui: decision token: {token}', markup=False)
    config = uvicorn.Config(application, host=host, port=port, log_level='warning', access_log=False)
    server = uvicorn.Server(config)
    server.run()
