"""`durcap serve TARGET`: the HTTP API for applications (`durable_capabilities.serve`), run with uvicorn.

Exit codes: 0 stopped (Ctrl-C / SIGTERM); 1 TARGET has errors; 2 unusable input (an extra not installed, the port
is taken, bad --deps-json).
"""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer

from .._limits import INPUT_CODE, InputError
from . import _err, _unusable, _valid_agents, app
from ._options import StoreOption, check_stream_env, connection_options, connection_settings, queue_setting
from .ui import LOOPBACK

SERVE_ENGINES = ('local', 'dbos', 'temporal')


def _serve_engine(value: str) -> str:
    if value == 'prefect':
        from ..serve import PREFECT_NOT_SERVED

        raise typer.BadParameter(f'DC040 {PREFECT_NOT_SERVED}')
    if value not in SERVE_ENGINES:
        raise typer.BadParameter(f'DC040 {value!r} is not one of {", ".join(map(repr, SERVE_ENGINES))} (the engines '
                                 'whose runs publish event streams the API can name).')
    return value


def _check_engine(engine: str, settings: dict[str, Any]) -> None:
    """Exit 2 (DC040) when the engine's server cannot be reached (`EngineAdapter.check_serving`: Temporal within its
    connect timeout, as `durcap worker temporal` refuses to start); print its warnings (serve starts anyway)."""
    import asyncio

    from ..engines import EngineUnreachableError, get

    try:
        warnings = asyncio.run(get(engine).check_serving(settings))
    except EngineUnreachableError as exc:
        _unusable(f'{INPUT_CODE} cannot serve {engine}: {exc}')
    except InputError as exc:  # e.g. a bad $DURCAP_TEMPORAL_CONNECT_TIMEOUT
        _unusable(str(exc))
    for line in warnings:
        _err.print(f'durcap serve: warning: {line}', markup=False)


@app.command()
@connection_options('read')
def serve(
    target: Annotated[str, typer.Argument(help='module:attr naming the agent(s) to serve.')],
    engine: Annotated[str, typer.Option('--engine', '-e', parser=_serve_engine, metavar='<local|dbos|temporal>',
                                        help='Where turns run (dbos: handed to `durcap worker dbos` on --queue; temporal: '
                                        'started as workflows on --task-queue, run by `durcap worker temporal`).')] = 'local',
    host: Annotated[str, typer.Option(help='Interface to bind (default loopback only).')] = '127.0.0.1',
    port: Annotated[int, typer.Option(help='TCP port.', min=1, max=65535)] = 8780,
    queue: Annotated[str | None, typer.Option(help='DBOS queue the turns are handed to (served by `durcap worker dbos '
                                              '--queue`; default durcap).')] = None,
    task_queue: Annotated[str | None, typer.Option('--task-queue', help='Temporal task queue the turns are started on '
                                                   '(polled by `durcap worker temporal --task-queue`; default durcap). '
                                                   'With --engine dbos: the same as --queue.')] = None,
    deps_json: Annotated[str | None, typer.Option('--deps-json', help="Deps (JSON, of the agent's deps_type) for "
                                                  'turns whose request carries none.')] = None,
    cors_origin: Annotated[list[str] | None, typer.Option('--cors-origin', help='An origin allowed to call the API '
                                                          'from a browser (repeatable; default: CORS off).')] = None,
    max_body_bytes: Annotated[int, typer.Option(help='Largest request body read (bytes).', min=1)] = 1024 * 1024,
    chat: Annotated[bool, typer.Option('--chat/--no-chat', help='Also serve a small chat page at /chat.')] = False,
    keepalive: Annotated[float, typer.Option(help='Seconds an event stream may stay silent before it gets an SSE '
                                             'comment line (for proxies with idle timeouts; 0: none).',
                                             min=0)] = 15.0,
    store: StoreOption = None,
    conn: dict[str, Any] | None = None,
) -> None:
    """Serve TARGET's agents over HTTP: turns, their event streams (SSE), runs, conversations and approvals under /v1.

    Requests need `Authorization: Bearer TOKEN`: $DURCAP_SERVE_TOKEN (one token, or principal=token pairs separated
    by commas), else a token printed at start.
    """
    import socket

    try:
        import uvicorn

        from ..serve import TOKEN_ENV, create_app
        from ..serve._app import check_cors_origin, parse_tokens
        from ..ui import new_token
    except ImportError as exc:
        _unusable(f'{INPUT_CODE} durcap serve needs its extra: pip install "durable-capabilities[serve]" ({exc})')
    from .engine_commands import _deps

    agents = _valid_agents(target, use_lock=engine != 'local', refused='not served: fix the errors above' if
                           engine != 'local' else '', engine=engine)
    if not agents:
        _unusable(f'{INPUT_CODE} {target} names no agents')
    deps_factory = None
    if deps_json is not None:
        if len(agents) != 1:
            _unusable(f'{INPUT_CODE} --deps-json: {target} names {len(agents)} agents; --deps-json needs exactly one')
        deps = _deps(agents[0], deps_json)
        deps_factory = lambda principal, request: deps  # noqa: E731
    raw = os.environ.get(TOKEN_ENV)
    token = raw or new_token()
    try:
        tokens = parse_tokens(token)
    except ValueError as exc:
        _unusable(f'{INPUT_CODE} {exc}')
    for origin in cors_origin or ():
        try:
            check_cors_origin(origin)
        except ValueError as exc:
            _unusable(f'--cors-origin: {exc}')
    check_stream_env()
    settings = connection_settings(conn or {}, store)
    run_settings: dict[str, Any] = {**settings.engine(), 'store': settings.store}
    queues = queue_setting({'queue': queue, 'task_queue': task_queue}, engine)  # exit 2 on one naming nothing
    if engine == 'dbos':
        queue = run_settings['queue'] = queues['queue'] or 'durcap'
    elif engine == 'temporal':
        task_queue = run_settings['task_queue'] = queues['task_queue'] or 'durcap'
    _check_engine(engine, run_settings)
    from ..serve import bearer_auth

    application = create_app(agents, engine=engine, settings=run_settings, auth=bearer_auth(tokens),
                             deps_factory=deps_factory, max_body_bytes=max_body_bytes, cors_origins=cors_origin or (),
                             chat=chat, keepalive_seconds=keepalive)
    try:
        with socket.create_server((host, port)):
            pass  # free: uvicorn binds it next
    except OSError as exc:
        _unusable(f'{INPUT_CODE} cannot serve on {host}:{port}: {exc.strerror or exc}')
    if host not in LOOPBACK:
        _err.print(f'durcap serve: warning: serving on {host}, not loopback: put TLS in front of it', markup=False)
    shown = f'[{host}]' if ':' in host else host
    where = ', '.join(f'{k} {v}' for k, v in settings.describe([engine]).items())
    names = ', '.join(a.name for a in agents)
    _err.print(f'durcap serve: http://{shown}:{port}/v1 (agents {names}; engine {engine}'
               + (f', queue {queue!r}' if engine == 'dbos' else '')
               + (f', task queue {task_queue!r}' if engine == 'temporal' else '') + f'; {where})'
               + (f'; chat page http://{shown}:{port}/chat' if chat else ''), markup=False)
    _err.print(f'durcap serve: bearer token from ${TOKEN_ENV}' if raw else f'durcap serve: bearer token: {token}',
               markup=False)
    from ..serve._http import protocol_class

    # each response's head in one socket write with its body (`serve._http`): one write less a response
    config = uvicorn.Config(application, host=host, port=port, log_level='warning', access_log=False,
                            http=protocol_class())
    uvicorn.Server(config).run()
