"""`durcap ui`: serve the web pages over runs, conversations and approvals (`durable_capabilities.ui`).

Exit codes: 0 stopped (Ctrl-C / SIGTERM); 2 unusable input (an engine not installed, the port is taken).
"""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer

from .._limits import INPUT_CODE, printable
from . import _err, _unusable, app, engine_metavar, engine_name
from ._options import StoreOption, connection_options, connection_settings

TOKEN_ENV = 'DURCAP_UI_TOKEN'  # noqa: S105 - the variable's name, not a token
"""The environment variable holding the decision token (otherwise one is generated and printed at start)."""

LOOPBACK = ('127.0.0.1', '::1', 'localhost')


def _refuse_missing_folders(settings: Any, engines: list[str], store: str | None) -> None:
    """Exit 2 (DC040) when a SQLite database the pages would read, an engine's (`--db`) or the conversation store
    (`--store`), lies in a folder that does not exist: nothing ever ran there (a run or a worker creates its file), so
    the pages could only ever be empty; a mistyped path is said at start, as `durcap run --queue` says it. A missing
    file in an existing folder passes (the first run or worker may come after the pages are up), and so do the
    defaults (`.durcap/...`, before anything ran here): only a URL given (flag or environment) is checked."""
    from pathlib import Path

    import sqlalchemy as sa

    from ..engines import get

    named = [(s.option, settings.engine().get(s.field)) for name in engines for s in get(name).spec.settings
             if s.kind == 'database']
    for option, value in [*named, ('--store', store and settings.store)]:
        if not isinstance(value, str):
            continue
        url = sa.make_url(value)
        if url.get_backend_name() != 'sqlite' or not url.database:
            continue
        folder = Path(url.database).parent
        if not folder.exists():
            _unusable(f'{INPUT_CODE} {option} {printable(value)!r}: folder {printable(str(folder))} does not exist, so '
                      'nothing has run there: give the URL your runs and workers use (their '
                      f'{option}), or create the folder')


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
    _refuse_missing_folders(settings, application.state.engines, store or os.environ.get('DURCAP_STORE') or None)
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
