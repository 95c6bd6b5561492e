"""The Starlette app of `durcap serve`: the API's routes (`_app.ServeApp`'s handlers) and the two protocol endpoints
(`_protocols.protocol_turn`), joined here so neither module imports the other's caller."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.routing import Route

from ..agent import DurableAgent
from ..streams import STREAM_ENGINES
from ._app import Auth, DepsFactory, ServeApp, _handler, _http_error
from ._protocols import RUN_ID_HEADER, protocol_turn

__all__ = ['build']


def build(agents: Sequence[DurableAgent[Any, Any]], *, engine: str, settings: Mapping[str, Any], auth: Auth,
          deps_factory: DepsFactory | None, max_body_bytes: int, cors_origins: Sequence[str],
          chat: bool) -> Starlette:
    """The Starlette app (`create_app` checks the arguments first)."""
    if engine == 'prefect':
        from . import PREFECT_NOT_SERVED

        raise ValueError(PREFECT_NOT_SERVED)
    if engine not in STREAM_ENGINES:
        raise ValueError(f'engine {engine!r}: durcap serve runs turns on {", ".join(STREAM_ENGINES)} (their runs '
                         'publish the event stream the API serves)')
    names: dict[str, DurableAgent[Any, Any]] = {}
    for agent in agents:
        if agent.name in names:
            raise ValueError(f'two agents are named {agent.name!r}: serve each name once')
        names[agent.name] = agent
    if not names:
        raise ValueError('create_app needs at least one DurableAgent')
    app = ServeApp(names, engine, settings, auth, deps_factory, max_body_bytes)
    routes = [
        Route('/v1/conversations/{conversation_id}/turns', _handler(app, app.post_turn), methods=['POST']),
        Route('/v1/conversations/{conversation_id}', _handler(app, app.conversation), methods=['GET']),
        Route('/v1/runs/{run_id}/events', _handler(app, app.events), methods=['GET']),
        Route('/v1/runs/{run_id}/approvals', _handler(app, app.approvals), methods=['GET']),
        Route('/v1/runs/{run_id}/approvals/{call_id}', _handler(app, app.decide), methods=['POST']),
        Route('/v1/runs/{run_id}', _handler(app, app.run_status), methods=['GET']),
        Route('/v1/agents/{agent}/ag-ui', _handler(app, partial(protocol_turn, app, protocol='ag-ui')), methods=['POST']),
        Route('/v1/agents/{agent}/vercel-ai', _handler(app, partial(protocol_turn, app, protocol='vercel-ai')),
              methods=['POST']),
    ]
    if chat:
        from ._chat import chat_page

        routes.append(Route('/chat', chat_page, methods=['GET']))
    middleware = []
    if cors_origins:
        from starlette.middleware import Middleware
        from starlette.middleware.cors import CORSMiddleware

        # `X-Durcap-Run-Id` (the protocol endpoints' run) is exposed: a browser hides a response header CORS does not
        # list from the page's script, which then could not read where the run is from the header the docs name.
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=['GET', 'POST'],
                                     allow_headers=['Authorization', 'Content-Type', 'Idempotency-Key', 'Last-Event-ID'],
                                     expose_headers=[RUN_ID_HEADER]))
    starlette = Starlette(routes=routes, middleware=middleware, exception_handlers={HTTPException: _http_error})
    starlette.state.serve = app
    return starlette
