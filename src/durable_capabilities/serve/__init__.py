"""`durcap serve`: durable agents served to applications over HTTP (an ASGI app, Starlette, mountable in your own).

| method and path | what |
|---|---|
| `POST /v1/conversations/{conversation_id}/turns` | `{"agent", "prompt", "deps"?}`; `Idempotency-Key` makes a retried POST return the same run; 202 `{"run_id", "events_url", ...}` |
| `GET /v1/runs/{run_id}/events` | the run's events as Server-Sent Events, `id:` = offset, `Last-Event-ID` resumes |
| `GET /v1/runs/{run_id}` | status (`queued`, `running`, `waiting`, `completed`, `failed`) and the run's report |
| `GET /v1/conversations/{conversation_id}` | the stored conversation (`durcap history show --format json`) |
| `GET /v1/runs/{run_id}/approvals` | the calls waiting for a decision, with their fingerprints |
| `POST /v1/runs/{run_id}/approvals/{call_id}` | `{"decision": "approve" or "deny", "fingerprint", "args"?, "reason"?}` |

Stateless: the conversation owners, the runs requests started and the idempotency keys live in the conversation
store (schema version 7), the events in the run's stream there; any number of serve processes on one engine and
store act as one. A refusal is a JSON body `{"error": {"code", "status", "message"}}` (codes DC041-DC045, DC051,
DC054, `approval`), never a traceback. See docs/serving.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..agent import DurableAgent
from ._errors import (
    BadRequestError,
    IdempotencyConflictError,
    NotFoundError,
    RequestTooLargeError,
    ServeError,
    UnauthenticatedError,
)

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from ..settings import Settings
    from ._app import Auth, DepsFactory

__all__ = [
    'PREFECT_NOT_SERVED',
    'TOKEN_ENV',
    'BadRequestError',
    'IdempotencyConflictError',
    'NotFoundError',
    'RequestTooLargeError',
    'ServeError',
    'UnauthenticatedError',
    'bearer_auth',
    'create_app',
]

TOKEN_ENV = 'DURCAP_SERVE_TOKEN'  # noqa: S105 - the variable's name, not a token
"""The bearer token(s) of the default `auth`: one token, or `alice=TOKEN1,bob=TOKEN2`."""


PREFECT_NOT_SERVED = ("durcap serve does not run turns on Prefect yet: a Prefect flow run's id (which names its event "
                      'stream) is chosen by the Prefect server when the flow run is created, after the API has '
                      'answered the POST with its run id, so the run could not be streamed, approved or shown. Serve '
                      "with --engine local, dbos or temporal; run Prefect turns with `durcap run --engine prefect` or "
                      '`durcap schedule prefect`.')
"""Why `create_app(engine='prefect')` and `durcap serve --engine prefect` are refused (ValueError / DC040)."""


def bearer_auth(tokens: str | Mapping[str, str]) -> Auth:
    """The default `auth` (`Authorization: Bearer TOKEN`): see `_app.bearer_auth`."""
    from ._app import bearer_auth as make

    return make(tokens)


def create_app(
    targets: DurableAgent[Any, Any] | Sequence[DurableAgent[Any, Any]] | str,
    *,
    engine: str = 'local',
    settings: Settings | Mapping[str, Any] | None = None,
    auth: Auth | None = None,
    deps_factory: DepsFactory | None = None,
    max_body_bytes: int | None = None,
    cors_origins: Sequence[str] = (),
    chat: bool = False,
    keepalive_seconds: float | None = None,
) -> Starlette:
    """The serve ASGI app (Starlette): mount it in your own app, or run it with `durcap serve TARGET`.

    Args:
        targets: The agents served (by name): one `DurableAgent`, a list, or a TARGET string (`module:attr`).
        engine: Where turns run: `local` (in this process), `dbos` (handed to the `durcap worker dbos` processes
            serving the DBOS queue `settings['queue']`, default `durcap`), `temporal` (started as workflows on the
            task queue `settings['task_queue']`, default `durcap`, at `settings['address']`, run by the
            `durcap worker temporal` processes serving it). Not `prefect` (`PREFECT_NOT_SERVED` says why).
        settings: Where the engine and the conversation store are: a `Settings` (`Settings.resolve()`), or a mapping
            of run settings (`store`, `db`, `queue`, `busy`, ...); default `Settings.resolve()`.
        auth: `auth(request) -> principal | None` (sync or async); default `bearer_auth($DURCAP_SERVE_TOKEN)`.
        deps_factory: `deps_factory(principal, request) -> deps` (sync or async) for a turn whose request carries no
            deps; default none (`None` deps).
        max_body_bytes: The largest request body read (default 1 MiB): a larger one is refused (DC041, 413).
        cors_origins: Origins allowed to call the API from a browser (CORS: `scheme://host[:port]`, or `*`); default
            none (CORS off).
        chat: Also serve the small chat page at `/chat`.
        keepalive_seconds: An event stream (`GET /v1/runs/{run}/events`) that wrote nothing for this many seconds
            gets an SSE comment line (`: keepalive`), which clients skip, so that a proxy with an idle timeout does not
            cut the stream of a run waiting for an approval or a worker (default 15; 0: none).

    Returns:
        A Starlette app; `app.state.serve` holds the handlers (its `tasks`: the turns this process runs or awaits).

    Raises:
        ValueError: no agents, two agents of one name, an engine without event streams, no
            `auth` and no `$DURCAP_SERVE_TOKEN`, `max_body_bytes` under 1, `keepalive_seconds` under 0, or a CORS origin that is not one (DC040:
            `https://app.example.com`, not a URL with a path).
        targets.UnusableTarget / DurableConfigError: `targets` is a TARGET string that does not load.
    """
    from ._app import DEFAULT_KEEPALIVE_SECONDS, DEFAULT_MAX_BODY_BYTES, check_cors_origin, parse_tokens
    from ._app import bearer_auth as make_auth
    from ._routes import build

    if isinstance(targets, str):
        from ..targets import load

        loaded = load(targets)
        loaded.raise_for_errors()
        agents = list(loaded.agents)
    elif isinstance(targets, DurableAgent):
        agents = [targets]
    else:
        agents = list(targets)
    if settings is None:
        from ..settings import Settings

        settings = Settings.resolve()
    run_settings = dict(settings) if isinstance(settings, Mapping) else {**settings.engine(), 'store': settings.store}
    if auth is None:
        token = os.environ.get(TOKEN_ENV)
        if not token:
            raise ValueError(f'create_app: pass auth=..., or set ${TOKEN_ENV} (a bearer token, or principal=token '
                             'pairs separated by commas)')
        auth = make_auth(parse_tokens(token))
    cors_origins = [check_cors_origin(origin) for origin in cors_origins]
    limit = DEFAULT_MAX_BODY_BYTES if max_body_bytes is None else int(max_body_bytes)
    if limit < 1:
        raise ValueError(f'max_body_bytes={max_body_bytes!r}: expected a positive number of bytes')
    keepalive = DEFAULT_KEEPALIVE_SECONDS if keepalive_seconds is None else float(keepalive_seconds)
    if not keepalive >= 0:  # NaN too
        raise ValueError(f'keepalive_seconds={keepalive_seconds!r}: expected seconds, 0 or more (0: no keepalive '
                         'comments)')
    return build(agents, engine=engine, settings=run_settings, auth=auth, deps_factory=deps_factory,
                 max_body_bytes=limit, cors_origins=cors_origins, chat=chat, keepalive_seconds=keepalive)
