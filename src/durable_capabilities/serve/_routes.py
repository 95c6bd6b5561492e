"""The Starlette app of `durcap serve`: the API's routes (`_app.ServeApp`'s handlers) and the two protocol endpoints
(`_protocols.protocol_turn`), joined here so neither module imports the other's caller."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ..agent import DurableAgent
from ..streams import STREAM_ENGINES
from ._app import DEFAULT_KEEPALIVE_SECONDS, Auth, DepsFactory, ServeApp, _handler, _http_error
from ._protocols import RUN_ID_HEADER, protocol_turn

__all__ = ['build']


class _ServeStarlette(Starlette):
    """The serve app: a `Starlette`, whose two requests of every turn (`POST /v1/conversations/{id}/turns` and `GET
    /v1/runs/{id}/events`) go straight to their handlers: `_handler` already answers every refusal and failure of a
    handler itself, so Starlette's error and exception middleware, its router (a regex per route tried) and the
    wrappers of each `send` are work for nothing on them. Only while the app has no middleware of its own (CORS, or
    any a user adds: then every request goes through Starlette as before) and no `root_path` (mounted: Starlette
    routes it). Any other request, method or path (HEAD, a trailing slash, an unknown route) goes to Starlette."""

    fast_turns: Any = None
    fast_events: Any = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope['type'] == 'http' and not self.user_middleware and not scope.get('root_path'):
            path, method, handler, params = scope['path'], scope['method'], None, None
            if method == 'POST' and path.startswith('/v1/conversations/') and path.endswith('/turns'):
                key = path[18:-6]
                if key and '/' not in key:
                    handler, params = self.fast_turns, {'conversation_id': key}
            elif method == 'GET' and path.startswith('/v1/runs/') and path.endswith('/events'):
                key = path[9:-7]
                if key and '/' not in key:
                    handler, params = self.fast_events, {'run_id': key}
            if handler is not None:
                scope['app'] = self
                scope['path_params'] = params
                response = await handler(Request(scope, receive, send))
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def build(agents: Sequence[DurableAgent[Any, Any]], *, engine: str, settings: Mapping[str, Any], auth: Auth,
          deps_factory: DepsFactory | None, max_body_bytes: int, cors_origins: Sequence[str],
          chat: bool, keepalive_seconds: float = DEFAULT_KEEPALIVE_SECONDS) -> Starlette:
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
    app = ServeApp(names, engine, settings, auth, deps_factory, max_body_bytes, keepalive_seconds)
    turns, events = _handler(app, app.post_turn), _handler(app, app.events)
    routes = [
        Route('/v1/conversations/{conversation_id}/turns', turns, methods=['POST']),
        Route('/v1/conversations/{conversation_id}', _handler(app, app.conversation), methods=['GET']),
        Route('/v1/runs/{run_id}/events', events, methods=['GET']),
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
    starlette = _ServeStarlette(routes=routes, middleware=middleware, exception_handlers={HTTPException: _http_error})
    starlette.fast_turns, starlette.fast_events = turns, events
    starlette.state.serve = app
    return starlette
